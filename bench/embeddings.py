"""Embeddings throughput: Roofline's packed forwards against sentence-transformers' `encode` on the same checkpoint,
texts and machine, at batch 1, 16 and 64 (inputs/s and tokens/s: the median of every run, the two sides alternating
in rounds, after a warm-up).

    uv run python bench/embeddings.py --peer-python /tmp/st-venv/bin/python            # uniform lengths
    uv run python bench/embeddings.py --peer-python /tmp/st-venv/bin/python --vary     # mixed lengths

The checkpoint (default /tmp/emb-bench) is made once by the peer (bench/embeddings_peer.py make: a random Qwen3
decoder, hidden 384, 6 layers, last-token pooling + Normalize, Qwen3-Embedding's layout). Texts are ASCII slices of
bench/data/founding_documents.txt, one token a byte: `--tokens` each (with `--vary`, 0.5x to 1.5x that, which
sentence-transformers pads to the batch's longest and Roofline packs without padding). Roofline runs in this process
on MLX (its CPU backend here), the peer in a subprocess on torch's CPU build with torch's default threads.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def make_texts(n: int, tokens: int, vary: bool) -> list[str]:
    text = (ROOT / "bench" / "data" / "founding_documents.txt").read_text().encode("ascii", "ignore").decode()
    text = " ".join(text.split())
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        length = int(rng.integers(tokens // 2, tokens * 3 // 2 + 1)) if vary else tokens
        start = int(rng.integers(0, len(text) - length))
        out.append(text[start:start + length - 1])  # + <|endoftext|>: `length` tokens
    return out


def roofline_seconds(engine, texts: list[str], batches: list[int], repeats: int) -> dict[int, list[float]]:
    out = {}
    for b in batches:
        runs = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            engine.embed(texts[:b])
            runs.append(time.perf_counter() - t0)
        out[b] = runs
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peer-python", required=True, help="a python with sentence-transformers and torch")
    ap.add_argument("--model", type=Path, default=Path("/tmp/emb-bench"), help="made by the peer when missing")
    ap.add_argument("--batch", default="1,16,64")
    ap.add_argument("--tokens", type=int, default=128, help="tokens per text (default 128)")
    ap.add_argument("--vary", action="store_true", help="text lengths from 0.5x to 1.5x --tokens")
    ap.add_argument("-r", "--repeats", type=int, default=2, help="runs per batch and round (default 2)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of Roofline then the peer (default 3)")
    ap.add_argument("--peer-threads", type=int, help="torch's CPU threads in the peer (default: torch's choice)")
    args = ap.parse_args()
    batches = [int(b) for b in args.batch.split(",")]
    peer = ROOT / "bench" / "embeddings_peer.py"
    if not (args.model / "modules.json").exists():
        subprocess.run([args.peer_python, str(peer), "make", str(args.model)], check=True)
    texts = make_texts(max(batches), args.tokens, args.vary)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(texts, f)
    from mlx_engine import Engine

    ours: dict[int, list[float]] = {b: [] for b in batches}
    theirs: dict = {"seconds": {str(b): [] for b in batches}}
    with Engine.load(str(args.model)) as engine:
        tokens = {b: engine.embed(texts[:b]).prompt_tokens for b in batches}  # also the warm-up
        for _ in range(args.rounds):  # the two sides alternate: this machine's load moves within minutes
            for b, runs in roofline_seconds(engine, texts, batches, args.repeats).items():
                ours[b] += runs
            peer_run = json.loads(subprocess.run(
                [args.peer_python, str(peer), "time", str(args.model), "--texts", f.name, "--batch", args.batch,
                 "-r", str(args.repeats), *(["--threads", str(args.peer_threads)] if args.peer_threads else [])],
                check=True, capture_output=True, text=True).stdout)
            theirs.update({k: v for k, v in peer_run.items() if k != "seconds"})
            for b, runs in peer_run["seconds"].items():
                theirs["seconds"][b] += runs
    cpu = subprocess.run(["sh", "-c", "lscpu | grep 'Model name' | sed 's/.*: *//'"], capture_output=True,
                         text=True).stdout.strip()
    print(f"# {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {cpu}; {args.model}; "
          f"{'0.5-1.5x ' if args.vary else ''}{args.tokens} tokens a text; torch {theirs['torch']} "
          f"({theirs['threads']} threads); medians of {args.rounds} alternating rounds x {args.repeats} runs")
    print("| batch | tokens | Roofline inputs/s | Roofline tokens/s | sentence-transformers inputs/s | "
          "sentence-transformers tokens/s | Roofline / ST |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for b in batches:
        t_ours, t_st = statistics.median(ours[b]), statistics.median(theirs["seconds"][str(b)])
        n = tokens[b]
        print(f"| {b} | {n} | {b / t_ours:.1f} | {n / t_ours:.0f} | {b / t_st:.1f} | {n / t_st:.0f} | "
              f"{t_st / t_ours:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
