"""`roofline embed -m MODEL TEXT...`: one vector per text from an embedding model, printed (a JSON array a line) or
written to .npy."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from mlx_engine.api import EmbedderLike, RooflineError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("embed", help="embed texts with an embedding model: print the vectors or write them to .npy")
    p.add_argument("--model", "-m", required=True,
                   help="an embedding model: a sentence-transformers folder (modules.json), a GGUF file with a "
                   "pooling type, or ORG/NAME of the Hugging Face Hub (e.g. Qwen/Qwen3-Embedding-0.6B)")
    p.add_argument("texts", nargs="+", metavar="TEXT", help="the texts, one vector each")
    p.add_argument("--output", "-o", metavar="FILE", help="write float32 (N, dimensions) to this .npy file instead "
                   "of printing")
    p.add_argument("--dimensions", type=int, metavar="N", help="keep the first N dimensions, renormalized "
                   "(Matryoshka models)")
    p.add_argument("--prompt-name", metavar="NAME", help="an instruction prefix of the model's prompts "
                   "(config_sentence_transformers.json), e.g. query")
    p.add_argument("--max-context", type=int, metavar="N", help="cap the tokens per text below the model's own")


def cmd_embed(args: argparse.Namespace) -> int:
    import numpy as np

    from mlx_engine.embedding.layout import embedding_layout

    out = Path(args.output) if args.output else None
    if out is not None and not out.parent.exists():
        raise RooflineError(f"--output {out}: folder {out.parent} does not exist")
    if embedding_layout(args.model) is None:  # before loading a chat model only to refuse it
        raise RooflineError(f"{args.model} is a chat model: it has no pooling, so it gives no embeddings (Roofline "
                            "does not mean-pool a chat model's states); use an embedding model: a sentence-transformers "
                            "folder (modules.json) or a GGUF file with a pooling type, e.g. `roofline embed -m "
                            "Qwen/Qwen3-Embedding-0.6B`")
    from app.options import load_engine

    options = {"max_context": args.max_context} if args.max_context is not None else {}
    engine = load_engine(args.model, **options)
    assert isinstance(engine, EmbedderLike) and engine.info.embeddings
    try:
        t0 = time.perf_counter()
        result = engine.embed(list(args.texts), dimensions=args.dimensions, prompt_name=args.prompt_name)
        seconds = time.perf_counter() - t0
    finally:
        engine.close()
    vectors = result.vectors.astype(np.float32)
    if out is not None:
        np.save(out, vectors)
        print(f"wrote {out} float32 {tuple(vectors.shape)}", file=sys.stderr)
    else:
        for row in vectors:
            print(json.dumps([float(f"{x:.7g}") for x in row]))
    print(f"{len(vectors)} inputs, {result.prompt_tokens} tokens in {seconds:.3f} s", file=sys.stderr)
    return 0
