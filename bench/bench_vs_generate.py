"""`roofline bench`'s decode figure against `roofline generate`'s on the same file and machine (issue 48): each
command run as a user runs it, a process of its own, in turn, round after round, so that a spell of load from other
tenants falls on every side; medians and each side over generate.

    uv run python bench/bench_vs_generate.py [--backends torch,mlx] [--rounds 3] [-n 128] [--model M] [--before]

Sides per backend: `generate --max-tokens N` (its stats line's decode tok/s, from --json), `bench -p 32 -n N
--batch 1 --context 0 --repeats 1` (the tg row), and with --before the bench as it ran before the fix: a torch matmul
on the main thread first, as its peak FLOP/s measurement did, so that the process holds a second OpenMP pool.
Generate's reply may end at EOS before N tokens: its row says how many it gave. Prints the load average around
each round (`uptime`): on a shared machine the figures are noisy, the ratios within a round less so.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "Write a long story about a lighthouse keeper and a cat, in many paragraphs."
# the bench as before issue 48's fix: its peak FLOP/s matmul ran on the main thread before the sweep
BEFORE = ("import sys, torch; a = torch.randn(512, 512); a @ a; from app.cli import main; "
          "sys.exit(main(sys.argv[1:]))")


def run(cmd: list[str]) -> dict:
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stderr[-2000:]}")
    return json.loads(r.stdout) if r.stdout.lstrip().startswith("{") else {}


def generate(model: list[str], backend: list[str], n: int) -> tuple[float, int]:
    out = run([sys.executable, "-m", "app.cli", "generate", *model, *backend, "--json", "--max-tokens", str(n),
               "-p", PROMPT])
    return out["stats"]["decode_tps"], out["usage"]["completion_tokens"]


def bench(model: list[str], backend: list[str], n: int, before: bool) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bench.json"
        head = [sys.executable, "-c", BEFORE] if before else [sys.executable, "-m", "app.cli"]
        run([*head, "bench", *model, *backend, "-p", "32", "-n", str(n), "--batch", "1", "--context", "0",
             "--repeats", "1", "--json", str(path)])
        (row,) = json.loads(path.read_text())["rows"]
        return row["tg"]["mean"]


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backends", default="torch,mlx", help="comma-separated: torch (on the CPU), mlx")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("-n", "--gen-tokens", type=int, default=128)
    ap.add_argument("--model", "-m", help="default: the embedded SmolLM2")
    ap.add_argument("--before", action="store_true", help="also the bench as it ran before the fix")
    args = ap.parse_args()
    model = ["--model", args.model] if args.model else []
    sides = ["generate", "bench"] + (["bench (before)"] if args.before else [])
    tps: dict[tuple[str, str], list[float]] = {}
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; -n {args.gen_tokens}")
    for r in range(args.rounds):
        print(f"round {r + 1}: load average {load_average()}", flush=True)
        for be in args.backends.split(","):
            backend = ["--backend", "torch", "--device", "cpu"] if be == "torch" else ["--backend", "mlx"]
            for side in sides:
                if side == "generate":
                    rate, made = generate(model, backend, args.gen_tokens)
                    extra = f" ({made} tokens)"
                else:
                    rate, extra = bench(model, backend, args.gen_tokens, side.endswith("(before)")), ""
                tps.setdefault((be, side), []).append(rate)
                print(f"  {be:5s} {side:15s} {rate:8.1f} tok/s{extra}", flush=True)
    print(f"after: load average {load_average()}")
    print("\nbackend  side             median tok/s  / generate")
    for be in args.backends.split(","):
        base = statistics.median(tps[(be, "generate")])
        for side in sides:
            med = statistics.median(tps[(be, side)])
            print(f"{be:8s} {side:15s} {med:13.1f}  {med / base:9.2f}x")


if __name__ == "__main__":
    main()
