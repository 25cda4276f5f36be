"""Qwen3: the Llama block with RMSNorm over each head of q and k, before rope."""

from __future__ import annotations

from typing import Any

from mlx_engine.models.config import qwen_layer_types
from mlx_engine.models.llama import Model, ModelArgs, make_args

__all__ = ["Model", "ModelArgs", "args_from_config"]


def args_from_config(config: dict[str, Any]) -> ModelArgs:
    window = config.get("sliding_window") if config.get("use_sliding_window") else None
    return make_args(
        config,
        qk_norm=True,
        sliding_window=window,
        layer_types=qwen_layer_types(config, window),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
    )
