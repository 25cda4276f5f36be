"""The peer for bench/embeddings.py: sentence-transformers' `encode` on the same checkpoint and machine. Runs in a
venv with sentence-transformers and the CPU build of torch (tests/golden/make_embedding_golden.py says how to make
one); it does not import Roofline.

    /tmp/st-venv/bin/python bench/embeddings_peer.py make /tmp/emb-bench --hidden 384 --layers 6
    /tmp/st-venv/bin/python bench/embeddings_peer.py time /tmp/emb-bench --texts texts.json --batch 1,16,64 -r 3

`make` writes a random sentence-transformers checkpoint around a Qwen3 decoder (last-token pooling + Normalize,
Qwen3-Embedding's layout; the byte-level tokenizer of tests/data/golden/st_qwen3_last). `time` prints JSON: per
batch size, the seconds of each `encode(texts, batch_size=B)` over every text, after one warm-up call.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
TOKENIZER = Path(__file__).resolve().parents[1] / "tests" / "data" / "golden" / "st_qwen3_last"


def make(folder: Path, hidden: int, layers: int) -> None:
    import torch
    from sentence_transformers import SentenceTransformer, models
    from transformers import Qwen3Config, Qwen3Model

    heads = max(hidden // 64, 1)
    config = Qwen3Config(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=max(heads // 2, 1), head_dim=64, intermediate_size=hidden * 3,
                         vocab_size=136, max_position_embeddings=4096, tie_word_embeddings=True, eos_token_id=128,
                         pad_token_id=128, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    torch.manual_seed(0)
    model = Qwen3Model(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.02 * torch.randn(p.shape) if "norm" in name else 0.02 * torch.randn(p.shape))
    hf = folder.with_name(folder.name + "-hf")
    shutil.rmtree(hf, ignore_errors=True)
    model.save_pretrained(hf)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER / name, hf / name)
    st = SentenceTransformer(modules=[models.Transformer(str(hf), max_seq_length=4096),
                                      models.Pooling(hidden, pooling_mode="lasttoken"), models.Normalize()],
                             device="cpu")
    shutil.rmtree(folder, ignore_errors=True)
    st.save(str(folder))
    shutil.rmtree(hf)
    print(f"wrote {folder}: Qwen3 hidden {hidden}, {layers} layers, "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters")


def time_encode(folder: Path, texts: list[str], batches: list[int], repeats: int) -> dict:
    import torch
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(folder), device="cpu")
    out = {"torch": torch.__version__, "threads": torch.get_num_threads(), "seconds": {}}
    for b in batches:
        chosen = texts[:b]
        st.encode(chosen, batch_size=b)  # warm-up
        runs = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            st.encode(chosen, batch_size=b, convert_to_numpy=True)
            runs.append(time.perf_counter() - t0)
        out["seconds"][str(b)] = runs
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("folder", type=Path)
    m.add_argument("--hidden", type=int, default=384)
    m.add_argument("--layers", type=int, default=6)
    t = sub.add_parser("time")
    t.add_argument("folder", type=Path)
    t.add_argument("--texts", type=Path, required=True, help="a JSON list of texts (the first B make batch B)")
    t.add_argument("--batch", default="1,16,64")
    t.add_argument("-r", "--repeats", type=int, default=3)
    t.add_argument("--threads", type=int, help="torch's CPU threads (default: torch's own choice)")
    args = ap.parse_args()
    if getattr(args, "threads", None):
        import torch

        torch.set_num_threads(args.threads)
    if args.cmd == "make":
        make(args.folder, args.hidden, args.layers)
    else:
        batches = [int(b) for b in args.batch.split(",")]
        print(json.dumps(time_encode(args.folder, json.loads(args.texts.read_text()), batches, args.repeats)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
