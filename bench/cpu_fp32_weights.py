"""MLX's CPU backend with and without the engine's float32 weight copies (ROOFLINE_CPU_FP32_WEIGHTS on/off), in one
run, interleaved, so that load on the machine hits both alike.

    uv run python bench/cpu_fp32_weights.py [--model M] [--gen-tokens 64] [--repeats 3]

Each run is a fresh process (`roofline generate --json` on a fixed prompt of random token text, greedy, EOS
ignored through -n): the mode is read when the model loads. Prints the load average before and after, each run's
prefill and decode tok/s, and the medians with the on/off ratio, as a Markdown table for
docs/benchmarks/engine-vs-mlx-lm.md.
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

ROOT = Path(__file__).resolve().parents[1]
PROMPT = ("Write a long story about a lighthouse keeper who measures the speed of memory on an old computer, "
          "with many details about the sea, the weather, the machine and the numbers she writes down each night.")


def one_run(mode: str, model: str | None, gen_tokens: int) -> dict:
    cmd = [sys.executable, "-m", "app.cli", "generate", "--backend", "mlx", "-p", PROMPT, "-n", str(gen_tokens),
           "--json"]
    if model:
        cmd += ["--model", model]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900,
                       env={**os.environ, "ROOFLINE_CPU_FP32_WEIGHTS": mode})
    if r.returncode != 0:
        raise SystemExit(f"{mode}: {r.stderr.strip()}")
    out = json.loads(r.stdout)
    return {"mode": mode, "prefill": out["stats"]["prefill_tps"], "decode": out["stats"]["decode_tps"],
            "tokens": out["usage"]["completion_tokens"], "peak_mib": out["stats"]["peak_memory_bytes"] / 2**20}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", "-m")
    ap.add_argument("--gen-tokens", "-n", type=int, default=64)
    ap.add_argument("--repeats", "-r", type=int, default=3)
    args = ap.parse_args()
    load_before = os.getloadavg()
    runs = []
    for i in range(args.repeats):
        for mode in (("on", "off") if i % 2 == 0 else ("off", "on")):  # ABBA: neither always goes first
            runs.append(one_run(mode, args.model, args.gen_tokens))
            print(f"run {len(runs)}: {runs[-1]}", file=sys.stderr)
    load_after = os.getloadavg()
    med = {m: {k: statistics.median(r[k] for r in runs if r["mode"] == m) for k in ("prefill", "decode", "peak_mib")}
           for m in ("on", "off")}
    print(f"{time.strftime('%Y-%m-%d %H:%M')}, {platform.machine()} {os.cpu_count()} cores, load average "
          f"{load_before[0]:.1f} before, {load_after[0]:.1f} after; {args.repeats} runs each, interleaved, "
          f"-n {args.gen_tokens}")
    print("\n| ROOFLINE_CPU_FP32_WEIGHTS | prefill tok/s | decode tok/s | peak MiB | decode runs |")
    print("|---|---:|---:|---:|---|")
    for m in ("on", "off"):
        each = ", ".join(f"{r['decode']:.1f}" for r in runs if r["mode"] == m)
        print(f"| {m} | {med[m]['prefill']:.1f} | {med[m]['decode']:.2f} | {med[m]['peak_mib']:.0f} | {each} |")
    print(f"| on / off | {med['on']['prefill'] / med['off']['prefill']:.2f}x | "
          f"**{med['on']['decode'] / med['off']['decode']:.2f}x** | | |")


if __name__ == "__main__":
    main()
