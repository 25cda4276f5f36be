"""Model families, one file per HF `model_type`, and the builder that turns (config, weights) into a model."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlx_engine._mlx_lm import bare_package
from mlx_engine.api import ModelLoadError
from mlx_engine.models.config import NATIVE_MODEL_TYPES, check_fields, normalize_config
from mlx_engine.models.config_families import family_reason
from mlx_engine.models.mlx_lm_classes import fallback_classes

bare_package()  # before any model module imports mlx-lm's: without its __init__ (mlx_engine._mlx_lm)


@dataclass
class BuiltModel:
    model: nn.Module
    native: bool  # a family written here (models.llama); False: mlx-lm's class, adapted or not
    model_type: str
    context_length: int
    views: bool = True  # takes the engine's per-layer views (`model(inputs, views)` -> hidden, `logits`): ours
    # and mlx-lm's classes through models.adapter; False: mlx-lm's class on its own caches (returns logits)
    kv_note: str | None = None  # views False: why mlx-lm's caches stay (one line for the user)
    routing: Any = None  # mixture of experts through models.adapter: its MoERouting (experts routed per step)
    packs: bool = True  # views: forwards of packed parts (`kv.views.PackedView`) rope each part at its positions
    # views: per cache leaf of an adapted hybrid, a state leaf's `kv.state.StateSpec` (None: attention); () if none
    state_leaves: tuple[Any, ...] = ()


def instantiate(config: dict[str, Any], source: str) -> tuple[nn.Module, bool, str, int]:
    """The model class for `config["model_type"]`, built (parameters lazy: none computed until loaded):
    (model, native, model_type, context length). ModelLoadError, one line, for a config no class runs."""
    config = normalize_config(config, source)  # a no-op on what load_checkpoint read; GGUF and direct callers
    model_type = config.get("model_type")
    if not model_type:
        raise ModelLoadError(f"{source}: config.json has no 'model_type'")
    if model_type in NATIVE_MODEL_TYPES:
        family = importlib.import_module(f"mlx_engine.models.{model_type}")
        check_fields(family.ModelArgs, {**config, "model_type": model_type}, source, f"the {model_type!r} model")
        args = family.args_from_config(config)
        return family.Model(args), True, model_type, args.max_position_embeddings
    classes = fallback_classes(model_type)
    if classes is None:
        raise ModelLoadError(
            f"{source}: unsupported architecture {model_type!r}. Supported natively: "
            f"{', '.join(NATIVE_MODEL_TYPES)}; other types load when mlx-lm has a model class for them."
        )
    model_class, args_class = classes
    check_fields(args_class, config, source, f"mlx-lm's {model_type!r} model")
    try:
        model = model_class(args_class.from_dict(config))
    except Exception as e:  # noqa: BLE001 - mlx-lm raises anything on a config it cannot read
        raise ModelLoadError(f"{source}: mlx-lm's {model_type!r} model rejected config.json: "
                             f"{type(e).__name__}: {e}".splitlines()[0]) from None
    return model, False, model_type, int(config.get("max_position_embeddings") or config.get("max_seq_len") or 4096)


def parameter_names(config: dict[str, Any], source: str) -> list[str]:
    """The names `config`'s model class loads its weights under (after its own sanitize)."""
    model, *_ = instantiate(config, source)
    return [k for k, _ in nn.utils.tree_flatten(model.parameters())]


def build_model(
    config: dict[str, Any],
    weights: dict[str, mx.array],
    dtype: mx.Dtype,
    quantization: dict[str, Any] | None,
    source: str,
) -> BuiltModel:
    """Instantiates the model for `config["model_type"]`, quantizes the layers that arrive quantized,
    loads `weights` strictly and casts float parameters to `dtype`.

    `quantization`: {"group_size", "bits", "mode", <layer path>: {...} | False}; None when unquantized.
    """
    model, native, model_type, context = instantiate(config, source)
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)
    if quantization is not None:
        from mlx_engine.models.kquant import use_kquant_layers

        try:
            use_kquant_layers(model, quantization, dtype)  # GGUF k-quants kept as blocks (on Metal)
        except (TypeError, AttributeError, IndexError) as e:
            raise ModelLoadError(f"{source}: k-quant blocks for a layer this model cannot hold them in: {e}") from None
        _quantize(model, weights, quantization, source)
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        detail = " ".join(str(e).split())  # mlx lists the names one per line
        raise ModelLoadError(f"{source}: weights do not match the {model_type!r} architecture: {detail}") from None
    _cast_floats(model, dtype)
    model.eval()
    why, note, states = None, None, ()
    if not native:
        from mlx_engine.models.adapter import adapt

        model, why = adapt(model)
        if why:  # the family's own reason, in its words, over the probe's
            why = family_reason(normalize_config(config, source)) or why
        else:
            states = model.state_leaves
            if states:  # paged, with its state in the slot pool; what sets it apart still, for --distributed
                note = family_reason(normalize_config(config, source))
    return BuiltModel(model=model, native=native, model_type=model_type, context_length=context, views=why is None,
                      kv_note=why or note, routing=model.routing if why is None and not native else None,
                      packs=native or (why is None and model.packs), state_leaves=states)


def _quantize(model: nn.Module, weights: dict[str, mx.array], quantization: dict[str, Any], source: str) -> None:
    default_gs = quantization.get("group_size", 64)
    default_bits = quantization.get("bits", 4)
    mode = quantization.get("mode", "affine")

    def predicate(path: str, module: nn.Module) -> bool | dict[str, Any]:
        if f"{path}.scales" not in weights:
            return False
        if not hasattr(module, "to_quantized"):
            raise ModelLoadError(f"{source}: {path} arrives quantized but a {type(module).__name__} cannot be")
        override = quantization.get(path)
        if override is False:
            return False
        if isinstance(override, dict):
            return {"group_size": override.get("group_size", default_gs), "bits": override.get("bits", default_bits),
                    "mode": override.get("mode", mode)}
        return {"group_size": default_gs, "bits": default_bits, "mode": mode}

    nn.quantize(model, group_size=default_gs, bits=default_bits, mode=mode, class_predicate=predicate)


def _cast_floats(model: nn.Module, dtype: mx.Dtype) -> None:
    """Float parameters (norms, biases, unquantized weights, quantization scales/biases) to `dtype`."""
    params = nn.utils.tree_flatten(model.parameters())
    cast = [(k, v.astype(dtype)) for k, v in params if mx.issubdtype(v.dtype, mx.floating) and v.dtype != dtype]
    if cast:
        model.load_weights(cast, strict=False)


def count_parameters(model: nn.Module) -> int:
    """Logical parameter count: packed quantized weights counted as their unpacked size."""
    bits = {path: m.bits for path, m in model.named_modules() if hasattr(m, "bits") and hasattr(m, "scales")}
    kquant = {path: m for path, m in model.named_modules() if hasattr(m, "ggml_type")}  # models.kquant
    total = 0
    for key, value in nn.utils.tree_flatten(model.parameters()):
        path, _, leaf = key.rpartition(".")
        if path in kquant and leaf == "weight":  # super-block bytes: the matrix's own size
            m = kquant[path]
            total += m.out_features * m.in_features if hasattr(m, "out_features") else m.num_embeddings * m.dims
            continue
        if path in bits:
            if leaf == "weight":
                total += value.size * 32 // bits[path]
            elif leaf == "bias":
                total += value.size
            continue  # scales, biases: quantization metadata
        total += value.size
    return total
