"""Tiny checkpoints written by the tests themselves: a GGUF file from a HF folder, MLX-quantized folders."""

from __future__ import annotations

import json
import shutil
import zlib
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

from quant.formats import KQUANT_TYPES, QK_K, block_format, row_bytes

GOLDEN = Path(__file__).parent.parent / "data" / "golden"


def parity_goldens() -> list[Path]:
    """The golden folders of causal LMs against transformers (golden.npz: input_ids, logits, greedy tokens); an
    embedding model's folder (modules.json) holds sentence-transformers' vectors instead (tests/test_embedding.py)."""
    return sorted(p for p in GOLDEN.iterdir() if (p / "golden.npz").exists() and not (p / "modules.json").exists())

_HF_TO_GGUF = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def byte_level_vocab(n: int) -> list[str]:
    """The first n byte-level BPE tokens (GPT-2's bytes_to_unicode of bytes 0..n-1)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, extra = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    table = dict(zip(bs, map(chr, cs)))
    return [table[b] for b in range(n)]


def llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of Q/K rows (HF half-split rope -> interleaved)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# This gguf version implements no quantizer for the k-quants and the i-quants IQ4_XS and IQ4_NL, so their weights
# are random bytes with the fp16 scale fields (`quant.formats`' layouts) overwritten by finite values: every bit
# pattern of the other fields is valid.
RANDOM_BLOCK_TYPES = (*KQUANT_TYPES, "IQ4_XS", "IQ4_NL")


def random_blocks(rng: np.random.Generator, ggml_type: str, out_features: int, in_features: int,
                  std: float | None = None) -> np.ndarray:
    """Random k-quant (or IQ4) bytes (out_features, in_features / block weights * bytes per block); with `std`, the
    fp16 scales are rescaled so the dequantized weights have about that standard deviation."""
    f = block_format(ggml_type)
    w = rng.integers(0, 256, (out_features, row_bytes(ggml_type, in_features)), dtype=np.uint8)
    blocks = w.reshape(-1, row_bytes(ggml_type, QK_K))  # 256 weights a row, in one block or eight
    fp16_offsets = [i * f.block_bytes + off for i in range(QK_K // f.block_weights) for off in f.fp16_offsets()]
    for off in fp16_offsets:
        d = (rng.standard_normal(blocks.shape[0]) * 0.02).astype(np.float16)
        blocks[:, off : off + 2] = d.view(np.uint8).reshape(-1, 2)
    if std is not None:
        from gguf.constants import GGMLQuantizationType
        from gguf.quants import dequantize

        c = std / float(dequantize(w, GGMLQuantizationType[ggml_type]).std())
        for off in fp16_offsets:
            d = blocks[:, off : off + 2].copy().view(np.float16)[:, 0]
            blocks[:, off : off + 2] = (d.astype(np.float32) * c).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return w


def add_common_metadata(w, config: dict) -> None:
    """The attention shape, norm epsilon and rope base every llama.cpp architecture writes."""
    n_heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // n_heads
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_block_count(config["num_hidden_layers"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(n_heads)
    w.add_head_count_kv(config["num_key_value_heads"])
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(config.get("rms_norm_eps", 1e-5))
    rope = config.get("rope_parameters") or {}
    rope = rope.get("full_attention", rope)
    w.add_rope_freq_base(rope.get("rope_theta", config.get("rope_theta", 10000.0)))


def add_byte_level_tokenizer(w, config: dict) -> None:
    """A GPT-2 style vocabulary of the config's size: byte-level tokens and one merge."""
    vocab = config["vocab_size"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(byte_level_vocab(vocab - 1) + ['!"'])
    w.add_token_types([1] * vocab)
    w.add_token_merges(['! "'])
    w.add_bos_token_id(config.get("bos_token_id") or 1)
    w.add_eos_token_id(config.get("eos_token_id") or 2)
    w.add_add_bos_token(False)


def write_gguf_from_folder(folder: Path, out: Path, qtypes: dict[str, str], default_type: str = "Q8_0") -> dict:
    """Writes `folder`'s llama checkpoint as a GGUF file (Q/K permuted as llama.cpp does). `qtypes` maps a
    substring of the GGUF tensor name to a ggml type name; 2-D tensors default to `default_type`, 1-D to F32.
    Returns {gguf tensor name: dequantized float32 array in HF row order} for building the expected model."""
    import gguf
    from gguf.constants import GGMLQuantizationType as Q

    config = json.loads((folder / "config.json").read_text())
    weights = load_file(str(folder / "model.safetensors"))
    arch = config["model_type"]
    w = gguf.GGUFWriter(str(out), arch)
    n_heads, n_kv = config["num_attention_heads"], config["num_key_value_heads"]
    add_common_metadata(w, config)
    add_byte_level_tokenizer(w, config)

    dequantized: dict[str, np.ndarray] = {}
    for name, value in weights.items():
        value = value.astype(np.float32)
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            gname = "output.weight"
        else:
            _, _, layer, rest = name.split(".", 3)
            module, leaf = rest.rsplit(".", 1)
            gname = f"blk.{layer}.{_HF_TO_GGUF[module]}.{leaf}"
        stored = value
        if arch == "llama" and (".attn_q." in gname or ".attn_k." in gname):
            stored = llama_permute(value, n_heads if ".attn_q." in gname else n_kv)
        tname = "F32"
        if value.ndim == 2:
            tname = next((t for key, t in qtypes.items() if key in gname), default_type)
        qtype = Q[tname]
        if qtype == Q.F32:
            w.add_tensor(gname, stored)
            dequantized[gname] = value
        elif tname in RANDOM_BLOCK_TYPES:  # random blocks of the weight's scale (no k-quant quantizer)
            rng = np.random.default_rng(zlib.crc32(gname.encode()))
            packed = random_blocks(rng, tname, value.shape[0], value.shape[1], std=float(value.std()))
            w.add_tensor(gname, packed, raw_dtype=qtype)
            back = gguf.quants.dequantize(packed, qtype).reshape(value.shape)
            if stored is not value:  # the stored rows are in llama.cpp's order: undo it for the reference
                n = n_heads if ".attn_q." in gname else n_kv
                back = back.reshape(n, back.shape[0] // n // 2, 2, -1).swapaxes(1, 2).reshape(value.shape)
            dequantized[gname] = back
        else:
            packed = gguf.quants.quantize(stored, qtype)
            w.add_tensor(gname, packed, raw_shape=packed.shape, raw_dtype=qtype)
            back = gguf.quants.dequantize(packed, qtype).reshape(value.shape)
            if stored is not value:  # undo the permutation for the HF-order reference
                n = n_heads if ".attn_q." in gname else n_kv
                back = back.reshape(n, back.shape[0] // n // 2, 2, -1).swapaxes(1, 2).reshape(value.shape)
            dequantized[gname] = back
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dequantized


def folder_with_weights(src: Path, dst: Path, replace: dict[str, np.ndarray]) -> Path:
    """A copy of HF folder `src` whose safetensors tensors are replaced by `replace` (HF names)."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in ("config.json", "generation_config.json"):
        if (src / f).exists():
            shutil.copy(src / f, dst / f)
    weights = load_file(str(src / "model.safetensors"))
    weights.update({k: v.astype(np.float32) for k, v in replace.items()})
    save_file(weights, str(dst / "model.safetensors"))
    return dst


def gguf_to_hf_names(dequantized: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    inverse = {v: k for k, v in _HF_TO_GGUF.items()}
    out = {}
    for gname, value in dequantized.items():
        if gname == "token_embd.weight":
            out["model.embed_tokens.weight"] = value
        elif gname == "output_norm.weight":
            out["model.norm.weight"] = value
        elif gname == "output.weight":
            out["lm_head.weight"] = value
        else:
            _, layer, module, leaf = gname.split(".")
            out[f"model.layers.{layer}.{inverse[module]}.{leaf}"] = value
    return out


def random_llama_folder(dst: Path, num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 16,
                        hidden: int = 64, layers: int = 2, vocab: int = 128, seed: int = 0,
                        context: int = 512) -> Path:
    """A random tiny llama checkpoint (fp32 safetensors, no tokenizer) with the given attention shape."""
    rng = np.random.default_rng(seed)
    config = {
        "model_type": "llama", "hidden_size": hidden, "num_hidden_layers": layers, "intermediate_size": 96,
        "num_attention_heads": num_heads, "num_key_value_heads": num_kv_heads, "head_dim": head_dim,
        "vocab_size": vocab, "rms_norm_eps": 1e-5, "max_position_embeddings": context,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "tie_word_embeddings": False,
        "eos_token_id": 2,
    }

    def w(*shape: int, std: float = 0.2) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    weights = {"model.embed_tokens.weight": w(vocab, hidden, std=1.0), "model.norm.weight": 1 + w(hidden),
               "lm_head.weight": w(vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        weights.update({
            p + "input_layernorm.weight": 1 + w(hidden), p + "post_attention_layernorm.weight": 1 + w(hidden),
            p + "self_attn.q_proj.weight": w(num_heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": w(num_kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": w(num_kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": w(hidden, num_heads * head_dim),
            p + "mlp.gate_proj.weight": w(96, hidden), p + "mlp.up_proj.weight": w(96, hidden),
            p + "mlp.down_proj.weight": w(hidden, 96),
        })
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(json.dumps(config))
    save_file(weights, str(dst / "model.safetensors"))
    return dst


def random_mamba_folder(dst: Path) -> Path:
    """A random tiny mamba checkpoint (SSM state, not K/V: mlx-lm's ArraysCache, which cannot be rolled back)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from mlx_engine.models import instantiate

    config = dict(model_type="mamba", vocab_size=128, hidden_size=32, intermediate_size=64, state_size=8,
                  num_hidden_layers=2, conv_kernel=4, use_bias=False, use_conv_bias=True, time_step_rank=4,
                  tie_word_embeddings=True)
    model, *_ = instantiate(config, "mamba")
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(dst / "model.safetensors"), dict(tree_flatten(model.parameters())))
    return dst


# every k-quant type beside Q4_0 / Q4_1 (ffn_down's 96 inputs hold no 256-weight super-block)
KQUANT_LAYOUT = {"attn_q": "Q4_K", "attn_k": "Q3_K", "attn_v": "Q5_K", "attn_output": "Q6_K", "ffn_gate": "Q2_K",
                 "ffn_up": "Q4_K", "ffn_down": "Q4_1", "token_embd": "Q4_0", "output": "Q6_K"}


# the other types common GGUF files hold: Q5_0 / Q5_1 (llama.cpp's choice for rows not a multiple of 256 in
# Q3_K_M..Q5_K_M files), the i-quants IQ4_NL / IQ4_XS, and MXFP4 (gpt-oss)
OTHER_LAYOUT = {"attn_q": "IQ4_XS", "attn_k": "IQ4_NL", "attn_v": "Q5_0", "attn_output": "Q5_1", "ffn_gate": "MXFP4",
                "ffn_up": "IQ4_NL", "ffn_down": "Q5_1", "token_embd": "Q5_0", "output": "IQ4_XS"}
DENSE_AT_LOAD = (*KQUANT_TYPES, "IQ4_NL", "IQ4_XS")  # held as float16 on the CPU


def kquant_llama_gguf(tmp: Path, layout: dict[str, str] = KQUANT_LAYOUT) -> tuple[Path, Path, dict[str, np.ndarray]]:
    """A random llama of hidden size 256 (one k-quant super-block) as a GGUF in `layout`: (the file, its
    source folder, {gguf name: dequantized float32 weights in HF row order})."""
    src = random_llama_folder(tmp / "src", num_heads=4, num_kv_heads=2, head_dim=64, hidden=256)
    path = tmp / "k.gguf"
    return path, src, write_gguf_from_folder(src, path, layout)


def kquants_as_float16(deq: dict[str, np.ndarray], layout: dict[str, str] = KQUANT_LAYOUT) -> dict[str, np.ndarray]:
    """The matrices of `kquant_llama_gguf` the loader keeps dense (k-quants, i-quants) rounded to float16."""
    def kind(gname: str) -> str:  # each matrix's type as the writer picks it
        return next((t for key, t in layout.items() if key in gname), "Q8_0")

    return {g: v.astype(np.float16).astype(np.float32) if v.ndim == 2 and kind(g) in DENSE_AT_LOAD else v
            for g, v in deq.items()}

# issue 47's families (tests/golden/make_golden_2026.py): their parity is tests/test_engine_parity_families.py's,
# against the float32 floors of tests/support/tolerance.py
FAMILIES_2026 = ("deepseek_v3", "exaone4", "falcon_h1", "gemma4_text", "glm4_moe", "granitemoehybrid", "lfm2",
                 "nemotron_h", "olmo3", "qwen3_5_moe_text", "qwen3_5_text", "qwen3_5_vlm", "qwen3_next", "smollm3")
