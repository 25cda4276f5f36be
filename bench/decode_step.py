"""Decode speed of two checkouts of the engine, side by side in one run: before and after a change.

    uv run python bench/decode_step.py --before /path/to/other/checkout [--rounds 3] [--tokens 32]

Each round runs each checkout in a fresh process, alternating which goes first, on the embedded SmolLM2 with the
paged KV cache: one greedy sequence after a 1,024-token context, then four at once (the batched, packed step), and
8-bit KV for the single sequence. Two figures, medians over repeats within a process: the engine's `decode_tps`
(wall clock: on a loaded machine mostly the load), and the process's CPU time per generated token (every thread's,
`time.process_time`: the work done, which load shifts far less). The tables give each checkout's median (min-max)
over rounds and the ratio after/before. Prints a markdown section for docs/benchmarks/engine-vs-mlx-lm.md on stdout,
progress on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
CONTEXT = 1024
BATCH = 4

# what each process runs: its own checkout first on sys.path
CHILD = r"""
import json, statistics, sys, time
sys.path.insert(0, sys.argv[1])
from mlx_engine import Engine, GenerationRequest, SamplingParams

tokens, repeats, context, batch = (int(x) for x in sys.argv[2:6])
ids = [(13 * i + 7) % 4000 + 100 for i in range(context)]
greedy = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)

def run(engine, prompts):
    # (decode tok/s summed over the sequences, CPU seconds of the process per generated token)
    cpu = time.process_time()
    streams = [engine.generate(GenerationRequest(prompt_token_ids=p, sampling=greedy)) for p in prompts]
    finals = [list(s)[-1] for s in streams]
    assert all(f.finish_reason == "length" for f in finals), [f.error for f in finals]
    return sum(f.stats.decode_tps for f in finals), (time.process_time() - cpu) / (tokens * len(prompts))

out = {}
for name, opts, prompts in (("1 sequence", {}, [ids]), (f"{batch} sequences", {}, [ids[: context // batch] + [i]
                             for i in range(batch)]), ("1 sequence, kv_bits=8", {"kv_bits": 8}, [ids])):
    with Engine.load(None, backend="mlx", **opts) as e:
        run(e, prompts)  # prefill, warm-up: the repeats reuse the prefix
        got = [run(e, prompts) for _ in range(repeats)]
        out[name] = [statistics.median(g[0] for g in got), statistics.median(g[1] for g in got)]
print(json.dumps(out))
"""


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run(tree: Path, args: argparse.Namespace) -> dict[str, list[float]]:
    out = subprocess.run([sys.executable, "-c", CHILD, str(tree), str(args.tokens), str(args.repeats), str(CONTEXT),
                          str(BATCH)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def commit(tree: Path) -> str:
    return subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip() or "?"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--before", type=Path, required=True, help="the other checkout (e.g. a `git worktree` of main)")
    p.add_argument("--after", type=Path, default=HERE, help="default: this checkout")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3, help="timed requests per figure within a process")
    p.add_argument("--tokens", type=int, default=32, help="tokens per request")
    args = p.parse_args()
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    runs: dict[str, list[dict[str, list[float]]]] = {k: [] for k in trees}
    loads = []
    for r in range(args.rounds):
        for name in (list(trees) if r % 2 == 0 else list(trees)[::-1]):
            loads.append(os.getloadavg()[0])
            runs[name].append(run(trees[name], args))
            log(f"round {r} {name}: {runs[name][-1]}")
    loads.append(os.getloadavg()[0])
    print(f"### Decode before and after ({time.strftime('%Y-%m-%d')})\n")
    print(f"- Command: `uv run python bench/decode_step.py --before <checkout of {commit(trees['before'])}> "
          f"--rounds {args.rounds} --repeats {args.repeats} --tokens {args.tokens}` (after: {commit(trees['after'])})")
    print(f"- Machine: {platform.system()} {platform.machine()}, {os.cpu_count()} cores; load average "
          f"{min(loads):.1f}-{max(loads):.1f} during the run")
    print(f"- Embedded SmolLM2, paged KV, greedy, {args.tokens} tokens after {CONTEXT} tokens of context (the "
          f"{BATCH} sequences: {CONTEXT // BATCH} each); tok/s summed over the sequences\n")
    for i, (what, unit, fmt) in enumerate((("decode tok/s", "tok/s", ".2f"), ("CPU time per token", "ms", ".1f"))):
        scale = 1 if i == 0 else 1000
        print(f"| {what} | before {unit} | after {unit} | after / before |")
        print("|---|---:|---:|---:|")
        for figure in runs["before"][0]:
            b, a = ([x[figure][i] * scale for x in runs[k]] for k in ("before", "after"))
            mb, ma = statistics.median(b), statistics.median(a)
            spread = lambda xs: f"{min(xs):{fmt}}-{max(xs):{fmt}}"  # noqa: E731
            print(f"| {figure} | {mb:{fmt}} ({spread(b)}) | {ma:{fmt}} ({spread(a)}) | {ma / mb:.3f} |")
        print()


if __name__ == "__main__":
    main()
