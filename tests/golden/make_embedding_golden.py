"""Write tiny random sentence-transformers checkpoints and their `encode` outputs under tests/data/golden/.

Run by hand, never in CI, in a venv of its own with the CPU build of torch:

    python3 -m venv /tmp/st-venv
    /tmp/st-venv/bin/pip install /opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl \
        sentence-transformers
    /tmp/st-venv/bin/python tests/golden/make_embedding_golden.py

Each folder is what `SentenceTransformer.save` writes around a Qwen3 decoder (hidden 64, 2 layers, weights std 0.2
as tests/golden/make_golden.py draws them): config.json and model.safetensors of the bare `Qwen3Model` (weights
named `layers.0...`, no `model.` prefix and no head, as Qwen3-Embedding ships), a byte-level tokenizer.json that
appends <|endoftext|> (Qwen3-Embedding's), modules.json, 1_Pooling/config.json, config_sentence_transformers.json
with `prompts`, and `golden.npz`:

    st_qwen3_last/   last-token pooling + 2_Normalize; prompts {"query": "Instruct: find it\\nQuery: "}; modules.json
                     and 1_Pooling/config.json rewritten as sentence-transformers 2-3 wrote them (`write_legacy`),
                     the layout published checkpoints such as Qwen3-Embedding have
    st_qwen3_mean/   mean pooling, include_prompt False, no Normalize; prompts {"query": "query: "}; the layout
                     sentence-transformers 6 writes (full module paths, `pooling_mode`)

    golden.npz: plain (N, 64) float32 `encode(SENTENCES)`; query (N, 64) `encode(SENTENCES, prompt_name="query")`;
    cls (N, 64) the same transformer under CLS pooling (the test rewrites 1_Pooling/config.json to match)
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import sentence_transformers
import torch
import transformers
from sentence_transformers import SentenceTransformer, models
from tokenizers import Tokenizer, decoders, pre_tokenizers, processors
from tokenizers import models as tok_models
from transformers import Qwen3Config, Qwen3Model

ROOT = Path(__file__).resolve().parents[1] / "data" / "golden"
SENTENCES = [
    "The cat sat on the mat.",
    "A quick brown fox jumps over the lazy dog",
    "Roofline serves embeddings",
    "x",
    "Paged attention keeps KV in fixed-size blocks; prefix caching shares them between requests.",
    "What is the capital of France?",
    "def add(a, b):\n    return a + b",
    "Embeddings for retrieval-augmented generation, packed into one forward pass.",
]
EOS = "<|endoftext|>"
VOCAB = 136  # 128 byte-level pieces, <|endoftext|> at 128, the rest unused


def byte_level_vocab(n: int) -> list[str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, extra = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    table = dict(zip(bs, map(chr, cs)))
    return [table[b] for b in range(n)]


def write_tokenizer(folder: Path) -> None:
    """Byte-level BPE over bytes 0..127 (no merges), <|endoftext|> appended to every input, as Qwen3-Embedding's."""
    vocab = {p: i for i, p in enumerate(byte_level_vocab(128))}
    vocab[EOS] = 128
    tok = Tokenizer(tok_models.BPE(vocab=vocab, merges=[]))
    tok.add_special_tokens([EOS])
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(single=f"$A {EOS}", pair=f"$A {EOS} $B {EOS}",
                                                       special_tokens=[(EOS, 128)])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "pad_token": EOS, "model_max_length": 256,
        "padding_side": "right"}, indent=1))


def write_legacy(folder: Path, pooling: str) -> None:
    """modules.json and 1_Pooling/config.json as sentence-transformers 2-3 wrote them, as Qwen3-Embedding ships:
    `sentence_transformers.models.<Module>` types and one `pooling_mode_*` flag per mode."""
    modules = json.loads((folder / "modules.json").read_text())
    for m in modules:
        m["type"] = "sentence_transformers.models." + m["type"].rsplit(".", 1)[-1]
    (folder / "modules.json").write_text(json.dumps(modules, indent=2))
    flags = {"cls": "pooling_mode_cls_token", "mean": "pooling_mode_mean_tokens", "max": "pooling_mode_max_tokens",
             "mean_sqrt_len_tokens": "pooling_mode_mean_sqrt_len_tokens",
             "weightedmean": "pooling_mode_weightedmean_tokens", "lasttoken": "pooling_mode_lasttoken"}
    config = json.loads((folder / "1_Pooling" / "config.json").read_text())
    legacy = {"word_embedding_dimension": config["embedding_dimension"],
              **{flag: mode == pooling for mode, flag in flags.items()}, "include_prompt": config["include_prompt"]}
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(legacy, indent=4))
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 256, "do_lower_case": False}))


def make(name: str, pooling: str, normalize: bool, prompts: dict[str, str], include_prompt: bool, seed: int,
         legacy: bool) -> None:
    folder = ROOT / name
    shutil.rmtree(folder, ignore_errors=True)
    hf = Path("/tmp") / f"hf-{name}"
    shutil.rmtree(hf, ignore_errors=True)
    config = Qwen3Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         intermediate_size=96, vocab_size=VOCAB, max_position_embeddings=256, tie_word_embeddings=True,
                         eos_token_id=128, pad_token_id=128, bos_token_id=None,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    torch.manual_seed(seed)
    model = Qwen3Model(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.2 * noise if "norm" in pname else 0.2 * noise)
    model.save_pretrained(hf)
    write_tokenizer(hf)

    transformer = models.Transformer(str(hf), max_seq_length=256, model_kwargs={"attn_implementation": "eager"})
    mods = [transformer, models.Pooling(64, pooling_mode=pooling, include_prompt=include_prompt)]
    if normalize:
        mods.append(models.Normalize())
    st = SentenceTransformer(modules=mods, prompts=prompts, device="cpu")
    st.save(str(folder))
    (folder / "README.md").unlink(missing_ok=True)
    if legacy:
        write_legacy(folder, pooling)

    st = SentenceTransformer(str(folder), device="cpu")
    plain = st.encode(SENTENCES, convert_to_numpy=True, batch_size=3)
    query = st.encode(SENTENCES, prompt_name="query", convert_to_numpy=True, batch_size=3)
    cls_st = SentenceTransformer(modules=[st[0], models.Pooling(64, pooling_mode="cls")], device="cpu")
    cls = cls_st.encode(SENTENCES, convert_to_numpy=True)
    np.savez(folder / "golden.npz", plain=plain.astype(np.float32), query=query.astype(np.float32),
             cls=cls.astype(np.float32))
    (folder / "sentences.json").write_text(json.dumps(SENTENCES, indent=1))
    size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    print(f"{name}: {size / 1024:.0f} KB, files {sorted(str(f.relative_to(folder)) for f in folder.rglob('*') if f.is_file())}")
    print("  first row", plain[0][:4], "norm", np.linalg.norm(plain, axis=1)[:3])


def main() -> None:
    print("sentence-transformers", sentence_transformers.__version__, "transformers", transformers.__version__,
          "torch", torch.__version__)
    make("st_qwen3_last", "lasttoken", True, {"query": "Instruct: find it\nQuery: "}, True, 21000, legacy=True)
    make("st_qwen3_mean", "mean", False, {"query": "query: "}, False, 22000, legacy=False)


if __name__ == "__main__":
    main()
