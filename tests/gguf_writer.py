"""A GGUF file from a golden HF checkpoint, written as llama.cpp's convert_hf_to_gguf.py writes that family:
gguf-py's tensor names (TensorNameMap), experts stacked per layer, Q/K rows permuted for llama-rope
architectures, Gemma's norms stored as 1 + w, gpt-oss's interleaved gate/up split, and the family's metadata.

Beyond what the converter writes, a few keys carry settings llama.cpp keeps in code, so the tiny goldens'
non-default values survive (the loader honours each key, and applies llama.cpp's rule without it):
`attention.scale` (Gemma's query_pre_attn_scalar), `attention.sliding_window_pattern` and `rope.freq_base_swa`
(Gemma 3), `attention.sliding_window` (StarCoder2).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

from tests.tiny_models import add_byte_level_tokenizer, add_common_metadata, llama_permute

# HF model_type -> GGUF architecture
GGUF_ARCH = {"llama": "llama", "qwen3": "qwen3", "mixtral": "llama", "phi3": "phi3", "gemma2": "gemma2", "gemma3_text": "gemma3",
             "olmo2": "olmo2", "granite": "granite", "qwen3_moe": "qwen3moe", "starcoder2": "starcoder2",
             "gpt_oss": "gpt-oss"}
_PER_EXPERT = re.compile(r"^model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(\w+)\.weight$")
_EXPERT_PROJ = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down", "down_proj": "down"}


def _rope(config: dict) -> dict:
    params = config.get("rope_parameters") or {}
    return params.get("full_attention", params)


def _metadata(w, config: dict, arch: str) -> None:
    import gguf

    add_common_metadata(w, config)
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    rope = _rope(config)
    rope_type = rope.get("rope_type", "default")
    if rope_type == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    elif rope_type == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    experts = config.get("num_local_experts") or config.get("num_experts")
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(config["num_experts_per_tok"])
        if config.get("moe_intermediate_size") or arch == "gpt-oss":
            w.add_expert_feed_forward_length(config.get("moe_intermediate_size") or config["intermediate_size"])
    if config.get("sliding_window"):
        w.add_sliding_window(config["sliding_window"])
    if arch in ("gemma2", "gemma3"):
        w.add_attention_scale(config["query_pre_attn_scalar"] ** -0.5)
        if config.get("final_logit_softcapping"):
            w.add_final_logit_softcapping(config["final_logit_softcapping"])
        if arch == "gemma2":
            w.add_attn_logit_softcapping(config["attn_logit_softcapping"])
        else:
            w.add_sliding_window_pattern([t == "sliding_attention" for t in config["layer_types"]])
            w.add_rope_freq_base_swa(config["rope_parameters"]["sliding_attention"]["rope_theta"])
    elif arch == "phi3":
        w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    elif arch == "starcoder2":
        w.add_layer_norm_eps(config["norm_epsilon"])
    elif arch == "granite":
        w.add_attention_scale(config["attention_multiplier"])
        w.add_embedding_scale(config["embedding_multiplier"])
        w.add_residual_scale(config["residual_multiplier"])
        w.add_logit_scale(config["logits_scaling"])


def _tensors(weights: dict[str, np.ndarray], config: dict, arch: str) -> dict[str, np.ndarray]:
    """{GGUF name: float32 value in the file's layout}."""
    from gguf.constants import MODEL_ARCH_NAMES
    from gguf.tensor_mapping import TensorNameMap

    n_layers = config["num_hidden_layers"]
    tmap = TensorNameMap(next(a for a, n in MODEL_ARCH_NAMES.items() if n == arch), n_layers)
    out: dict[str, np.ndarray] = {}
    experts: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    for name, value in weights.items():
        value = value.astype(np.float32)
        if m := _PER_EXPERT.match(name):  # stacked per layer: (E, out, in)
            layer, e, proj = m.groups()
            experts.setdefault((int(layer), _EXPERT_PROJ[proj]), {})[int(e)] = value
            continue
        if arch == "gpt-oss" and ".mlp.experts." in name:  # transformers' (E, in, out), gate/up interleaved
            layer = int(name.split(".")[2])
            if name.endswith("gate_up_proj"):
                out[f"blk.{layer}.ffn_gate_exps.weight"] = np.ascontiguousarray(value[..., ::2].swapaxes(1, 2))
                out[f"blk.{layer}.ffn_up_exps.weight"] = np.ascontiguousarray(value[..., 1::2].swapaxes(1, 2))
            elif name.endswith("gate_up_proj_bias"):
                out[f"blk.{layer}.ffn_gate_exps.bias"] = np.ascontiguousarray(value[..., ::2])
                out[f"blk.{layer}.ffn_up_exps.bias"] = np.ascontiguousarray(value[..., 1::2])
            elif name.endswith("down_proj"):
                out[f"blk.{layer}.ffn_down_exps.weight"] = np.ascontiguousarray(value.swapaxes(1, 2))
            else:
                out[f"blk.{layer}.ffn_down_exps.bias"] = value
            continue
        gname = tmap.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gname is not None, f"no GGUF name for {name}"
        if not gname.endswith((".weight", ".bias")):
            gname += ".weight"  # gpt-oss's attention sinks
        if arch in ("llama", "granite") and (".attn_q." in gname or ".attn_k." in gname):
            value = llama_permute(value, config["num_attention_heads"] if ".attn_q." in gname
                                  else config["num_key_value_heads"])
        if arch in ("gemma2", "gemma3") and gname.endswith("norm.weight"):
            value = value + 1
        out[gname] = value
    for (layer, proj), by_expert in sorted(experts.items()):
        out[f"blk.{layer}.ffn_{proj}_exps.weight"] = np.stack([by_expert[e] for e in sorted(by_expert)])
    return out


def write_family_gguf(folder: Path, path: Path, qtype: str = "F32", quantize: tuple[str, ...] = (),
                      as_float: bool = False, pooling_type: int | None = None) -> Path:
    """`folder`'s checkpoint as a GGUF file. `quantize`: substrings of GGUF tensor names stored as `qtype`
    (through gguf.quants.quantize); everything else float32. `as_float`: those tensors stored as float32 of
    their `qtype` values instead (gguf.quants.dequantize), the reference file. `pooling_type`: llama.cpp's
    `<arch>.pooling_type` (an embedding model's: 1 mean, 2 cls, 3 last)."""
    import gguf
    from gguf.constants import GGMLQuantizationType as Q

    from mlx_engine.models.config import normalize_config

    config = normalize_config(json.loads((folder / "config.json").read_text()))
    arch = GGUF_ARCH[config["model_type"]]
    weights = load_file(str(folder / "model.safetensors"))
    w = gguf.GGUFWriter(str(path), arch)
    _metadata(w, {**json.loads((folder / "config.json").read_text()), **config}, arch)
    add_byte_level_tokenizer(w, config)
    if pooling_type is not None:
        w.add_uint32(f"{arch}.pooling_type", pooling_type)
    for gname, value in _tensors(weights, config, arch).items():
        if value.ndim >= 2 and gname.endswith(".weight") and any(k in gname for k in quantize):
            packed = gguf.quants.quantize(value, Q[qtype])
            if as_float:
                w.add_tensor(gname, gguf.quants.dequantize(packed, Q[qtype]).reshape(value.shape))
            else:
                w.add_tensor(gname, packed, raw_shape=packed.shape, raw_dtype=Q[qtype])
        else:
            w.add_tensor(gname, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
