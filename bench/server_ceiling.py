"""The server's own ceiling: `roofline serve` with the model's forward replaced by a constant token, so what is
left per token is the scheduler (block tables, sampling bookkeeping, detokenizing, stop strings) and the HTTP
layer (pump threads, SSE, JSON). It bounds aggregate tokens/s on any backend, however fast its forward.

    uv run python bench/server_ceiling.py [--clients 1,4,8,16] [--max-tokens 512] [--repeats 3]

The torch runner (on the CPU) returns the constant from its sampling calls without running the model, so a
decode step costs only its host work; the KV block bookkeeping stays real. A prompt may still get a real
forward, before its first token, outside the span measured. The load generator is bench/server.py's.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

TOKEN = 1001  # a word piece of SmolLM2's vocabulary, not EOS


def serve(argv: list[str]) -> None:
    """The server process: the torch runner's sampled tokens replaced by TOKEN, then `roofline serve`."""
    import mlx.core as mx

    from mlx_engine.backends.torch import runner

    def constant(n: int) -> mx.array:
        return mx.array([TOKEN] * n, dtype=mx.int32)

    runner.TorchRunner.decode_sample = lambda self, inputs, layers, samplers: constant(len(samplers))
    runner.TorchRunner.packed_sample = lambda self, inputs, layers, rows, samplers: constant(len(rows)) if rows else None
    from app.cli import main

    sys.argv = ["roofline", "serve", *argv]
    main()


def main() -> None:
    if sys.argv[1:2] == ["--serve"]:
        return serve(sys.argv[2:])
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--clients", default="1,4,8,16")
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3, help="runs per level; the fastest counts (a ceiling)")
    args = p.parse_args()
    widths = [int(x) for x in args.clients.split(",")]

    import server as load

    port = load.free_port()
    target = load.Target("roofline (constant forward)",
                         [sys.executable, __file__, "--serve", "--port", str(port), "--log-level", "warning",
                          "--max-concurrency", str(max(widths)), "--backend", "torch", "--device", "cpu"],
                         "default", "/health")
    proc = load.start(target, port)
    url = f"http://127.0.0.1:{port}"
    rows = {}
    try:
        asyncio.run(load.level(url, target.model, 2, 1, 4))  # warm-up
        for n in widths:
            best = None
            for _ in range(args.repeats):
                results, _ = asyncio.run(load.level(url, target.model, n, 1, args.max_tokens))
                # the clients start together: decode runs from the first first token to the last last token
                window = max(r.seconds for r in results) - min(r.ttft_s for r in results)
                rate = sum(r.tokens - 1 for r in results) / window
                best = rate if best is None else max(best, rate)
            rows[n] = best
    finally:
        load.stop(proc)

    cpu = subprocess.run(["sh", "-c", "lscpu | grep 'Model name' | sed 's/.*: *//'"], capture_output=True,
                         text=True).stdout.strip() or platform.processor()
    print(f"## The server's own ceiling: a constant forward ({datetime.date.today()})\n")
    print(f"- command: `{' '.join(['uv run python bench/server_ceiling.py', *sys.argv[1:]])}`")
    print(f"- machine: {platform.system()} {platform.machine()}, {cpu}, {os.cpu_count()} cores")
    print(f"- workload: each client sends one streaming chat request (greedy, max_tokens {args.max_tokens}); loopback; "
          f"the best of {args.repeats} runs per level; decode tok/s from the first first token to the last token "
          "(each prompt's prefill is a real forward, outside that span)\n")
    print("| clients | decode tok/s | per token (ms) | per step of all clients (ms) |")
    print("|---:|---:|---:|---:|")
    for n, tps in rows.items():
        print(f"| {n} | {tps:.0f} | {1000 / tps:.2f} | {1000 * n / tps:.2f} |")


if __name__ == "__main__":
    main()
