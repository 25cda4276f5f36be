"""Every timer of the engine: one forward over w tokens, the verify cost curve, a graphed forward (a runner that
replays its steps as CUDA graphs) and one batched decode step. Each runs on the engine thread."""

from __future__ import annotations

import time
from collections.abc import Callable

import mlx.core as mx

from mlx_engine.api import MAX_DRAFT_TOKENS, SamplingParams
from mlx_engine.backends.base import PhaseForwards
from mlx_engine.speculative.cost import CostCurve, cost_curve_key, load_cost_curve, save_cost_curve


def time_forward(runner: PhaseForwards, width: int, context: int = 32, repeats: int = 2,
                 first_layers: int | None = None, logits_at: str = "all") -> float:
    """Seconds of one forward over `width` tokens after `context` cached ones (min over repeats), through
    fresh contiguous buffers. `first_layers`: only that many layers + head (the self draft). A runner that
    replays its steps as CUDA graphs times them there (`time_graph_forward`): the contiguous
    buffers' eager forward is not what its decode or verification costs."""
    from mlx_lm.models.cache import trim_prompt_cache

    if first_layers is None and (run := runner.graph_step(width, context)) is not None:
        return _time_graph(runner, run, width, context, repeats)

    layers = runner.scratch_layers()
    runner.prefill(mx.array([[(7 * i) % 97 + 3 for i in range(context)]], dtype=mx.int32), layers)
    mx.eval([c.state for c in layers])
    x = mx.array([[(5 * i) % 89 + 4 for i in range(width)]], dtype=mx.int32)
    best = float("inf")
    for _ in range(repeats + 1):  # the first is a warm-up
        t = time.perf_counter()
        if first_layers is not None:
            out = runner.draft_logits(x, layers[:first_layers], first_layers)
            mx.eval(out)
            for c in layers[:first_layers]:
                c.trim(width)
        else:
            out = runner.verify_logits(x, layers) if logits_at == "all" else runner.decode_logits(x, layers)
            mx.eval(out)
            trim_prompt_cache(layers, width)
        best = min(best, time.perf_counter() - t)
    return best


def measure_cost_curve(runner: PhaseForwards, widths: tuple[int, ...] = (2, 3, 4, 5, 9), repeats: int = 2) -> CostCurve:
    """The verify cost curve on this backend: T(w)/T(1), T(1) a plain decode step (logits of one position).
    Stops early once even perfect drafts could not pay (a compute-bound backend: ~4 s on a 2-core CPU). Width 4
    is measured: on the torch CPU backend a forward over 4 rows costs less than over 3 (1.36 against 1.95 T(1)),
    and interpolated between 3 and 5 it read 1.77, so "auto" priced its verifications of 3 drafts too high."""
    t1 = time_forward(runner, 1, repeats=repeats, logits_at="last")
    curve = CostCurve({1: 1.0}, t1)
    for w in widths:
        curve.ratios[w] = time_forward(runner, w, repeats=repeats) / t1
        if curve.best_k(1.0, MAX_DRAFT_TOKENS) == 0:  # extrapolating the measured slope
            break
    return curve


def time_graph_forward(runner: PhaseForwards, width: int, context: int, repeats: int) -> float:
    """Seconds of one graphed step of `width` rows after `context` cached tokens, logits to the host (min
    over repeats, after a warm-up): what a decode step of `width` sequences or a verification of `width`
    tokens costs on a runner that replays its steps as CUDA graphs (`graph_step`)."""
    run = runner.graph_step(width, context)
    if run is None:  # graphs are off
        return time_forward(runner, width, context, repeats)
    return _time_graph(runner, run, width, context, repeats)


def _time_graph(runner: PhaseForwards, run: Callable[[], bool], width: int, context: int, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats + 1):
        t = time.perf_counter()
        if not run():  # the capture failed and graphs are off: time what runs instead
            return time_forward(runner, width, context, repeats)
        best = min(best, time.perf_counter() - t)
    return best


def time_decode_step(runner: PhaseForwards, batch: int, context: int = 64, repeats: int = 5) -> float:
    """Seconds of one batched decode step of `batch` sequences, each with `context` tokens of its own cached
    (min over `repeats`, after a warm-up step): the block tables, forward and greedy sampling of the step the
    scheduler runs when `batch` requests decode together, without emitting or detokenizing the tokens. Each
    sequence reads its own K/V, which a forward over `batch` positions of one sequence
    (`time_forward`) does not. Run it on the engine thread; the sequences' blocks are freed after."""
    from mlx_engine.sampling import Sampler

    cache = runner.cache
    ids = [f"decode-step-timer-{batch}-{i}" for i in range(batch)]
    vocab = min(runner.vocab_size, 1000) - 3
    known = [[(7 * j + 31 * i) % vocab + 3 for j in range(context)] for i in range(batch)]  # distinct: no prefix hits
    samplers = [Sampler(SamplingParams(temperature=0.0), runner.vocab_size) for _ in ids]
    started: list[str] = []
    try:
        for req, prompt in zip(ids, known):
            cache.start(req, prompt)
            started.append(req)
            layers = cache.prefill_layers(req, 0, len(prompt))
            runner.prefill(mx.array([prompt], dtype=mx.int32), layers)
            mx.eval(cache.state(layers))
        nxt, best = [5] * batch, float("inf")
        for i in range(repeats + 1):
            t = time.perf_counter()
            layers = cache.decode_layers(ids, known)
            tokens = runner.decode_sample(mx.array(nxt, dtype=mx.int32).reshape(batch, 1), layers, samplers)
            nxt = [int(x) for x in tokens.tolist()]  # the host read a step ends with
            if i:
                best = min(best, time.perf_counter() - t)
            for seq, token in zip(known, nxt):
                seq.append(token)
        return best
    finally:
        for req in started:
            cache.drop_request(req)


def cached_cost_curve(runner: PhaseForwards) -> CostCurve:
    """The verify cost curve, measured once per model, backend and machine (~4 s) and kept in `cache_dir()`."""
    key = cost_curve_key(runner)
    curve = load_cost_curve(key) if key is not None else None
    if curve is None:
        curve = measure_cost_curve(runner)
        if key is not None:
            save_cost_curve(key, curve)
    return curve
