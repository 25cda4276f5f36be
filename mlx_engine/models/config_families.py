"""What transformers 5 writes for the 2026 families, in the form mlx-lm's classes read (part of `normalize_config`).

- `layer_types` names more than attention now: `linear_attention` (Gated DeltaNet in Qwen3-Next and Qwen3.5, Mamba 2
  in Granite 4 and Nemotron-H), `conv` (LFM2's short convolutions), `moe` and `mlp` (Nemotron-H's blocks). Each
  family's mlx-lm class reads its own form: a period (`full_attention_interval`: Qwen3-Next, Qwen3.5), the older
  names (`mamba`/`attention`: granitemoehybrid), the attention layers' indices (`full_attn_idxs`: LFM2), a letter per
  layer (`sliding_window_pattern` "LG": EXAONE 4). A kind no class runs is refused in one line naming the field.
- Fields mlx-lm's classes require and transformers no longer writes are derived: `head_dim` (hidden / heads, as
  transformers does), LFM2's `block_dim` (the hidden size, which its blocks act on).
- Head sizes per layer (`per_layer_config`, Gemma 4: the full-attention layers' larger heads) become the
  `global_head_dim` / `num_global_key_value_heads` mlx-lm's gemma4_text reads.
- JSON has no infinity: transformers writes `{"__float__": "Infinity"}` (Mamba's `time_step_limit`), read back
  as the float.
"""

from __future__ import annotations

from typing import Any

from mlx_engine.api import ModelLoadError
from mlx_engine.models.layer_types import FULL, SLIDING

LINEAR, CONV, MAMBA, ATTENTION = "linear_attention", "conv", "mamba", "attention"
# every kind of layer transformers 5 writes (its configuration_utils.ALLOWED_LAYER_TYPES, 5.25) and the older names
# mlx-lm's classes still read (`mamba`, `attention`, Nemotron-H's `mlp`)
LAYER_KINDS = (FULL, SLIDING, "chunked_attention", "window_attention", "indexed_attention",
               "compressed_sparse_attention", "heavily_compressed_attention", "minimax_m3_sparse",
               "reference_sliding_attention", LINEAR, CONV, "hybrid", "hybrid_sliding", "moe", "sparse", "dense",
               MAMBA, ATTENTION, "mlp")
# layers that hold a recurrent state of fixed size and no K and V per token
STATE_KINDS = (LINEAR, CONV, MAMBA)
# layers that hold neither (Nemotron-H's feed-forward blocks, listed among its layers)
_STATELESS_KINDS = ("moe", "mlp")
# families whose `layer_types` is a repeating period of linear-attention layers ending in a full one
_INTERVAL_FAMILIES = ("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")


def normalize_family(config: dict[str, Any], source: str) -> None:
    """In place, after the rope and multimodal steps of `normalize_config`."""
    for key, value in list(config.items()):
        config[key] = _json_floats(value)
    model_type = config.get("model_type")
    for field in ("layer_types", "layers_block_type"):
        _check_kinds(config.get(field), field, source)
    if "head_dim" not in config and config.get("hidden_size") and config.get("num_attention_heads"):
        config["head_dim"] = int(config["hidden_size"]) // int(config["num_attention_heads"])
    types = config.get("layer_types")
    if not isinstance(types, list):
        types = None
    if model_type in _INTERVAL_FAMILIES and types:
        config["full_attention_interval"] = _interval(types, source)
    elif model_type == "granitemoehybrid" and types:
        config["layer_types"] = [{LINEAR: MAMBA, FULL: ATTENTION}.get(t, t) for t in types]
    elif model_type == "lfm2":
        config.setdefault("block_dim", config.get("hidden_size"))
        if types and not config.get("full_attn_idxs"):
            config["full_attn_idxs"] = [i for i, t in enumerate(types) if t == FULL]
    elif model_type == "exaone4" and types:
        # mlx-lm reads a letter per layer (L: local, sliding with rope; G: global, no rope); no window, all full
        config["sliding_window_pattern"] = "".join("L" if t == SLIDING else "G" for t in types) \
            if config.get("sliding_window") else None
    elif model_type == "gemma4_text":
        _gemma4_heads(config, source)


def _json_floats(value: Any) -> Any:
    if isinstance(value, dict) and set(value) == {"__float__"}:
        try:
            return float(value["__float__"])
        except (TypeError, ValueError):
            return value
    if isinstance(value, list):
        return [_json_floats(v) for v in value]
    return value


def _check_kinds(types: Any, field: str, source: str) -> None:
    if types is None:
        return
    if not isinstance(types, list):
        raise ModelLoadError(f"{source}: {field} is {type(types).__name__}, expected a list of layer kinds")
    for i, t in enumerate(types):
        if t not in LAYER_KINDS:
            raise ModelLoadError(f"{source}: {field}[{i}] is {t!r}, a layer kind no model class here runs "
                                 f"(expected one of {', '.join(LAYER_KINDS)})")


def _interval(types: list[str], source: str) -> int:
    """P such that layer i is full attention iff (i + 1) % P == 0, the only layout mlx-lm's Qwen3-Next runs."""
    for p in range(1, len(types) + 1):
        if all(t in (FULL, LINEAR) and (t == FULL) == ((i + 1) % p == 0) for i, t in enumerate(types)):
            return p
    raise ModelLoadError(f"{source}: layer_types {types} is not a repeating pattern of linear_attention layers "
                         "ending in a full_attention one, which is all this model class runs")


def _gemma4_heads(config: dict[str, Any], source: str) -> None:
    per_layer = config.get("per_layer_config")
    if not isinstance(per_layer, dict) or not per_layer:
        return
    types = config.get("layer_types") or []
    overrides = list(per_layer.items())
    for index, fields in overrides:
        if not str(index).isdigit() or int(index) >= len(types) or types[int(index)] != FULL:
            raise ModelLoadError(f"{source}: per_layer_config[{index!r}] overrides a layer that is not a "
                                 "full_attention layer; only those may have other head sizes here")
    for key, target in (("head_dim", "global_head_dim"), ("num_key_value_heads", "num_global_key_value_heads")):
        values = {fields.get(key) for _, fields in overrides}
        if len(values) > 1:
            raise ModelLoadError(f"{source}: per_layer_config gives full_attention layers {key} {sorted(values)}; "
                                 "expected one value for all of them")
        value = values.pop()
        if value is not None:
            config[target] = value


def no_kv_layers(config: dict[str, Any]) -> int:
    """Layers of a normalized config that keep no K and V (`memory.KVShape.no_kv_layers`)."""
    types = config.get("layers_block_type") or config.get("layer_types") or []
    if config.get("model_type") in _INTERVAL_FAMILIES and not types and config.get("full_attention_interval"):
        p, n = int(config["full_attention_interval"]), int(config.get("num_hidden_layers") or 0)
        return sum((i + 1) % p != 0 for i in range(n))
    return sum(t in STATE_KINDS or t in _STATELESS_KINDS for t in types)


def family_reason(config: dict[str, Any]) -> str | None:
    """In a few words, what sets a normalized config's family apart from the attention-only decoders the paged KV
    cache, the torch backend and `--distributed` run (None: nothing)."""
    types = config.get("layers_block_type") or config.get("layer_types") or []
    recurrent = sorted({t for t in types if t in STATE_KINDS or t.startswith("hybrid")})
    if config.get("model_type") == "falcon_h1":
        recurrent = [MAMBA]  # every layer runs Mamba 2 beside its attention
    if recurrent:
        return f"its {' and '.join(recurrent)} layers keep a recurrent state per sequence, not K and V"
    if config.get("kv_lora_rank"):
        return ("its multi-head latent attention (MLA) keeps one latent per token for all heads, "
                "not K and V per head")
    wide, narrow = config.get("global_head_dim"), config.get("head_dim")
    if wide and narrow and wide != narrow:
        return f"its full-attention layers have heads of {wide} and its sliding ones of {narrow}"
    if config.get("num_experts") or config.get("n_routed_experts") or config.get("num_local_experts"):
        return "its layers route tokens through a mixture of experts"
    return None


def state_sizes(config: dict[str, Any]) -> tuple[int, int]:
    """(elements at the activation dtype, float32 elements) of the recurrent state one sequence keeps in all the
    layers of a normalized config, as mlx-lm's caches hold it: each layer's convolution window (kernel - 1 inputs)
    and its Mamba 2 or Gated DeltaNet state. (0, 0) for a family without recurrent layers."""
    c, model_type = config, config.get("model_type")
    if model_type == "falcon_h1":  # Mamba 2 beside attention in every layer
        n = int(c.get("num_hidden_layers") or 0)
    elif model_type == "nemotron_h":  # its MLP and MoE blocks hold nothing
        n = sum(t in STATE_KINDS for t in c.get("layers_block_type") or c.get("layer_types") or [])
    else:
        n = no_kv_layers(config)
    if not n:
        return 0, 0
    if model_type in _INTERVAL_FAMILIES:
        key = int(c["linear_num_key_heads"]) * int(c["linear_key_head_dim"])
        value = int(c["linear_num_value_heads"]) * int(c["linear_value_head_dim"])
        conv = (int(c.get("linear_conv_kernel_dim") or 4) - 1) * (2 * key + value)
        return n * conv, n * value * int(c["linear_key_head_dim"])
    if model_type == "lfm2":
        return n * (int(c["conv_L_cache"]) - 1) * int(c["hidden_size"]), 0
    if model_type == "nemotron_h":
        heads, head, state, groups = (int(c["mamba_num_heads"]), int(c["mamba_head_dim"]), int(c["ssm_state_size"]),
                                      int(c["n_groups"]))
        kernel, inner = int(c["conv_kernel"]), heads * head
    elif model_type in ("granitemoehybrid", "falcon_h1"):
        heads, head, state, groups = (int(c["mamba_n_heads"]), int(c["mamba_d_head"]), int(c["mamba_d_state"]),
                                      int(c["mamba_n_groups"]))
        kernel, inner = int(c["mamba_d_conv"]), int(c.get("mamba_d_ssm") or heads * head)
    else:
        return 0, 0  # a recurrent family whose state is not sized here
    return n * ((kernel - 1) * (inner + 2 * groups * state) + heads * head * state), 0
