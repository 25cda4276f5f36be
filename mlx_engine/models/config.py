"""config.json conventions shared by the model families."""

from __future__ import annotations

from typing import Any

from mlx_engine.api import ModelLoadError

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


def rope_settings(config: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from either convention.

    Older files put `rope_theta` and `rope_scaling` at the top level; transformers 5 writes
    `rope_parameters = {"rope_type": ..., "rope_theta": ..., <scaling fields>}`. mlx-lm 0.32 reads only
    the former for llama and qwen2, so a transformers-5 llama3 checkpoint would lose its scaling there.
    """
    params = config.get("rope_parameters")
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        # per layer type ({"full_attention": {...}, "sliding_attention": {...}}): the llama family has one
        params = params.get("full_attention") or next(iter(params.values()))
    if isinstance(params, dict) and params:
        theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
        rope_type = params.get("rope_type", params.get("type", "default"))
        scaling = None if rope_type == "default" else {**params, "rope_type": rope_type}
    else:
        theta = config.get("rope_theta", 10000.0)
        scaling = config.get("rope_scaling") or None
    if scaling is not None:
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ModelLoadError(
                f"config.json: unsupported rope type {rope_type!r} (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
            )
        if rope_type == "default":
            scaling = None
        else:
            scaling = {**scaling, "rope_type": rope_type, "type": rope_type}
    return float(theta), scaling
