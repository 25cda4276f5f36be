"""GGUF architectures as llama.cpp writes them: metadata -> config.json fields (`gguf_config`, no MLX), and GGUF
tensor names -> the names the model class loads, through gguf-py's own tables (`gguf.TensorNameMap`,
`gguf.constants.Keys`).

llama.cpp's converter changes some values on the way; `restore` undoes them:
- "normal" RoPE architectures (llama, granite: rotation of consecutive pairs) get their Q/K rows permuted from
  transformers' half-split layout (`LlamaModel.permute`);
- Gemma's RMSNorm scales by (1 + w); the converter stores 1 + w for every `*norm.weight`.
Where llama.cpp keeps a setting in code rather than in the file (Gemma's sliding pattern and local rope base,
the 27B Gemmas' attention scale), its own rule applies unless the file carries the key.
"""

from __future__ import annotations

import re
from typing import Any

from mlx_engine._mlx_lm import bare_package
from mlx_engine.api import ModelLoadError
from mlx_engine.loading.gguf_file import GGUFFile

bare_package("gguf")  # its tables without its __init__'s writer and sentencepiece (mlx_engine._mlx_lm)
from gguf.constants import MODEL_ARCH_NAMES, MODEL_TENSOR, TENSOR_NAMES, Keys  # noqa: E402
from gguf.tensor_mapping import TensorNameMap  # noqa: E402

# GGUF general.architecture -> the model_type that runs it (llama with experts: mixtral, `model_type_of`)
ARCHITECTURES = {
    "llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3",
    "gemma2": "gemma2", "gemma3": "gemma3_text", "olmo2": "olmo2", "granite": "granite", "qwen3moe": "qwen3_moe",
    "starcoder2": "starcoder2", "gpt-oss": "gpt_oss",
}
PERMUTED_QK = ("llama", "granite")
NORM_SHIFTED = ("gemma2", "gemma3")
# llama.cpp's Gemma rules (llama-model.cpp): sliding layers by a period, the 27B models' attention scale
_GEMMA_PERIOD = {"gemma2": 2, "gemma3": 6}
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
# mlx-lm stacks a layer's experts in SwitchGLU `switch_mlp` (gpt-oss's: `experts`)
_EXPERT = re.compile(r"^model\.layers\.(\d+)\..*\.(?:switch_mlp|experts)\.(gate|up|down)_proj\.(weight|bias|scales|biases)$")
_EXPERT_TENSOR = {"gate": MODEL_TENSOR.FFN_GATE_EXP, "up": MODEL_TENSOR.FFN_UP_EXP, "down": MODEL_TENSOR.FFN_DOWN_EXP}


class Meta:
    """`{arch}.<key>` lookups in a GGUF file's metadata, numpy scalars as Python values."""

    def __init__(self, metadata: dict[str, Any], arch: str, path: Any):
        self.m, self.arch, self.path = metadata, arch, path

    def key(self, template: str) -> str:
        return template.format(arch=self.arch)

    def get(self, template: str, default: Any = None) -> Any:
        v = self.m.get(self.key(template), default)
        return v.item() if hasattr(v, "item") and getattr(v, "size", 1) == 1 else v

    def need(self, template: str) -> Any:
        if self.key(template) not in self.m:
            raise ModelLoadError(f"{self.path}: GGUF metadata is missing {self.key(template)!r}")
        return self.get(template)


def gguf_config(g: GGUFFile) -> dict[str, Any]:
    """An HF-style config.json dict from GGUF metadata."""
    arch = g.architecture
    meta = Meta(g.metadata, arch, g.path)
    model_type = model_type_of(arch, meta, g.path)
    n_heads = int(meta.need(Keys.Attention.HEAD_COUNT))
    hidden = int(meta.need(Keys.LLM.EMBEDDING_LENGTH))
    embd = next((t for t in g.tensors if t.name == "token_embd.weight"), None)
    if embd is None:
        raise ModelLoadError(f"{g.path}: GGUF file has no token_embd.weight tensor")
    names = {t.name for t in g.tensors}
    config: dict[str, Any] = {
        "model_type": model_type,
        "hidden_size": hidden,
        "num_hidden_layers": int(meta.need(Keys.LLM.BLOCK_COUNT)),
        "intermediate_size": int(meta.get(Keys.LLM.FEED_FORWARD_LENGTH) or meta.need(
            Keys.LLM.EXPERT_FEED_FORWARD_LENGTH)),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(meta.get(Keys.Attention.HEAD_COUNT_KV, n_heads)),
        "head_dim": int(meta.get(Keys.Attention.KEY_LENGTH, hidden // n_heads)),
        "rms_norm_eps": float(meta.get(Keys.Attention.LAYERNORM_RMS_EPS, 1e-5)),
        "rope_theta": float(meta.get(Keys.Rope.FREQ_BASE, 10000.0)),
        "max_position_embeddings": int(meta.get(Keys.LLM.CONTEXT_LENGTH, 4096)),
        "vocab_size": int(embd.shape[0]),
        "tie_word_embeddings": "output.weight" not in names,
    }
    scaling_type = meta.get(Keys.Rope.SCALING_TYPE, "none")
    if scaling_type == "linear":
        config["rope_scaling"] = {"rope_type": "linear", "factor": float(meta.need(Keys.Rope.SCALING_FACTOR))}
    elif scaling_type == "yarn":
        config["rope_scaling"] = {
            "rope_type": "yarn",
            "factor": float(meta.need(Keys.Rope.SCALING_FACTOR)),
            "original_max_position_embeddings": int(meta.need(Keys.Rope.SCALING_ORIG_CTX_LEN)),
            "beta_fast": float(meta.get(Keys.Rope.SCALING_YARN_BETA_FAST, 32.0)),
            "beta_slow": float(meta.get(Keys.Rope.SCALING_YARN_BETA_SLOW, 1.0)),
        }
    elif scaling_type not in ("none", None):
        raise ModelLoadError(f"{g.path}: unsupported GGUF rope scaling {scaling_type!r} (supported: linear, yarn)")
    window = meta.get(Keys.Attention.SLIDING_WINDOW, 0)
    if window:
        config["sliding_window"] = int(window)
    family_config(arch, meta, config)
    return config


def model_type_of(arch: str, meta: Meta, path: Any) -> str:
    if arch not in ARCHITECTURES:
        raise ModelLoadError(f"{path}: unsupported GGUF architecture {arch!r} (supported: {', '.join(ARCHITECTURES)})")
    if arch == "llama" and int(meta.get(Keys.LLM.EXPERT_COUNT, 0) or 0) > 0:
        return "mixtral"  # llama.cpp writes Mixtral as llama with experts
    return ARCHITECTURES[arch]


def family_config(arch: str, meta: Meta, config: dict[str, Any]) -> None:
    """The fields beyond the common ones (`gguf_config`) that `arch`'s model class reads."""
    n_layers, hidden, heads = config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"]
    experts = meta.get(Keys.LLM.EXPERT_COUNT)
    if experts:
        config.update(num_experts=int(experts), num_local_experts=int(experts),
                      num_experts_per_tok=int(meta.need(Keys.LLM.EXPERT_USED_COUNT)))
        ff = meta.get(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH)
        if ff:
            config["moe_intermediate_size"] = int(ff)
    if arch in _GEMMA_PERIOD:
        scale = meta.get(Keys.Attention.SCALE)
        if scale:
            config["query_pre_attn_scalar"] = float(scale) ** -2
        else:  # llama.cpp: 1 / sqrt(head_dim), but 1 / sqrt(hidden / heads) on the 27B models
            big = n_layers == _GEMMA_27B_LAYERS[arch]
            config["query_pre_attn_scalar"] = hidden // heads if big else config["head_dim"]
        config["hidden_activation"] = "gelu_pytorch_tanh"
        for k in (Keys.LLM.ATTN_LOGIT_SOFTCAPPING, Keys.LLM.FINAL_LOGIT_SOFTCAPPING):
            config[k.removeprefix("{arch}.")] = meta.get(k)
        if config.get("sliding_window"):  # llama.cpp's converter leaves the window out when nothing slides
            config["layer_types"] = _gemma_layer_types(arch, meta, n_layers)
        if arch == "gemma3":
            config["rope_local_base_freq"] = float(meta.get(Keys.Rope.FREQ_BASE_SWA, 10000.0))
    elif arch == "phi3":
        rope_dims = meta.get(Keys.Rope.DIMENSION_COUNT)
        if rope_dims:
            config["partial_rotary_factor"] = int(rope_dims) / (hidden // heads)
        original = meta.get(Keys.Rope.SCALING_ORIG_CTX_LEN)
        if original:
            config["original_max_position_embeddings"] = int(original)
    elif arch == "starcoder2":
        config.update(norm_epsilon=float(meta.get(Keys.Attention.LAYERNORM_EPS, 1e-5)), use_bias=True,
                      hidden_act="gelu_pytorch_tanh")
    elif arch == "granite":
        config.update(attention_multiplier=float(meta.need(Keys.Attention.SCALE)),
                      embedding_multiplier=float(meta.need(Keys.LLM.EMBEDDING_SCALE)),
                      residual_multiplier=float(meta.need(Keys.LLM.RESIDUAL_SCALE)),
                      logits_scaling=float(meta.need(Keys.LLM.LOGIT_SCALE)), attention_bias=False, mlp_bias=False)
    elif arch == "qwen3moe":
        norm = meta.get(Keys.LLM.EXPERT_WEIGHTS_NORM)
        config.update(decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True if norm is None else bool(norm))
    elif arch == "gpt-oss":
        # llama.cpp: layer i slides iff i is even; experts' width is the feed-forward length
        if config.get("sliding_window"):
            config["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)]
        config["intermediate_size"] = int(meta.get(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH, config["intermediate_size"]))
        if isinstance(config.get("rope_scaling"), dict):  # transformers' gpt-oss YaRN keeps the ramp's ends
            config["rope_scaling"]["truncate"] = False


def _gemma_layer_types(arch: str, meta: Meta, n_layers: int) -> list[str]:
    pattern = meta.get(Keys.Attention.SLIDING_WINDOW_PATTERN)
    if pattern is None:
        pattern = _GEMMA_PERIOD[arch]
    if type(pattern) is int:  # llama.cpp's set_swa_pattern(n): layer i slides iff i % n < n - 1
        sliding = [i % pattern < pattern - 1 for i in range(n_layers)]
    else:  # one flag per layer (a one-layer file's array reads as a scalar)
        sliding = [bool(x) for x in (list(pattern) if hasattr(pattern, "__len__") else [pattern])[:n_layers]]
    return ["sliding_attention" if s else "full_attention" for s in sliding]


def tensor_names(arch: str, n_layers: int, parameters: list[str]) -> dict[str, str]:
    """{GGUF tensor name: the model's parameter name} for every parameter gguf-py's tables name."""
    tmap = TensorNameMap(next(a for a, name in MODEL_ARCH_NAMES.items() if name == arch), n_layers)
    out: dict[str, str] = {}
    for p in parameters:
        if m := _EXPERT.match(p):
            bid, which, leaf = m.groups()
            name = f"{TENSOR_NAMES[_EXPERT_TENSOR[which]].format(bid=int(bid))}.{leaf}"
        else:
            name = tmap.get_name(p, try_suffixes=(".weight", ".bias"))
        if name is not None:
            out[name] = p
            if not name.endswith((".weight", ".bias")):  # a bare parameter (attn_sinks): stored as .weight
                out[f"{name}.weight"] = p
    return out
