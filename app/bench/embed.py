"""`roofline bench -m EMBEDDING_MODEL`: embeddings throughput rows (inputs/s and tokens/s at batch 1, 16 and 64),
in place of prefill and decode, which an embedding model does not do. Each input is `-p` random token ids; a batch is
one `embed` call (its inputs packed into forwards of up to 1024 tokens); the median of the repeats after a warm-up."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from mlx_engine.api import EmbedderLike, RooflineError

DEFAULT_BATCHES = "1,16,64"
SCHEMA = "roofline-bench-embed-1"


def is_embedding_model(ref: str | None) -> bool:
    from mlx_engine.embedding.layout import embedding_layout

    return ref is not None and embedding_layout(ref) is not None


def measure(engine: EmbedderLike, batches: tuple[int, ...], tokens: int, repeats: int, seed: int = 0) -> list[dict]:
    import numpy as np

    rng = np.random.default_rng(seed)
    inputs = rng.integers(0, engine.info.vocab_size, (max(batches), tokens)).tolist()
    rows = []
    for b in batches:
        engine.embed(inputs[:b])  # warm-up
        runs = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            engine.embed(inputs[:b])
            runs.append(time.perf_counter() - t0)
        t = statistics.median(runs)
        rows.append({"test": "embed", "batch": b, "tokens_per_input": tokens, "seconds": runs,
                     "inputs_per_s": b / t, "tokens_per_s": b * tokens / t})
    return rows


def cmd_bench_embeddings(args: argparse.Namespace, batches: tuple[int, ...]) -> int:
    from app.options import load_engine

    if args.prompt_tokens < 1 or args.repeats < 1:
        raise RooflineError("-p and -r must be integers >= 1")
    out = Path(args.json) if args.json else None
    if out is not None and not out.parent.exists():
        raise RooflineError(f"--json {out}: folder {out.parent} does not exist")
    engine = load_engine(args.model)
    try:
        if args.prompt_tokens > engine.info.context_length:
            raise RooflineError(f"-p {args.prompt_tokens}: the model's context is {engine.info.context_length} tokens")
        name, where = engine.info.name, engine.info.runs_on
        rows = measure(engine, batches, args.prompt_tokens, args.repeats)
    finally:
        engine.close()
    lines = ["| model | runs on | test | inputs/s | tokens/s |", "|---|---|---|---:|---:|"] if args.markdown else \
        [f"{'model':32s} {'runs on':14s} {'test':22s} {'inputs/s':>10s} {'tokens/s':>10s}"]
    for r in rows:
        test = f"embed b={r['batch']} p={r['tokens_per_input']}"
        if args.markdown:
            lines.append(f"| {name} | {where} | {test} | {r['inputs_per_s']:.1f} | {r['tokens_per_s']:.0f} |")
        else:
            lines.append(f"{name[:32]:32s} {where:14s} {test:22s} {r['inputs_per_s']:10.1f} {r['tokens_per_s']:10.0f}")
    print("\n".join(lines), flush=True)
    if out is not None:
        result: dict[str, Any] = {"schema": SCHEMA, "model": name, "runs_on": where,
                                  "command": " ".join(["roofline", *sys.argv[1:]]), "rows": rows}
        out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {out}", file=sys.stderr)
    return 0
