"""GGUF checkpoints: config from metadata, tensors renamed to HF names, llama.cpp's Q/K row permutation undone.

MLX reads F32/F16/BF16 tensors and maps Q4_0/Q4_1/Q8_0 to its affine quantization (group size 32), so
these run natively without dequantizing. A file with k-quants (Q2_K..Q6_K) is read by `gguf_tensors`
instead (MLX's own loader gets some of them wrong), which dequantizes them to float16 at load or keeps
their blocks for kernels that read them (Metal, CUDA).
"""

from __future__ import annotations

import re
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlx_engine.api import ModelLoadError
from mlx_engine.loading.gguf_file import GGUFFile

LOADABLE_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
GGUF_ARCHITECTURES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"}
GGUF_GROUP_SIZE = 32

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLK = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias|scales|biases)$")
_TOP = re.compile(r"^(\w+)\.(weight|bias|scales|biases)$")


def gguf_config(g: GGUFFile) -> dict[str, Any]:
    """An HF-style config.json dict from GGUF metadata."""
    m, arch = g.metadata, g.architecture
    if arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"{g.path}: unsupported GGUF architecture {arch!r} (supported: {', '.join(GGUF_ARCHITECTURES)})"
        )

    def get(key: str, default: Any = None, required: bool = True) -> Any:
        full = f"{arch}.{key}"
        if full in m:
            v = m[full]
            return v.item() if hasattr(v, "item") else v
        if required and default is None:
            raise ModelLoadError(f"{g.path}: GGUF metadata is missing {full!r}")
        return default

    n_heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    embd = next((t for t in g.tensors if t.name == "token_embd.weight"), None)
    if embd is None:
        raise ModelLoadError(f"{g.path}: GGUF file has no token_embd.weight tensor")
    config: dict[str, Any] = {
        "model_type": GGUF_ARCHITECTURES[arch],
        "hidden_size": hidden,
        "num_hidden_layers": int(get("block_count")),
        "intermediate_size": int(get("feed_forward_length")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(get("attention.head_count_kv", n_heads)),
        "head_dim": int(get("attention.key_length", hidden // n_heads)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length", 4096)),
        "vocab_size": int(embd.shape[0]),
        "tie_word_embeddings": not any(t.name == "output.weight" for t in g.tensors),
    }
    scaling_type = get("rope.scaling.type", "none", required=False)
    if scaling_type == "linear":
        config["rope_scaling"] = {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
    elif scaling_type == "yarn":
        config["rope_scaling"] = {
            "rope_type": "yarn",
            "factor": float(get("rope.scaling.factor")),
            "original_max_position_embeddings": int(get("rope.scaling.original_context_length")),
        }
    elif scaling_type not in ("none", None):
        raise ModelLoadError(f"{g.path}: unsupported GGUF rope scaling {scaling_type!r} (supported: linear, yarn)")
    window = get("attention.sliding_window", 0, required=False)
    if window:
        config["sliding_window"] = int(window)
    return config


def check_tensor_types(g: GGUFFile) -> None:
    bad = sorted({t.ggml_type for t in g.tensors} - set(LOADABLE_TYPES))
    if bad:
        example = next(t.name for t in g.tensors if t.ggml_type == bad[0])
        raise ModelLoadError(
            f"{g.path}: GGUF tensor type {', '.join(bad)} is not loadable yet (e.g. tensor {example!r}); "
            f"supported: {', '.join(LOADABLE_TYPES)}. Use a GGUF of those types, or the model's safetensors."
        )


def _unpermute_rows(w: mx.array, n_head: int) -> mx.array:
    """Undo llama.cpp's convert permutation (HF half-split rope -> interleaved) on output rows."""
    # llama.cpp: w.reshape(n_head, 2, rows // n_head // 2, ...).swapaxes(1, 2); this is its inverse
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_weights(g: GGUFFile, config: dict[str, Any],
                 kquant_blocks: bool = False) -> tuple[dict[str, mx.array], dict[str, Any] | None]:
    """(weights under HF names, quantization spec for build_model or None). `kquant_blocks`: k-quant
    matrices as their raw blocks, each path's quantization entry {"kquant": type} (`load_checkpoint`)."""
    from mlx_engine.loading.gguf_tensors import KQUANT_TYPES, read_tensors

    kquants: dict[str, str] = {}  # gguf tensor name -> type, of those kept as blocks
    try:
        raw = (read_tensors(g, kquants if kquant_blocks else None) if g.tensor_types() & set(KQUANT_TYPES)
               else mx.load(str(g.path), format="gguf"))  # an Ollama blob has no .gguf suffix
    except (RuntimeError, ValueError) as e:
        raise ModelLoadError(f"{g.path}: could not read the GGUF tensors: {e}") from None
    unpermute = g.architecture == "llama"
    weights: dict[str, mx.array] = {}
    renamed: dict[str, str] = {}  # HF name -> GGUF name
    freq_factors = raw.pop("rope_freqs.weight", None)
    for name, value in raw.items():
        if match := _BLK.match(name):
            layer, part, leaf = match.groups()
            if part not in _LAYER_NAMES:
                raise ModelLoadError(f"{g.path}: unexpected GGUF tensor {name!r}")
            if unpermute and part in ("attn_q", "attn_k"):
                n = config["num_attention_heads"] if part == "attn_q" else config["num_key_value_heads"]
                value = _unpermute_rows(value, n)
            weights[key := f"model.layers.{layer}.{_LAYER_NAMES[part]}.{leaf}"] = value
            renamed[key] = name
        elif (match := _TOP.match(name)) and match.group(1) in _TOP_NAMES:
            weights[key := f"{_TOP_NAMES[match.group(1)]}.{match.group(2)}"] = value
            renamed[key] = name
        else:
            raise ModelLoadError(f"{g.path}: unexpected GGUF tensor {name!r}")
    if freq_factors is not None:
        config["_rope_freq_factors"] = freq_factors

    quantization: dict[str, Any] = {"group_size": GGUF_GROUP_SIZE, "bits": 4, "mode": "affine"}
    hf_name = {value_name: key for key, value_name in renamed.items()}
    for gname, ggml_type in kquants.items():
        quantization[hf_name[gname].removesuffix(".weight")] = {"kquant": ggml_type}
    for key, scales in weights.items():
        if key.endswith(".scales"):
            path = key[: -len(".scales")]
            packed = weights[f"{path}.weight"].shape[-1]  # uint32 words per row
            in_features = scales.shape[-1] * GGUF_GROUP_SIZE
            quantization[path] = {"group_size": GGUF_GROUP_SIZE, "bits": packed * 32 // in_features}
    return weights, (quantization if len(quantization) > 3 else None)


class FreqFactorRoPE(nn.Module):
    """RoPE with llama.cpp's per-frequency divisors (`rope_freqs.weight`, written for llama3 scaling)."""

    def __init__(self, dims: int, base: float, factors: mx.array):
        super().__init__()
        self.dims = dims
        self._freqs = (base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)) * factors.astype(mx.float32)

    def __call__(self, x: mx.array, offset: int = 0) -> mx.array:
        return mx.fast.rope(x, self.dims, traditional=False, base=None, scale=1.0, offset=offset, freqs=self._freqs)


def apply_freq_factors(model: nn.Module, config: dict[str, Any]) -> None:
    factors = config.pop("_rope_freq_factors", None)
    if factors is None:
        return
    for layer in model.layers:
        attn = layer.self_attn
        attn.rope = FreqFactorRoPE(attn.head_dim, config["rope_theta"], factors)


def describe_quantization(g: GGUFFile) -> str:
    counts: dict[str, int] = {}
    for t in g.tensors:
        if len(t.shape) == 2:
            counts[t.ggml_type] = counts.get(t.ggml_type, 0) + t.nbytes
    return max(counts, key=counts.__getitem__) if counts else "F32"

