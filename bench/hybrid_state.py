"""A hybrid (recurrent layers beside attention) on the engine's paged KV with its state in slots (mlx_engine.kv.state)
against mlx-lm's own generate_step on the same module with its ArraysCache/KVCache, in one run.

    uv run python bench/hybrid_state.py [--family qwen3_next] [--prompt-tokens 96] [--gen-tokens 32] [--repeats 3]

The golden tiny checkpoint (tests/data/golden/<family>), float32 on MLX's CPU backend. Measures, runs alternating:
generated tok/s (prefill included) of one sequence (ours vs mlx-lm), aggregate tok/s of 4 concurrent sequences on
the engine (batched rows over 4 state slots) against mlx-lm running the 4 one after another, and the engine's time
to first token for a repeated prompt (a prefix hit restoring a state snapshot) against a cold one. Prints markdown.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402

from mlx_engine import Engine, GenerationRequest, SamplingParams  # noqa: E402

GOLDEN = Path(__file__).resolve().parents[1] / "tests" / "data" / "golden"


def prompts(n: int, count: int) -> list[list[int]]:
    return [[(31 * i + 7 * k) % 127 + 1 for i in range(n)] for k in range(count)]


def ours(engine: Engine, ids_list: list[list[int]], n: int) -> tuple[float, list[list[int]], float]:
    """(seconds for all, tokens, ttft of the first) with every request submitted at once."""
    t0 = time.perf_counter()
    streams = [engine.generate(GenerationRequest(prompt_token_ids=ids, sampling=SamplingParams(
        temperature=0.0, max_tokens=n, ignore_eos=True))) for ids in ids_list]
    out, ttft = [], None
    for s in streams:
        toks = []
        for ev in s:
            if ttft is None and ev.token_ids:
                ttft = time.perf_counter() - t0
            toks += ev.token_ids
        out.append(toks)
    return time.perf_counter() - t0, out, ttft or 0.0


def theirs(model, ids_list: list[list[int]], n: int) -> tuple[float, list[list[int]]]:
    from mlx_lm.generate import generate_step

    t0 = time.perf_counter()
    out = []
    for ids in ids_list:
        toks = [int(t) for t, _ in zip((tok for tok, _ in generate_step(mx.array(ids), model, max_tokens=n)),
                                       range(n))]
        out.append(toks)
    return time.perf_counter() - t0, out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", default="qwen3_next")
    ap.add_argument("--prompt-tokens", type=int, default=96)
    ap.add_argument("--gen-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    from mlx_engine.loading import load_checkpoint
    from mlx_engine.models import build_model

    folder = GOLDEN / a.family
    ckpt = load_checkpoint(str(folder))
    peer = build_model(ckpt.config, ckpt.weights, mx.float32, None, a.family).model.inner  # mlx-lm's class
    one, four = prompts(a.prompt_tokens, 1), prompts(a.prompt_tokens, 4)
    rows: dict[str, list[float]] = {k: [] for k in ("ours1", "theirs1", "ours4", "theirs4", "cold", "hit")}
    with Engine.load(str(folder), backend="mlx", prefix_caching=False) as e, \
            Engine.load(str(folder), backend="mlx") as cached:
        same = None
        for _ in range(a.repeats):
            t, toks1, _ = ours(e, one, a.gen_tokens)
            rows["ours1"].append(a.gen_tokens / t)
            t, peer1 = theirs(peer, one, a.gen_tokens)
            rows["theirs1"].append(a.gen_tokens / t)
            t, toks4, _ = ours(e, four, a.gen_tokens)
            rows["ours4"].append(4 * a.gen_tokens / t)
            t, peer4 = theirs(peer, four, a.gen_tokens)
            rows["theirs4"].append(4 * a.gen_tokens / t)
            same = toks1 == peer1 and toks4 == peer4
            fresh = [[(p + 1) % 127 + 1 for p in one[0]] + [len(rows["cold"])]]  # a prompt not seen before
            rows["cold"].append(ours(cached, fresh, 1)[2])
            rows["hit"].append(ours(cached, fresh, 1)[2])
    med = {k: statistics.median(v) for k, v in rows.items()}
    cpu = platform.processor() or platform.machine()
    print(f"{a.family} golden, {a.prompt_tokens} prompt tokens, {a.gen_tokens} generated, median of {a.repeats}; "
          f"tokens identical to mlx-lm: {same}; {cpu}, {datetime.date.today()}\n")
    print("| measure | Roofline | mlx-lm | ratio |\n|---|---:|---:|---:|")
    print(f"| tok/s, 1 sequence (prefill included) | {med['ours1']:.1f} | {med['theirs1']:.1f} | "
          f"{med['ours1'] / med['theirs1']:.2f}x |")
    print(f"| tok/s, 4 sequences (ours batched, mlx-lm one after another) | {med['ours4']:.1f} | "
          f"{med['theirs4']:.1f} | {med['ours4'] / med['theirs4']:.2f}x |")
    print(f"| time to first token, cold vs prefix hit (ms) | {1e3 * med['hit']:.1f} hit | {1e3 * med['cold']:.1f} "
          f"cold | {med['cold'] / med['hit']:.2f}x |")


if __name__ == "__main__":
    main()
