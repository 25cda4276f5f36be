"""The MLX model runner: lives on the engine thread and does all MLX work (prefill, decode, logits), on Metal or
MLX's CPU backend."""

from __future__ import annotations

import dataclasses
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten
import numpy as np

from mlx_engine.api import (
    NO_DRAFT_MODEL,
    GenerationRequest,
    ModelInfo,
    RequestError,
    RooflineError,
    SamplingParams,
)
from mlx_engine.backends.common import NoTokenizer, attach_draft, cap_context, model_fingerprint
from mlx_engine.backends.mlx.load import (
    DRAFT_GROUP_SIZE,
    decode_shape,
    pick_dtype,
    quantize_weights,
    use_host_blas,
    wire_memory,
)
from mlx_engine.loading import load_checkpoint
from mlx_engine.models import BuiltModel, build_model, count_parameters
from mlx_engine.sampling import target_logprobs


def _sample_rows(logits: mx.array, samplers: list[Any]) -> mx.array:
    """(n, V) -> (n,) int32: one argmax for the greedy rows when all are, else each row by its sampler."""
    if all(s.greedy for s in samplers):
        return mx.argmax(logits, axis=-1).astype(mx.int32)
    return mx.concatenate([s.sample(logits[i : i + 1]) for i, s in enumerate(samplers)])


class Runner:
    def __init__(self, built: BuiltModel, tokenizer: Any, info: ModelInfo, prefill_chunk_size: int):
        self.model = built.model
        self.native = built.native
        self.tokenizer = tokenizer
        self.info = info
        self.prefill_chunk_size = prefill_chunk_size
        self.context_length = info.context_length
        self.vocab_size = info.vocab_size
        self.eos_ids = frozenset(info.eos_token_ids)
        self.cache: Any = None  # PagedCache or ContiguousCache, set by load()

    @classmethod
    def load(
        cls,
        model: str | None,
        dtype: str | None = None,
        prefill_chunk_size: int = 512,
        max_context: int | None = None,
        block_size: int = 16,
        kv_bits: int | None = None,
        kv_group_size: int = 64,
        kv_budget_bytes: int | None = None,
        prefix_caching: bool = True,
        paged_kv: bool | None = None,
        draft_model: str | None = None,
        self_draft_layers: int | None = None,
        kv_key_bits: int | None = None,
        kv_key_per_channel: bool | None = None,
        draft_bits: int | None = None,
        draft_optional: bool = False,
        *,
        weight_bits: int | None = None,
        shard: Any = None,
    ) -> Runner:
        """`draft_bits`: hold the draft at 4 or 8 bits (`weight_bits` of its own load: `quantize_weights`).
        `draft_optional`: a draft model that cannot serve this one is a warning, not an error (`attach_draft`).
        `shard(built, checkpoint)`: keeps a rank's share of the built model before its weights are read
        (`mlx_engine.distributed`)."""
        from mlx_engine.kv.config import KVConfig

        kv_config = KVConfig(block_size, kv_bits, kv_group_size, kv_budget_bytes, prefix_caching, kv_key_bits,
                             kv_key_per_channel)
        if not isinstance(prefill_chunk_size, int) or prefill_chunk_size < 1:
            raise RooflineError(f"prefill_chunk_size={prefill_chunk_size!r}: expected an integer >= 1")
        if draft_bits not in (None, 4, 8):
            raise RooflineError(f"draft_bits={draft_bits!r}: expected 4 or 8 (affine groups of {DRAFT_GROUP_SIZE})")
        if draft_bits is not None and draft_model is None:
            raise RooflineError(f"draft_bits={draft_bits} needs draft_model: the model to hold at {draft_bits} bits "
                                "as the draft (it may be the model itself)")
        from mlx_engine.models.kquant import blocks_here

        # k-quants as blocks on Metal (models.kquant), unless they are to be quantized again here
        ckpt = load_checkpoint(model, kquant_blocks=blocks_here() and weight_bits is None)
        act_dtype = pick_dtype(dtype, ckpt.checkpoint_dtype)
        built = build_model(ckpt.config, ckpt.weights, act_dtype, ckpt.quantization, str(ckpt.path))
        if ckpt.source_format == "gguf":
            from mlx_engine.loading.gguf_model import apply_freq_factors

            apply_freq_factors(built.model, ckpt.config)
        if shard is not None:
            shard(built, ckpt)
        quant_label = ckpt.quant_label
        if weight_bits is not None:
            quantize_weights(built.model, weight_bits)
            quant_label = f"{weight_bits}-bit affine g{DRAFT_GROUP_SIZE}, from {quant_label}"
        mx.eval(built.model.parameters())
        del ckpt.weights
        host_bytes, idle_bytes, host_note = use_host_blas(built.model, act_dtype)
        tokenizer = ckpt.tokenizer or NoTokenizer(ckpt.path, ckpt.config)
        context = built.context_length
        context = cap_context(context, max_context)
        params = dict(tree_flatten(built.model.parameters()))
        notes = (host_note,) if host_note else ()
        warnings = () if built.native else (
            f"{built.model_type!r} runs on mlx-lm's model class: generation works; paged KV, prefix caching "
            "and speculative decoding may be unavailable",
        )
        wired_note = wire_memory(sum(v.nbytes for v in params.values()))
        warnings += (wired_note,) if wired_note else ()
        eos = tuple(tokenizer.eos_token_ids)
        info = ModelInfo(
            name=ckpt.name,
            path=str(ckpt.path),
            model_type=built.model_type,
            source_format=ckpt.source_format,
            num_parameters=count_parameters(built.model),
            quantization=quant_label,
            context_length=context,
            weight_bytes=sum(v.nbytes for v in params.values()) + host_bytes,
            vocab_size=int(ckpt.config.get("vocab_size") or tokenizer.vocab_size),
            native=built.native,
            dtype=str(act_dtype).removeprefix("mlx.core."),
            eos_token_ids=eos,
            notes=notes,
            warnings=warnings,
            has_tokenizer=ckpt.tokenizer is not None,
        )
        runner = cls(built, tokenizer, info, prefill_chunk_size)
        runner._shape = decode_shape(ckpt.config, params, act_dtype)
        runner._host_bytes, runner._shape["idle_bytes"] = host_bytes, idle_bytes
        runner.fingerprint = model_fingerprint(ckpt, act_dtype)
        runner.cache = runner._make_cache(kv_config, paged_kv, act_dtype)
        runner.cache.calibrate(runner.model, tokenizer, runner.vocab_size)  # quantized KV: `kv.smoothing`
        from mlx_engine.backends.mlx.kernel_checks import kernel_warnings

        # a Metal kernel that fails its check on this machine: its reference runs, and the user is told once
        fallbacks = kernel_warnings(runner.model, runner.cache, act_dtype)
        runner.info = dataclasses.replace(runner.info, kv_files=runner.cache.capabilities.kv_files,
                                          warnings=runner.info.warnings + fallbacks)
        runner.self_draft_layers = runner._check_self_draft_layers(self_draft_layers)
        if draft_model is not None:
            attach_draft(runner, lambda: cls.load(draft_model, dtype=dtype, prefill_chunk_size=prefill_chunk_size,
                                                  paged_kv=False, weight_bits=draft_bits), draft_optional)
        return runner

    # --- speculative decoding ---

    draft: Runner | None = None  # the draft model (Engine.load(..., draft_model=...))
    self_draft_layers: int = 0

    def _check_self_draft_layers(self, n: int | None) -> int:
        num = len(self.model.layers) if self.native else 0
        if n is None:
            return max(1, num // 2)
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n < max(num, 2):
            raise RooflineError(f"self_draft_layers={n!r}: expected an integer in [1, {max(num - 1, 1)}] "
                                f"(the model has {num} layers)")
        return n

    def rollback_problem(self) -> str | None:
        """Why this model's KV cannot be rolled back past rejected draft tokens (None: it can)."""
        from mlx_engine.kv.contiguous import untrimmable_kinds

        if self.native or self.cache.capabilities.rollback:  # our models' caches all roll back
            return None
        kinds = untrimmable_kinds(self.model, self.native)
        return f"its mlx-lm cache ({', '.join(kinds) or 'unknown'}) cannot be trimmed at every length"

    def check_speculation(self, params: SamplingParams) -> None:
        """Refuses a speculative mode this engine cannot serve (RequestError). "auto" is never refused: it
        falls back to plain decoding."""
        mode = params.speculative
        if mode is None or mode == "auto":
            return
        why = self.rollback_problem()
        if why:
            raise RequestError(f"speculative={mode!r} is not available for {self.info.name}: {why}, so rejected "
                               "draft tokens cannot be rolled back")
        if mode == "draft" and self.draft is None:
            raise RequestError(NO_DRAFT_MODEL)
        if mode == "self" and not self.native:
            raise RequestError(f"speculative='self' needs a natively implemented model; {self.info.name} runs "
                               "on an mlx-lm class")

    def all_logits(self, inputs: mx.array, layers: list[Any]) -> mx.array:
        """inputs (1, L) -> logits of every position (L, V), float32, lazily (a verification)."""
        out = self.forward(inputs, layers)
        logits = self.model.logits(out) if self.native else out
        return logits[0].astype(mx.float32)

    def draft_logits(self, inputs: mx.array, layers: list[Any], num_layers: int) -> mx.array:
        """The self draft: inputs (1, L) through the first `num_layers` layers, the final norm and the head
        -> logits of the last position (1, V), float32. `layers`: the caches of those layers."""
        m = self.model
        h = m.hidden(inputs, layers, num_layers)
        return m.logits(m.model.norm(h[:, -1, :])).astype(mx.float32)

    def _make_cache(self, config: Any, paged: bool | None, dtype: mx.Dtype) -> Any:
        from mlx_engine.api import MAX_DRAFT_TOKENS
        from mlx_engine.kv.contiguous import ContiguousCache
        from mlx_engine.kv.kinds import LayerKindsCache

        why_not = None
        if not self.native:
            why_not = "the model runs on an mlx-lm class"
        if paged is False or (paged is None and why_not):
            if config.kv_bits is not None or config.kv_key_bits is not None or config.kv_key_per_channel:
                name = "kv_bits" if config.kv_bits is not None else \
                    "kv_key_bits" if config.kv_key_bits is not None else "kv_key_per_channel"
                raise RooflineError(f"{name} needs the paged KV cache, which is off here "
                                    f"({why_not or 'paged_kv=False'})")
            return ContiguousCache(self.model, self.native)
        if why_not:
            raise RooflineError(f"paged_kv=True is not available: {why_not}")
        a = self.model.args
        # one paged storage per kind of layer (sliding windows, full attention): a plain PagedCache for one kind
        return LayerKindsCache.create(layer_windows=a.layer_windows(), num_kv_heads=a.num_key_value_heads,
                                      head_dim=a.head_dim, dtype=dtype, context_length=self.context_length,
                                      weight_bytes=self.info.weight_bytes, config=config, model_id=self.fingerprint,
                                      # a forward feeds a request one prefill chunk, or a verification of its drafts
                                      max_step_tokens=max(self.prefill_chunk_size, MAX_DRAFT_TOKENS + 1))

    def decode_bytes_per_token(self, context: int) -> int:
        from mlx_engine.roofline import decode_bytes_per_token

        s = self._shape
        weights = self.info.weight_bytes - s.get("idle_bytes", 0)  # float32 host copies replace what they copy
        return decode_bytes_per_token(weights, s["embed_bytes"], s["tied"], s["layers"],
                                      s["kv_heads"], s["head_dim"], context, s["kv_itemsize"]).total

    def release(self) -> None:
        if self.draft is not None:
            self.draft.release()
            self.draft = None
        self.cache = None
        self.model = None
        self._free_device_memory()

    def _free_device_memory(self) -> None:
        mx.clear_cache()

    def reset_peak_memory(self) -> None:
        mx.reset_peak_memory()

    _host_bytes = 0  # resident float32 weights in numpy (MLX's CPU backend), outside MLX's allocator

    def peak_memory_bytes(self) -> int:
        """Peak memory MLX allocated since the last reset (weights, KV pool, activations), plus the
        resident host weights."""
        return int(mx.get_peak_memory()) + self._host_bytes

    # --- prompt handling (called on the front end's thread: tokenizers only, no MLX) ---

    def check_ids(self, ids: list[int]) -> list[int]:
        if not ids:
            raise RequestError("the prompt is empty (0 tokens)")
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(f"token id {bad[0]!r} is outside the vocabulary (0..{self.vocab_size - 1})")
        return ids

    def check_context(self, ids: list[int]) -> list[int]:
        if len(ids) > self.context_length:
            raise RequestError(f"the input is {len(ids)} tokens but the model's context is {self.context_length} tokens")
        return ids

    def prompt_ids(self, request: GenerationRequest) -> list[int]:
        if request.messages is not None:
            ids = self.tokenizer.encode_chat(request.messages, add_generation_prompt=request.add_generation_prompt)
        elif request.prompt is not None:
            ids = self.tokenizer.encode(request.prompt)
        else:
            ids = list(request.prompt_token_ids or [])
        self.check_ids(ids)
        if len(ids) >= self.context_length:
            raise RequestError(
                f"the prompt is {len(ids)} tokens but the model's context is {self.context_length} tokens "
                f"(at least 1 more is needed to generate)"
            )
        self.cache.check_fits(len(ids) + min(request.sampling.max_tokens, self.context_length - len(ids)))
        return ids

    # --- MLX work (engine thread) ---

    def _fresh_contiguous(self) -> list[Any]:
        from mlx_engine.kv.contiguous import new_contiguous_layers

        return new_contiguous_layers(self.model, self.native)

    def forward(self, inputs: mx.array, layers: list[Any]) -> mx.array:
        """inputs (B, L) -> hidden states (native) or logits (mlx-lm classes), lazily."""
        return self.model(inputs, layers) if self.native else self.model(inputs, cache=layers)

    def last_logits(self, inputs: mx.array, layers: list[Any]) -> mx.array:
        """inputs (B, L) -> logits of each row's last position (B, V), float32."""
        out = self.forward(inputs, layers)
        if self.native:
            return self.model.logits(out[:, -1, :]).astype(mx.float32)
        return out[:, -1, :].astype(mx.float32)

    def last_sample(self, inputs: mx.array, layers: list[Any], samplers: list[Any]) -> mx.array:
        """inputs (B, L) -> each row's next token (B,) int32, lazily, row b drawn by `samplers[b]` (plain ones,
        `Sampler.plain`: no bias or penalties to record). Here each row's sampler on `last_logits`, as the
        scheduler's own path does; a runner whose logits live on a device samples there."""
        return _sample_rows(self.last_logits(inputs, layers), samplers)

    def rows_sample(self, inputs: mx.array, layers: list[Any], rows: list[int], samplers: list[Any]) -> mx.array | None:
        """As `rows_logits` (None without rows), the next token of each of `rows` (len(rows),) int32."""
        logits = self.rows_logits(inputs, layers, rows)
        return None if logits is None else _sample_rows(logits, samplers)

    def rows_logits(self, inputs: mx.array, layers: list[Any], rows: list[int]) -> mx.array | None:
        """A packed forward (`PagedCache.packed_layers`): inputs (1, T) -> logits of `rows` (len(rows), V),
        float32, lazily; with no rows it evaluates the forward (its K/V writes) and returns None."""
        out = self.forward(inputs, layers)
        if not rows:
            mx.eval(out)
            return None
        return self.model.logits(out[0, mx.array(rows, dtype=mx.int32)]).astype(mx.float32)

    def forward_logits(self, ids: list[int]) -> np.ndarray:
        out = self.forward(mx.array([ids], dtype=mx.int32), self._fresh_contiguous())
        logits = self.model.logits(out) if self.native else out
        return np.array(logits[0].astype(mx.float32))

    def hidden_states(self, ids: list[int]) -> list[np.ndarray]:
        """[embedding output, output of decoder layer 0, ..., layer N-1], each float32 (T, hidden), from a
        fresh forward without the cache. The last one, through the final norm and the head, gives
        `forward_logits`. Native models only: mlx-lm's classes do not expose their layers' outputs."""
        if not self.native:
            raise RooflineError(f"hidden states need a natively implemented model; {self.info.name} "
                                f"({self.info.model_type}) runs on an mlx-lm class")
        out = self.model.layer_outputs(mx.array([ids], dtype=mx.int32))  # (1, T, hidden) each
        mx.eval(out)
        return [np.array(x[0].astype(mx.float32)) for x in out]

    def score(self, ids: list[int]) -> np.ndarray:
        """log p(ids[t+1] | ids[..t]) for every t, computed in prefill chunks through the engine's KV cache
        (so quantized KV counts, as it would in decoding) -> float32 (T - 1,)."""
        req = f"score-{id(ids)}"
        self.cache.check_fits(len(ids))
        self.cache.allocate(req, ids, len(ids))  # KV of its own
        out = []
        try:
            for start in range(0, len(ids) - 1, self.prefill_chunk_size):
                end = min(start + self.prefill_chunk_size, len(ids) - 1)
                layers = self.cache.prefill_layers(req, start, end)
                h = self.forward(mx.array([ids[start:end]], dtype=mx.int32), layers)
                logits = (self.model.logits(h) if self.native else h)[0]  # (L, V)
                out.append(np.array(target_logprobs(logits, ids[start + 1:end + 1], 0)[0]))
        finally:
            self.cache.free(req)
        return np.concatenate(out) if out else np.zeros(0, np.float32)

    def kv_stats(self) -> dict[str, Any]:
        return self.cache.stats()

    def save_kv(self, path: str, token_ids: list[int]) -> int:
        return self.cache.save(path, token_ids, self.fingerprint)

    def restore_kv(self, path: str) -> list[int]:
        return self.cache.restore(path, self.fingerprint)
