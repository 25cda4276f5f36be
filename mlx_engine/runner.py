"""The model runner: lives on the engine thread and does all MLX work (prefill, decode, logits)."""

from __future__ import annotations

import time
from typing import Any

import mlx.core as mx
import numpy as np

from mlx_engine.api import (
    GenerationEvent,
    GenerationRequest,
    ModelInfo,
    RequestError,
    RooflineError,
    SamplingParams,
    Stats,
    TokenLogprob,
    Usage,
)
from mlx_engine.loading import load_checkpoint
from mlx_engine.models import BuiltModel, build_model, count_parameters
from mlx_engine.stop import StopStringMatcher

_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def pick_dtype(requested: str | None, checkpoint_dtype: str) -> mx.Dtype:
    """On MLX's CPU backend activations stay float32: its quantized matvec is ~35x slower with float16
    activations and ~8x with bfloat16 (2-core x86-64, 4096x4096). On Metal the checkpoint's dtype."""
    if requested is not None:
        if requested not in _DTYPES:
            raise RooflineError(f"dtype={requested!r}: expected one of {', '.join(_DTYPES)}")
        return _DTYPES[requested]
    if not mx.metal.is_available():
        return mx.float32
    return _DTYPES.get(checkpoint_dtype, mx.float16)


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
        self._cache: list[Any] | None = None
        self._cache_tokens: list[int] = []  # the tokens whose K/V are in self._cache, in order

    @classmethod
    def load(
        cls,
        model: str | None,
        dtype: str | None = None,
        prefill_chunk_size: int = 512,
        max_context: int | None = None,
    ) -> Runner:
        if not isinstance(prefill_chunk_size, int) or prefill_chunk_size < 1:
            raise RooflineError(f"prefill_chunk_size={prefill_chunk_size!r}: expected an integer >= 1")
        ckpt = load_checkpoint(model)
        act_dtype = pick_dtype(dtype, ckpt.checkpoint_dtype)
        built = build_model(ckpt.config, ckpt.weights, act_dtype, ckpt.quantization, str(ckpt.path))
        if ckpt.source_format == "gguf":
            from mlx_engine.loading.gguf_model import apply_freq_factors

            apply_freq_factors(built.model, ckpt.config)
        if not mx.metal.is_available():
            from mlx_engine.models.layers import use_host_gemm_for_prefill

            use_host_gemm_for_prefill(built.model)
        mx.eval(built.model.parameters())
        del ckpt.weights
        tokenizer = ckpt.tokenizer or NoTokenizer(ckpt.path, ckpt.config)
        context = built.context_length
        if max_context is not None:
            if not isinstance(max_context, int) or max_context < 2:
                raise RooflineError(f"max_context={max_context!r}: expected an integer >= 2")
            context = min(context, max_context)
        params = dict(_flatten(built.model.parameters()))
        notes = () if built.native else (
            f"{built.model_type!r} runs on mlx-lm's model class: generation works; paged KV, prefix caching "
            "and speculative decoding may be unavailable",
        )
        eos = tuple(tokenizer.eos_token_ids)
        info = ModelInfo(
            name=ckpt.name,
            path=str(ckpt.path),
            model_type=built.model_type,
            source_format=ckpt.source_format,
            num_parameters=count_parameters(built.model),
            quantization=ckpt.quant_label,
            context_length=context,
            weight_bytes=sum(v.nbytes for v in params.values()),
            vocab_size=int(ckpt.config.get("vocab_size") or tokenizer.vocab_size),
            native=built.native,
            dtype=str(act_dtype).removeprefix("mlx.core."),
            eos_token_ids=eos,
            notes=notes,
        )
        runner = cls(built, tokenizer, info, prefill_chunk_size)
        runner._shape = _decode_shape(ckpt.config, params, act_dtype)
        return runner

    def decode_bytes_per_token(self, context: int) -> int:
        from mlx_engine.roofline import decode_bytes_per_token

        s = self._shape
        return decode_bytes_per_token(self.info.weight_bytes, s["embed_bytes"], s["tied"], s["layers"],
                                      s["kv_heads"], s["head_dim"], context, s["kv_itemsize"]).total

    def release(self) -> None:
        self._cache, self._cache_tokens = None, []
        self.model = None
        mx.clear_cache()

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
        return ids

    # --- MLX work (engine thread) ---

    def _new_cache(self) -> list[Any]:
        if self.native:
            from mlx_lm.models.cache import KVCache

            return [KVCache() for _ in self.model.layers]
        from mlx_lm.models.cache import make_prompt_cache

        return make_prompt_cache(self.model)

    def _logits_last(self, inputs: mx.array, cache: list[Any]) -> mx.array:
        """inputs (1, L) -> logits of the last position (1, V), float32."""
        if self.native:
            h = self.model(inputs, cache)  # (1, L, H)
            return self.model.logits(h[:, -1, :]).astype(mx.float32)
        return self.model(inputs, cache=cache)[:, -1, :].astype(mx.float32)

    def forward_logits(self, ids: list[int]) -> np.ndarray:
        inputs = mx.array([ids], dtype=mx.int32)
        cache = self._new_cache()
        if self.native:
            logits = self.model.logits(self.model(inputs, cache))
        else:
            logits = self.model(inputs, cache=cache)
        return np.array(logits[0].astype(mx.float32))

    def _reuse_prefix(self, ids: list[int]) -> int:
        """Keeps the cached K/V of the longest common prefix of `ids` and the cached tokens (leaving at
        least the last prompt token to compute); returns how many prompt tokens are reused."""
        if self._cache is None:
            self._cache = self._new_cache()
            self._cache_tokens = []
        n = 0
        limit = min(len(ids) - 1, len(self._cache_tokens))
        while n < limit and ids[n] == self._cache_tokens[n]:
            n += 1
        extra = len(self._cache_tokens) - n
        if extra:
            if self._trim(extra):
                del self._cache_tokens[n:]
            else:
                self._cache, self._cache_tokens, n = self._new_cache(), [], 0
        return n

    def _trim(self, n: int) -> bool:
        from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

        if not can_trim_prompt_cache(self._cache):
            return False
        return trim_prompt_cache(self._cache, n) == n

    def generate(self, ids: list[int], params: SamplingParams, stream: Any) -> None:
        try:
            self._generate(ids, params, stream)
        except Exception as e:  # noqa: BLE001 - reported as the stream's final event
            # the cache may hold a half-written step: drop it rather than trust it
            self._cache, self._cache_tokens = None, []
            msg = str(e) if isinstance(e, RooflineError) else f"{type(e).__name__}: {e}"
            stream.events.put(GenerationEvent(finish_reason="error", error=msg,
                                              usage=Usage(len(ids), 0, 0)))

    def _generate(self, ids: list[int], params: SamplingParams, stream: Any) -> None:
        from mlx_engine.sampling import Sampler

        mx.reset_peak_memory()
        t_start = time.perf_counter()
        n_cached = self._reuse_prefix(ids)
        cache = self._cache
        sampler = Sampler(params, self.vocab_size, prompt_token_ids=ids)
        want_logprobs = params.logprobs is not None

        # prefill all but the last prompt token in chunks, evaluating the cache between chunks
        todo = ids[n_cached:]
        for start in range(0, len(todo) - 1, self.prefill_chunk_size):
            if stream.cancelled.is_set():
                return self._finish(stream, "cancelled", ids, n_cached, 0, t_start, None, None)
            chunk = todo[start : min(start + self.prefill_chunk_size, len(todo) - 1)]
            if self.native:
                self.model(mx.array([chunk], dtype=mx.int32), cache)
            else:
                self.model(mx.array([chunk], dtype=mx.int32), cache=cache)
            mx.eval([c.state for c in cache])
            self._cache_tokens.extend(chunk)

        def step(token: mx.array) -> tuple[mx.array, mx.array | None]:
            logits = self._logits_last(token.reshape(1, -1), cache)  # (1, V)
            nxt = sampler.sample(logits)  # (1,)
            sampler.accept(nxt)
            lp = sampler.logprobs(logits) if want_logprobs else None
            return nxt, lp

        y, lp = step(mx.array(todo[-1:], dtype=mx.int32))
        self._cache_tokens.append(todo[-1])
        mx.async_eval(y) if lp is None else mx.async_eval(y, lp)

        detok = self.tokenizer.detokenizer()
        stops = StopStringMatcher(params.stop)
        max_new = min(params.max_tokens, self.context_length - len(ids))
        n_out = 0
        t_first = t_last = 0.0
        finish = "length"
        while True:
            # queue the next step before reading this token, so the host never waits on an idle device
            more = n_out + 1 < max_new
            if more:
                next_y, next_lp = step(y)
                mx.async_eval(next_y) if next_lp is None else mx.async_eval(next_y, next_lp)
            token = int(y.item())
            t_last = time.perf_counter()
            if n_out == 0:
                t_first = t_last
            if more:
                self._cache_tokens.append(token)
            if token in self.eos_ids and not params.ignore_eos:
                finish = "stop"
                break
            n_out += 1
            logprobs = (self._token_logprob(token, lp, params.logprobs),) if lp is not None else ()
            text, hit = stops.feed(detok.add_token(token))
            stream.events.put(GenerationEvent(text=text, token_ids=(token,), from_draft=(False,), logprobs=logprobs))
            if hit:
                finish = "stop"
                break
            if not more:
                break
            if stream.cancelled.is_set():
                finish = "cancelled"
                break
            y, lp = next_y, next_lp
        tail = stops.flush(detok.finalize()) if finish != "stop" or not stops.hit else ""
        self._finish(stream, finish, ids, n_cached, n_out, t_start, (t_first, t_last), tail)

    def _token_logprob(self, token: int, lp: mx.array, top: int) -> TokenLogprob:
        row = lp[0]
        alts: tuple[tuple[int, float], ...] = ()
        if top:
            idx = mx.argpartition(-row, kth=top - 1)[:top]
            vals = row[idx]
            order = mx.argsort(-vals)
            alts = tuple(zip(idx[order].tolist(), vals[order].tolist()))
        return TokenLogprob(token_id=token, logprob=float(row[token].item()), top=alts)

    def _finish(
        self,
        stream: Any,
        reason: str,
        ids: list[int],
        n_cached: int,
        n_out: int,
        t_start: float,
        times: tuple[float, float] | None,
        tail: str | None,
    ) -> None:
        # the cache may have run one step ahead of the emitted tokens; keep it consistent with _cache_tokens
        over = self._cache[0].offset - len(self._cache_tokens) if self._cache and hasattr(self._cache[0], "offset") else 0
        if over > 0 and not self._trim(over):
            self._cache, self._cache_tokens = None, []
        t_first, t_last = times if times else (time.perf_counter(), time.perf_counter())
        prefill_s = max(t_first - t_start, 1e-9)
        stats = Stats(
            ttft_s=t_first - stream.submitted_at,
            prefill_tps=(len(ids) - n_cached) / prefill_s,
            decode_tps=(n_out - 1) / (t_last - t_first) if n_out > 1 and t_last > t_first else 0.0,
            peak_memory_bytes=int(mx.get_peak_memory()),
        )
        stream.events.put(GenerationEvent(
            text=tail or "",
            finish_reason=reason,  # type: ignore[arg-type]
            usage=Usage(prompt_tokens=len(ids), completion_tokens=n_out, cached_prompt_tokens=n_cached),
            stats=stats,
        ))


class NoTokenizer:
    """For a model folder without tokenizer files: token ids in, token ids out, no text."""

    vocab_size = 0
    bos_token_id = None

    def __init__(self, path: Any, config: dict[str, Any]):
        self.path = path
        eos = config.get("eos_token_id")
        self.eos_token_ids = tuple(eos if isinstance(eos, list) else [] if eos is None else [eos])

    def _refuse(self, *args: Any, **kwargs: Any) -> list[int]:
        raise RequestError(f"{self.path} has no tokenizer (tokenizer.json): send prompt_token_ids instead of text")

    encode = encode_chat = _refuse

    def detokenizer(self) -> Any:
        class _Silent:
            def add_token(self, token: int) -> str:
                return ""

            def finalize(self) -> str:
                return ""

        return _Silent()


def _decode_shape(config: dict[str, Any], params: dict[str, mx.array], dtype: mx.Dtype) -> dict[str, Any]:
    heads = int(config.get("num_attention_heads") or 1)
    embed = [v for k, v in params.items() if "embed_tokens" in k]
    return {
        "embed_bytes": sum(v.nbytes for v in embed),
        "tied": not any("lm_head" in k for k in params),
        "layers": int(config.get("num_hidden_layers") or 0),
        "kv_heads": int(config.get("num_key_value_heads") or heads),
        "head_dim": int(config.get("head_dim") or int(config.get("hidden_size") or 0) // heads),
        "kv_itemsize": dtype.size,
    }


def _flatten(tree: Any, prefix: str = "") -> list[tuple[str, mx.array]]:
    from mlx.utils import tree_flatten

    return tree_flatten(tree)
