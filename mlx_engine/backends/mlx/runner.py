"""The MLX model runner: lives on the engine thread and does all MLX work (prefill, decode, logits), on Metal or
MLX's CPU backend."""

from __future__ import annotations

import dataclasses
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten
import numpy as np

from mlx_engine.api import ModelInfo, RooflineError
from mlx_engine.backends.base import RunnerCapabilities
from mlx_engine.backends.common import (CacheRunner, NoTokenizer, attach_draft, cap_context, check_self_draft_layers,
                                        entry, model_fingerprint)
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
from mlx_engine.reasoning import reasoning_family
from mlx_engine.sampling import target_logprobs


def _sample_rows(logits: mx.array, samplers: list[Any]) -> mx.array:
    """(n, V) -> (n,) int32: one argmax for the greedy rows when all are, else each row by its sampler."""
    if all(s.greedy for s in samplers):
        return mx.argmax(logits, axis=-1).astype(mx.int32)
    return mx.concatenate([s.sample(logits[i : i + 1]) for i, s in enumerate(samplers)])


class Runner(CacheRunner):
    """The MLX backend's `backends.base.ModelRunner`."""

    def __init__(self, built: BuiltModel, tokenizer: Any, info: ModelInfo, prefill_chunk_size: int):
        super().__init__(built.model, tokenizer, info, prefill_chunk_size)  # cache: Paged or ContiguousCache
        self.native = built.native
        self.views = built.views  # the model takes the engine's KV views (ours, or mlx-lm's through models.adapter)
        self.capabilities: RunnerCapabilities  # declared by load(), once the cache is made (`_declare`)

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
        if paged_kv is False and built.state_leaves:  # a hybrid without the paged cache: mlx-lm's caches, as before
            built = dataclasses.replace(built, model=built.model.inner, views=False, routing=None, packs=False,
                                        state_leaves=(), kv_note="its state slots sit beside the paged KV, which "
                                        "paged_kv=False turns off")
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
        warnings = () if built.views else (
            f"{built.model_type!r} runs on mlx-lm's model class with its own caches ({built.kv_note}): generation "
            "works; paged KV, prefix caching, batching and speculative decoding are unavailable",
        )
        if built.views and not built.native:
            notes += (f"{built.model_type!r} runs on mlx-lm's model class on the engine's KV cache (models.adapter)"
                      + (", its recurrent state in slots beside it (kv.state)" if built.state_leaves else ""),)
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
            reasoning=reasoning_family(tokenizer),
        )
        runner = cls(built, tokenizer, info, prefill_chunk_size)
        runner._shape = decode_shape(ckpt.config, params, act_dtype)
        runner._kv_note, runner.routing, runner._packs = built.kv_note, built.routing, built.packs
        runner._state_leaves = built.state_leaves
        if built.routing is not None:  # experts: a decode step reads only those routed (models.adapter)
            runner._shape["moe"] = built.routing.shape
        runner._host_bytes, runner._shape["idle_bytes"] = host_bytes, idle_bytes
        runner.fingerprint = model_fingerprint(ckpt, act_dtype)
        runner.cache = runner._make_cache(kv_config, paged_kv, act_dtype)
        runner.cache.calibrate(runner.model, tokenizer, runner.vocab_size)  # quantized KV: `kv.smoothing`
        from mlx_engine.backends.mlx.kernel_checks import kernel_warnings

        # a Metal kernel that fails its check on this machine: its reference runs, and the user is told once
        fallbacks = kernel_warnings(runner.model, runner.cache, act_dtype)
        runner.info = dataclasses.replace(runner.info, kv_files=runner.cache.capabilities.kv_files,
                                          warnings=runner.info.warnings + fallbacks,
                                          notes=runner.info.notes + runner._cache_notes)
        runner.capabilities = runner._declare()
        runner.self_draft_layers = check_self_draft_layers(self_draft_layers,
                                                           len(runner.model.layers) if runner.native else 0)
        if draft_model is not None:
            attach_draft(runner, lambda: cls.load(draft_model, dtype=dtype, prefill_chunk_size=prefill_chunk_size,
                                                  paged_kv=False, weight_bits=draft_bits), draft_optional)
        return runner

    # --- what it can do, speculative decoding ---

    draft: Runner | None = None  # the draft model (Engine.load(..., draft_model=...))
    routing: Any = None  # a mixture-of-experts model's `models.adapter.MoERouting`
    _kv_note: str | None = None  # why an mlx-lm class keeps its own caches
    _packs = True  # the model ropes packed parts each at its positions (BuiltModel.packs)
    _state_leaves: tuple[Any, ...] = ()  # a hybrid's cache leaves (BuiltModel.state_leaves): a state pool too
    _cache_notes: tuple[str, ...] = ()  # the cache's notes for the user (kv.state.StateCache.notes)
    self_draft_layers: int = 0

    def _declare(self) -> RunnerCapabilities:
        """What this runner can do, from its model class and cache (set once both are loaded)."""
        from mlx_engine.kv.contiguous import untrimmable_kinds

        caps = self.cache.capabilities
        why = {}
        rollback = self.views or caps.rollback  # the engine's caches all roll back
        if not rollback:
            kinds = untrimmable_kinds(self.model, self.views)
            why["rollback"] = f"its mlx-lm cache ({', '.join(kinds) or 'unknown'}) cannot be trimmed at every length"
        if not self.native:
            why["self_draft"] = f"needs a natively implemented model; {self.info.name} runs on an mlx-lm class"
            why["hidden_states"] = (f"need a natively implemented model; {self.info.name} ({self.info.model_type}) "
                                    "runs on an mlx-lm class")
        if not caps.kv_files:
            why["kv_files"] = "KV files need the paged KV cache, which this model does not use"
        max_batch = (caps.state_slots or None) if caps.batching else 1  # a running sequence holds a state slot
        return RunnerCapabilities(rollback=rollback, kv_files=caps.kv_files, self_draft=self.native,
                                  hidden_states=self.native, max_batch=max_batch, why_not=why)

    @entry("verify_logits")
    def verify_logits(self, inputs: mx.array, layers: list[Any]) -> mx.array:
        """inputs (1, L) -> logits of every position (L, V), float32, lazily (a verification)."""
        out = self.forward(inputs, layers)
        logits = self.model.logits(out) if self.views else out
        return logits[0].astype(mx.float32)

    @entry("draft_logits")
    def draft_logits(self, inputs: mx.array, layers: list[Any], num_layers: int) -> mx.array:
        """The self draft: inputs (1, L) through the first `num_layers` layers, the final norm and the head
        -> logits of the last position (1, V), float32. `layers`: the caches of those layers."""
        m = self.model
        self.record_path(f"mlx {self.info.device}{self.timing_variant()}, {num_layers} layers")
        h = m.hidden(inputs, layers, num_layers)
        return m.logits(m.model.norm(h[:, -1, :])).astype(mx.float32)

    def _make_cache(self, config: Any, paged: bool | None, dtype: mx.Dtype) -> Any:
        from mlx_engine.api import MAX_DRAFT_TOKENS
        from mlx_engine.kv.contiguous import ContiguousCache
        from mlx_engine.kv.kinds import LayerKindsCache

        why_not = None
        if not self.views:
            why_not = f"the model runs on mlx-lm's class with its own caches ({self.info.model_type}: {self._kv_note})"
        if paged is False or (paged is None and why_not):
            if config.kv_bits is not None or config.kv_key_bits is not None or config.kv_key_per_channel:
                name = "kv_bits" if config.kv_bits is not None else \
                    "kv_key_bits" if config.kv_key_bits is not None else "kv_key_per_channel"
                raise RooflineError(f"{name} needs the paged KV cache, which is off here "
                                    f"({why_not or 'paged_kv=False'})")
            return ContiguousCache(self.model, self.views)
        if why_not:
            raise RooflineError(f"paged_kv=True is not available: {why_not}")
        a = self.model.args

        def make_paged(config: Any) -> Any:
            # one paged storage per kind of layer (sliding windows, full attention): a plain PagedCache for one kind
            return LayerKindsCache.create(layer_windows=a.layer_windows(), num_kv_heads=a.num_key_value_heads,
                                          head_dim=a.head_dim, dtype=dtype, context_length=self.context_length,
                                          weight_bytes=self.info.weight_bytes, config=config,
                                          model_id=self.fingerprint,
                                          # a forward feeds a request one prefill chunk, or a verification of drafts
                                          max_step_tokens=max(self.prefill_chunk_size, MAX_DRAFT_TOKENS + 1))

        if self._state_leaves:  # a hybrid: its recurrent state in slots beside the attention layers' blocks
            from mlx_engine.api import DEFAULT_MAX_SEQS
            from mlx_engine.kv.state import StateCache

            cache = StateCache.create(list(self._state_leaves), config, DEFAULT_MAX_SEQS, self.context_length,
                                      make_paged)
            self._cache_notes = cache.notes  # what the budget turned off
        else:
            cache = make_paged(config)
        if not self._packs:  # its layers rope a forward's rows at one offset (models.adapter.ViewRoPE)
            cache.capabilities = dataclasses.replace(cache.capabilities, packed=False)
        return cache

    @property
    def shape(self) -> dict[str, Any]:
        """The figures that price a decode step (`backends.mlx.load.decode_shape`, `backends.common.decode_bytes`)."""
        return self._shape

    def moe_routing(self) -> dict[str, Any] | None:
        """A mixture-of-experts model's recorded decode steps (`models.adapter.MoERouting.report`); None for
        a dense model."""
        if self.routing is None:
            return None
        s = self._shape
        weights = self.info.weight_bytes - s.get("idle_bytes", 0)
        return self.routing.report(weights if s["tied"] else weights - s["embed_bytes"])

    def _free_device_memory(self) -> None:
        mx.clear_cache()

    def reset_peak_memory(self) -> None:
        mx.reset_peak_memory()

    _host_bytes = 0  # resident float32 weights in numpy (MLX's CPU backend), outside MLX's allocator

    def peak_memory_bytes(self) -> int:
        """Peak memory MLX allocated since the last reset (weights, KV pool, activations), plus the
        resident host weights."""
        return int(mx.get_peak_memory()) + self._host_bytes

    # --- MLX work (engine thread) ---

    def scratch_layers(self) -> list[Any]:
        from mlx_engine.kv.contiguous import new_contiguous_layers

        return new_contiguous_layers(self.model, self.views)

    def forward(self, inputs: mx.array, layers: list[Any]) -> mx.array:
        """inputs (B, L) -> hidden states (a model on our views) or logits (mlx-lm's class on its caches), lazily."""
        self.record_path(f"mlx {self.info.device}{self.timing_variant()}")
        return self.model(inputs, layers) if self.views else self.model(inputs, cache=layers)

    @entry("prefill")
    def prefill(self, inputs: mx.array, layers: list[Any]) -> None:
        self.forward(inputs, layers)

    def _last_logits(self, inputs: mx.array, layers: list[Any]) -> mx.array:
        """inputs (B, L) -> logits of each row's last position (B, V), float32."""
        out = self.forward(inputs, layers)
        if self.views:
            return self.model.logits(out[:, -1, :]).astype(mx.float32)
        return out[:, -1, :].astype(mx.float32)

    prefill_logits, decode_logits = entry("prefill_logits")(_last_logits), entry("decode_logits")(_last_logits)

    @entry("decode_sample")
    def decode_sample(self, inputs: mx.array, layers: list[Any], samplers: list[Any]) -> mx.array:
        """inputs (B, L) -> each row's next token (B,) int32, lazily, row b drawn by `samplers[b]` (plain ones,
        `Sampler.plain`: no bias or penalties to record). Here each row's sampler on `decode_logits`, as the
        scheduler's own path does; a runner whose logits live on a device samples there."""
        return _sample_rows(self.decode_logits(inputs, layers), samplers)

    @entry("packed_sample")
    def packed_sample(self, inputs: mx.array, layers: list[Any], rows: list[int],
                      samplers: list[Any]) -> mx.array | None:
        """As `packed_logits` (None without rows), the next token of each of `rows` (len(rows),) int32."""
        logits = self.packed_logits(inputs, layers, rows)
        return None if logits is None else _sample_rows(logits, samplers)

    @entry("packed_logits")
    def packed_logits(self, inputs: mx.array, layers: list[Any], rows: list[int]) -> mx.array | None:
        """A packed forward (`PagedCache.packed_layers`): inputs (1, T) -> logits of `rows` (len(rows), V),
        float32, lazily; with no rows it evaluates the forward (its K/V writes) and returns None."""
        out = self.forward(inputs, layers)
        if not rows:
            mx.eval(out)
            return None
        return self.model.logits(out[0, mx.array(rows, dtype=mx.int32)]).astype(mx.float32)

    def graph_step(self, width: int, context: int) -> None:
        return None  # MLX replays no graphs

    def timing_variant(self) -> str:
        return "-fp32-host-weights" if self._host_bytes else ""  # backends.mlx.host_blas: another forward

    @entry("forward_logits")
    def forward_logits(self, ids: list[int]) -> np.ndarray:
        out = self.forward(mx.array([ids], dtype=mx.int32), self.scratch_layers())
        logits = self.model.logits(out) if self.views else out
        return np.array(logits[0].astype(mx.float32))

    def hidden_states(self, ids: list[int]) -> list[np.ndarray]:
        """[embedding output, output of decoder layer 0, ..., layer N-1], each float32 (T, hidden), from a
        fresh forward without the cache. The last one, through the final norm and the head, gives
        `forward_logits`. Native models only: mlx-lm's classes do not expose their layers' outputs."""
        if not self.capabilities.hidden_states:
            raise RooflineError(f"hidden states {self.capabilities.reason('hidden_states')}")
        out = self.model.layer_outputs(mx.array([ids], dtype=mx.int32))  # (1, T, hidden) each
        mx.eval(out)
        return [np.array(x[0].astype(mx.float32)) for x in out]

    @entry("score")
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
                logits = (self.model.logits(h) if self.views else h)[0]  # (L, V)
                out.append(np.array(target_logprobs(logits, ids[start + 1:end + 1], 0)[0]))
        finally:
            self.cache.free(req)
        return np.concatenate(out) if out else np.zeros(0, np.float32)
