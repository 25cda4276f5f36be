"""llama-bench-style measurement of a loaded engine: prefill (pp) and decode (tg) tokens/s at each batch size
and context depth, through the public request API.

A (batch B, depth d) point, per repeat:
  pp: B prompts, each the d-token prefix (already in the prefix cache) + p fresh random tokens, 1 new token:
      tokens computed (prompt - cached) over the time to the last first token.
  tg: B prompts, each the prefix + 1 fresh random token, n new tokens, EOS ignored: tokens after each
      sequence's first over the span from the first first-token to the last last-token.
Fresh random tokens per repeat and per sequence, so prefix caching never fakes a prefill; the d-token prefix
is shared by the B sequences (its blocks are read once per sequence per step all the same).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mlx_engine.api import DEFAULT_MAX_SEQS, EngineLike, GenerationRequest, RooflineError, SamplingParams


@dataclass(frozen=True)
class BenchSpec:
    prompt_tokens: int = 512
    gen_tokens: int = 128
    batches: tuple[int, ...] = (1, 4, 8)
    contexts: tuple[int, ...] = (0, 4096)
    repeats: int = 5
    seed: int = 0

    def validate(self, context_length: int | None = None) -> None:
        if self.prompt_tokens < 1:
            raise RooflineError(f"-p {self.prompt_tokens}: expected prompt tokens >= 1")
        if self.gen_tokens < 2:
            raise RooflineError(f"-n {self.gen_tokens}: expected generated tokens >= 2 (decode speed needs two)")
        if not self.batches or min(self.batches) < 1:
            raise RooflineError(f"--batch {','.join(map(str, self.batches))}: expected sizes >= 1")
        if not self.contexts or min(self.contexts) < 0:
            raise RooflineError(f"--context {','.join(map(str, self.contexts))}: expected depths >= 0")
        if self.repeats < 1:
            raise RooflineError(f"--repeats {self.repeats}: expected >= 1")
        if context_length is not None:
            need = max(self.contexts) + max(self.prompt_tokens + 1, self.gen_tokens + 1)
            if need > context_length:
                raise RooflineError(f"--context {max(self.contexts)} with -p {self.prompt_tokens} -n {self.gen_tokens} "
                                    f"needs {need} tokens but the model's context is {context_length}")

    def kv_tokens(self, block_size: int) -> int:
        """KV tokens the pool must hold so that the largest batch runs at once: the scheduler reserves each
        sequence's whole prompt (cached prefix included) plus its new tokens, rounded up to blocks."""
        per_seq = max(self.contexts) + max(self.prompt_tokens + 1, self.gen_tokens + 1) + 2 * block_size
        return max(self.batches) * per_seq + max(self.contexts) + block_size


@dataclass
class BenchPoint:
    batch: int
    context: int
    pp_tps: list[float] = field(default_factory=list)  # per repeat, all B sequences together
    tg_tps: list[float] = field(default_factory=list)
    pp_tokens: list[int] = field(default_factory=list)  # prompt tokens computed per repeat (not cached)
    peak_memory_bytes: int = 0
    tg_mean_context: float = 0.0  # mean KV length a decode step attends over


def load_engine(model: str | None, spec: BenchSpec, backend: str = "auto", device: str = "auto",
                **options: Any) -> Any:
    """Engine.load with a KV pool large enough for the spec's largest batch at its deepest context, and room in the
    scheduler for that batch (the default cap, 16, would queue larger ones)."""
    from mlx_engine import Engine

    options.update(backend=backend, device=device, max_seqs=max(DEFAULT_MAX_SEQS, *spec.batches))
    engine = Engine.load(model, **options)
    try:
        spec.validate(engine.info.context_length)
        stats = engine.kv_stats()
    except BaseException:
        engine.close()
        raise
    bs, per_block, budget = (stats.get(k) for k in ("block_size", "bytes_per_block", "bytes_budget"))
    if stats.get("kind") == "paged" and bs and per_block and budget is not None:
        need = -(-spec.kv_tokens(int(bs)) // int(bs)) * int(per_block)
        if int(budget) < need and options.get("distributed"):  # the other ranks load once, with their own budget
            engine.close()
            raise RooflineError(f"the KV pool holds {int(budget) // int(per_block) * int(bs)} tokens and this bench "
                                f"needs {need // int(per_block) * int(bs)}: lower --batch, --context or -p/-n")
        if int(budget) < need:
            engine.close()
            engine = Engine.load(model, kv_budget_bytes=need, **options)
    return engine


def _allow_batch(engine: Any, batch: int) -> None:
    if batch == 1:
        return
    allowed = engine.diagnostics().scheduler.max_seqs  # 1 where the cache holds one sequence
    if allowed <= 1:
        raise RooflineError(f"--batch {batch}: {engine.info.name} runs with a contiguous KV cache here, which holds "
                            "one sequence at a time; only --batch 1 can be measured")
    if allowed < batch:
        raise RooflineError(f"--batch {batch}: this engine runs {allowed} sequences at once (Engine.load's "
                            f"max_seqs); load it with max_seqs={batch} to measure this batch")


def _run_batch(engine: Any, prompts: list[list[int]], max_tokens: int) -> list[tuple[Any, float]]:
    """Submits every prompt before reading any stream; returns (final event, submit time) per prompt."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    streams = [engine.generate(GenerationRequest(prompt_token_ids=p, sampling=params)) for p in prompts]
    finals = []
    for s in streams:
        final = None
        for final in s:
            pass
        if final is None or final.finish_reason == "error":
            raise RooflineError(f"benchmark request failed: {getattr(final, 'error', None) or 'no final event'}")
        finals.append((final, s.submitted_at))
    return finals


def _pp_rate(finals: list[tuple[Any, float]]) -> tuple[float, int]:
    computed = sum(f.usage.prompt_tokens - f.usage.cached_prompt_tokens for f, _ in finals)
    start = min(t for _, t in finals)
    end = max(t + f.stats.ttft_s for f, t in finals)
    return computed / max(end - start, 1e-9), computed


def _tg_rate(finals: list[tuple[Any, float]]) -> float:
    firsts, lasts, tokens = [], [], 0
    for f, t in finals:
        first = t + f.stats.ttft_s
        n = f.usage.completion_tokens - 1
        if n < 1 or f.stats.decode_tps <= 0:
            continue
        firsts.append(first)
        lasts.append(first + n / f.stats.decode_tps)
        tokens += n
    return tokens / max(max(lasts) - min(firsts), 1e-9) if tokens else 0.0


def run_bench(engine: Any, spec: BenchSpec, progress: Callable[[str], None] | None = None) -> list[BenchPoint]:
    """Measures every (batch, context) of `spec` (batch-major); `progress(label)` after each run."""
    spec.validate(engine.info.context_length)
    rng = random.Random(spec.seed)
    vocab = engine.info.vocab_size

    def tokens(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    def tick(label: str) -> None:
        if progress is not None:
            progress(label)

    for b in spec.batches:
        _allow_batch(engine, b)
    _run_batch(engine, [tokens(16)], 4)  # warm-up: first-call costs (allocation, compilation)
    prefixes = {d: tokens(d) for d in spec.contexts}
    warm: set[int] = set()
    points = []
    for b in spec.batches:
        for d in spec.contexts:
            prefix = prefixes[d]
            if d and d not in warm:  # fill the prefix cache once; every request after reuses it
                _run_batch(engine, [prefix + tokens(1)], 1)
                warm.add(d)
            point = BenchPoint(b, d, tg_mean_context=d + 1 + (spec.gen_tokens - 1) / 2)
            _run_batch(engine, [prefix + tokens(1) for _ in range(b)], min(spec.gen_tokens, 4))  # this batch shape
            tick(f"b{b} d{d} warm-up")
            for r in range(spec.repeats):
                finals = _run_batch(engine, [prefix + tokens(spec.prompt_tokens) for _ in range(b)], 1)
                rate, computed = _pp_rate(finals)
                point.pp_tps.append(rate)
                point.pp_tokens.append(computed)
                point.peak_memory_bytes = max([point.peak_memory_bytes] + [f.stats.peak_memory_bytes for f, _ in finals])
                tick(f"b{b} d{d} pp {r + 1}/{spec.repeats}")
                finals = _run_batch(engine, [prefix + tokens(1) for _ in range(b)], spec.gen_tokens)
                point.tg_tps.append(_tg_rate(finals))
                point.peak_memory_bytes = max([point.peak_memory_bytes] + [f.stats.peak_memory_bytes for f, _ in finals])
                tick(f"b{b} d{d} tg {r + 1}/{spec.repeats}")
            points.append(point)
    return points


def num_runs(spec: BenchSpec) -> int:
    """Progress ticks `run_bench` makes."""
    return len(spec.batches) * len(spec.contexts) * (1 + 2 * spec.repeats)


def decode_bytes_per_step(engine: Any, batch: int, context: float) -> float:
    """Bytes one batched decode step reads: the weights once, and each sequence's own KV. Mixture of experts:
    the shared weights and the experts the batch's steps routed to (their union per step, measured)."""
    from mlx_engine.roofline import moe_weights_per_step

    weights = engine.decode_bytes_per_token(0)
    kv_per_token = engine.decode_bytes_per_token(1) - weights  # K and V of every layer
    routed = moe_weights_per_step(engine.moe_routing(), batch)
    weights = weights if routed is None else routed
    return weights + batch * kv_per_token * context


def engine_device(engine: EngineLike, requested: str) -> str:
    """The device the engine runs on ("metal", "cpu", "cuda"), as it says; else the one asked for."""
    return engine.info.device or requested


def versions() -> dict[str, str]:
    """Installed versions of the packages a result depends on (from metadata: nothing is imported)."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("mlx", "mlx-lm", "torch", "triton", "numpy"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            pass
    return out
