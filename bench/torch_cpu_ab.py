"""A change to the torch CPU decode against the code as it is, in one process: engine A loaded as the code is,
then VARIANT (a Python file) run, then engine B loaded, and the two generating in turn, round after round, so
that a spell of load from other tenants falls on both. On a shared 2-core machine one configuration drifts by
20% in half an hour, so runs one after the other cannot tell apart changes of a few percent.

    uv run python bench/torch_cpu_ab.py VARIANT [MODEL] [--threads 1] [--rounds 10] [-p 128] [-n 32]

VARIANT patches what B's load will build, e.g. `from mlx_engine.backends.torch.paths import compiled;
compiled.SOME_SETTING = ...`. MODEL: a GGUF file or folder (default: the embedded SmolLM2 Q4_1). Prints each
round's decode tok/s, the medians and B/A, the process CPU ms per generated token, the machine's steal time
(/proc/stat) during each side's requests, and whether A and B gave the same greedy tokens.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def steal_ticks() -> int:
    with open("/proc/stat") as f:
        return int(f.readline().split()[8])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("variant", help="a Python file run between loading A and loading B")
    ap.add_argument("model", nargs="?", help="a GGUF file or folder (default: the embedded SmolLM2)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("-p", "--prompt-tokens", type=int, default=128)
    ap.add_argument("-n", "--gen-tokens", type=int, default=32)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from mlx_engine import Engine, GenerationRequest, SamplingParams
    from mlx_engine.loading import embedded_model_path

    path = args.model or str(embedded_model_path())
    variant = Path(args.variant).read_text()

    def load() -> Engine:
        return Engine.load(path, backend="torch", device="cpu", prefix_caching=False, threads=args.threads,
                           max_context=args.prompt_tokens + args.gen_tokens + 16)

    engines = {"A": load()}
    exec(compile(variant, args.variant, "exec"), {"__name__": "variant"})
    engines["B"] = load()
    params = SamplingParams(temperature=0.0, max_tokens=args.gen_tokens, ignore_eos=True)
    tps: dict[str, list[float]] = {"A": [], "B": []}
    cpu: dict[str, list[float]] = {"A": [], "B": []}
    steal = {"A": 0, "B": 0}
    step: dict[str, list[float]] = {"A": [], "B": []}
    same = True
    for r in range(args.rounds):
        prompt = [100 + (r * 7 + i) % 3000 for i in range(args.prompt_tokens)]
        tokens = {}
        for name in ("A", "B") if r % 2 == 0 else ("B", "A"):
            c0, s0 = time.process_time(), steal_ticks()
            events, arrivals = [], []
            for event in engines[name].generate(GenerationRequest(prompt_token_ids=prompt, sampling=params)):
                events.append(event)
                if event.token_ids:
                    arrivals.append((time.perf_counter(), len(event.token_ids)))
            step[name] += [(t1 - t0) * 1000 / n for (t0, _), (t1, n) in zip(arrivals[1:], arrivals[2:])]
            cpu[name].append((time.process_time() - c0) * 1000 / args.gen_tokens)
            steal[name] += steal_ticks() - s0
            tps[name].append(events[-1].stats.decode_tps)
            tokens[name] = [t for e in events for t in e.token_ids]
        same = same and tokens["A"] == tokens["B"]
    for name in ("A", "B"):
        print(name, "decode tok/s", [round(x, 1) for x in tps[name]])
    a, b = statistics.median(tps["A"]), statistics.median(tps["B"])
    print(f"median A {a:.1f}, B {b:.1f}: B/A {b / a:.3f}; CPU ms a token (prefill included) A "
          f"{statistics.median(cpu['A']):.2f}, B {statistics.median(cpu['B']):.2f}; steal ticks A {steal['A']}, "
          f"B {steal['B']}; same greedy tokens: {same}")
    fifth = {name: statistics.quantiles(step[name], n=5)[0] for name in step}
    print(f"decode step ms, 20th percentile of every step's time: A {fifth['A']:.2f}, B {fifth['B']:.2f}: "
          f"B/A {fifth['B'] / fifth['A']:.3f}")
    for e in engines.values():
        e.close()


if __name__ == "__main__":
    main()
