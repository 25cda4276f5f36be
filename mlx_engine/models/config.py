"""config.json read once, for every family: the conventions of transformers 4 and 5 and of multimodal
checkpoints brought to one flat form (`normalize_config`) before any model class, ours or mlx-lm's, sees it.

- transformers 5 writes `rope_parameters = {"rope_type", "rope_theta", <scaling fields>, "partial_rotary_factor"}`
  (or one such dict per layer type: `{"full_attention": {...}, "sliding_attention": {...}}`, Gemma 3), where older
  files and mlx-lm's classes read top-level `rope_theta`, `rope_scaling`, `partial_rotary_factor` and Gemma 3's
  `rope_local_base_freq`. Both are kept, agreeing.
- `layer_types` (transformers 5) says which layers slide; mlx-lm's gemma3_text reads a period instead
  (`sliding_window_pattern`: layer i is full iff (i + 1) % P == 0), derived here or refused in one line.
- A multimodal checkpoint (Gemma 3 4B and larger, Mistral 3, LLaVA-style) nests its language model's config in
  `text_config`: where a text model class runs that (ours or mlx-lm's) it becomes the config, and `text_weights`
  keeps the language model's weights under their text-only names (the vision tower and projector are not
  loaded); else the nested config is normalized in place for the multimodal class.
- Renamed fields: transformers 5 writes `num_local_experts` where mlx-lm's qwen3_moe reads `num_experts`.
"""

from __future__ import annotations

import inspect
from typing import Any

from mlx_engine.api import ModelLoadError
from mlx_engine.models.config_families import normalize_family
from mlx_engine.models.layer_types import FULL, SLIDING, sliding_layers

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")
NATIVE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")  # families written here (mlx_engine/models/<type>.py)
# rope types only mlx-lm's classes run (rope_utils.initialize_rope); "proportional": Gemma 4's partial rotary,
# frequencies spaced over the whole head
_MLX_LM_ROPE_TYPES = ("su", "deepseek_yarn", "proportional")
# top-level fields of a multimodal config that its text model inherits when its text_config lacks them
_INHERITED = ("tie_word_embeddings", "eos_token_id", "bos_token_id", "pad_token_id", "torch_dtype", "dtype",
              "quantization", "quantization_config")
# where a multimodal checkpoint keeps its language model: transformers 4 (`language_model.model.*`,
# `language_model.lm_head.*`) and 5 (`model.language_model.*`, top-level `lm_head.*`)
_TEXT_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                  ("language_model.lm_head.", "lm_head."), ("language_model.", ""))


def normalize_config(config: dict[str, Any], source: str = "config.json") -> dict[str, Any]:
    """The flat config every model class reads (a new dict; idempotent). Raises ModelLoadError, one line naming
    the field, for a config no class could run."""
    config = dict(config)
    text = config.get("text_config")
    if isinstance(text, dict) and "num_hidden_layers" not in config:
        if _runnable(text.get("model_type")):
            config = _lift_text_config(config, text)
        else:  # only the multimodal class runs it (mlx-lm's qwen2_vl, ...): normalized where it is
            config["text_config"] = normalize_config(text, source)
    _lift_rope(config, source)
    _read_layer_types(config, source)
    normalize_family(config, source)
    for a, b in (("num_experts", "num_local_experts"), ("num_local_experts", "num_experts")):
        if a not in config and config.get(b) is not None:
            config[a] = config[b]
    return config


def _runnable(model_type: str | None) -> bool:
    from mlx_engine.models.mlx_lm_classes import mlx_lm_has

    return bool(model_type) and (model_type in NATIVE_MODEL_TYPES or mlx_lm_has(model_type))


def _lift_text_config(config: dict[str, Any], text: dict[str, Any]) -> dict[str, Any]:
    out = {k: config[k] for k in _INHERITED if k in config}
    out.update(text)
    out["multimodal_model_type"] = config.get("model_type")  # what the checkpoint is; model_type: what runs
    if isinstance(config.get("quantization"), dict):  # mlx-lm's per-layer entries name the multimodal paths
        out["quantization"] = {_text_name(k): v for k, v in config["quantization"].items()}
    if "vocab_size" not in out and "vocab_size" in config:
        out["vocab_size"] = config["vocab_size"]
    return out


def _text_name(name: str) -> str:
    for prefix, repl in _TEXT_PREFIXES:
        if name.startswith(prefix):
            return repl + name[len(prefix):]
    return name


def text_weights(weights: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """A multimodal checkpoint's language-model weights under text-only names (`model.*`, `lm_head.*`); the
    vision tower, projector and other towers are dropped. Other checkpoints' weights as they are."""
    if not config.get("multimodal_model_type"):
        return weights
    prefixed = any(k.startswith(p) for k in weights for p, _ in _TEXT_PREFIXES)
    out = {}
    for k, v in weights.items():
        if prefixed:
            name = _text_name(k)
            if name == k and not k.startswith("lm_head."):
                continue  # not the language model's
        else:
            name = k
            if not k.startswith(("model.", "lm_head.")) or k.startswith(("model.vision", "model.multi_modal")):
                continue
        out[name] = v
    return out


def _scaling_of(params: dict[str, Any], source: str) -> dict[str, Any] | None:
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type not in SUPPORTED_ROPE_TYPES and rope_type not in _MLX_LM_ROPE_TYPES:
        raise ModelLoadError(f"{source}: unsupported rope type {rope_type!r} in rope_parameters "
                             f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "partial_rotary_factor")}
    return {**scaling, "rope_type": rope_type, "type": rope_type}


def _lift_rope(config: dict[str, Any], source: str) -> None:
    params = config.get("rope_parameters")
    if not isinstance(params, dict) or not params:
        scaling = config.get("rope_scaling")
        if isinstance(scaling, dict) and scaling:  # older files: either key names the type
            rope_type = scaling.get("rope_type", scaling.get("type", "default"))
            config["rope_scaling"] = {**scaling, "rope_type": rope_type, "type": rope_type}
        return
    if all(isinstance(v, dict) for v in params.values()):  # one dict per layer type (Gemma 3)
        full = params.get(FULL) or next(iter(params.values()))
        sliding = params.get(SLIDING)
        if sliding is not None:
            if "rope_theta" in sliding:
                config["rope_local_base_freq"] = float(sliding["rope_theta"])
            if _scaling_of(sliding, source) is not None:
                raise ModelLoadError(f"{source}: rope_parameters.sliding_attention has rope scaling "
                                     f"{sliding.get('rope_type')!r}; only the full-attention layers' rope may scale")
        params = full
    if "rope_theta" in params:
        config["rope_theta"] = float(params["rope_theta"])
    if "partial_rotary_factor" in params:
        config["partial_rotary_factor"] = float(params["partial_rotary_factor"])
    config["rope_scaling"] = _scaling_of(params, source)


def _read_layer_types(config: dict[str, Any], source: str) -> None:
    types = config.get("layer_types")
    if not isinstance(types, list):
        return
    n = config.get("num_hidden_layers")
    if isinstance(n, int):
        if len(types) < n:
            raise ModelLoadError(f"{source}: layer_types has {len(types)} entries for num_hidden_layers={n}")
        types = config["layer_types"] = types[:n]
    if SLIDING in types and not config.get("sliding_window"):
        raise ModelLoadError(f"{source}: layer_types has sliding_attention layers but sliding_window is "
                             f"{config.get('sliding_window')!r} (expected the window in tokens)")
    if config.get("model_type") == "gemma3_text":
        config["sliding_window_pattern"] = _period(types, source)


def _period(types: list[str], source: str) -> int:
    """P such that layer i is full attention iff (i + 1) % P == 0 (mlx-lm's gemma3_text), else ModelLoadError."""
    n = len(types)
    for p in range(1, n + 1):
        if all((t == FULL) == ((i + 1) % p == 0) for i, t in enumerate(types)):
            return p
    raise ModelLoadError(f"{source}: layer_types {types} is not a repeating pattern of sliding layers ending in a "
                         "full-attention one, which is all gemma3_text runs")


# how a family without `layer_types` slides when it has a window (transformers' own defaults)
_SLIDING_DEFAULT = {"gemma2": "alternate", "gpt_oss": "alternate", "qwen2": "none", "qwen3": "none",
                    "qwen2_moe": "none", "qwen3_moe": "none"}


def qwen_layer_types(config: dict[str, Any], window: int | None) -> list[str] | None:
    """Qwen2's and Qwen3's sliding layers as transformers reads them: `layer_types` where given, else with
    use_sliding_window the layers from `max_window_layers` on (transformers' default 28), the first ones full."""
    if window is None or config.get("layer_types"):
        return config.get("layer_types")
    first = config.get("max_window_layers")
    first = 28 if first is None else int(first)
    return [SLIDING if i >= first else FULL for i in range(int(config["num_hidden_layers"]))]


def sliding_flags(config: dict[str, Any]) -> list[bool]:
    """Per layer of a normalized config: whether it attends through `sliding_window` (what its KV needs)."""
    n, window = int(config.get("num_hidden_layers") or 0), config.get("sliding_window")
    if config.get("model_type") == "gemma3_text" and window and not config.get("layer_types"):
        p = int(config.get("sliding_window_pattern") or 6)
        return [(i + 1) % p != 0 for i in range(n)]
    default = _SLIDING_DEFAULT.get(config.get("model_type"), "all")
    if default == "none" and config.get("use_sliding_window"):
        if config.get("model_type") in ("qwen2", "qwen3") and window:  # as the engine runs them (models.qwen2)
            return sliding_layers(qwen_layer_types(config, window), n, window)
        default = "all"
    return sliding_layers(config.get("layer_types"), n, window, default)


def check_fields(args_class: type, config: dict[str, Any], source: str, who: str) -> None:
    """One line naming the fields that `args_class` (a ModelArgs dataclass) requires and `config` lacks."""
    missing = [name for name, p in inspect.signature(args_class).parameters.items()
               if p.default is inspect.Parameter.empty and p.kind is not p.VAR_KEYWORD and name not in config]
    if missing:
        names = ", ".join(repr(m) for m in missing)
        raise ModelLoadError(f"{source}: config.json has no {names}, which {who} needs")


def rope_settings(config: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from either convention (`normalize_config` makes them agree)."""
    config = dict(config)
    _lift_rope(config, "config.json")
    theta = config.get("rope_theta", 10000.0)
    scaling = config.get("rope_scaling") or None
    if scaling is not None:
        rope_type = scaling["rope_type"]
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ModelLoadError(
                f"config.json: unsupported rope type {rope_type!r} (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
            )
        if rope_type == "default":
            scaling = None
    return float(theta), scaling
