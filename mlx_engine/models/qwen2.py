"""Qwen2: the Llama block with biases on q, k and v (not on o)."""

from __future__ import annotations

from typing import Any

from mlx_engine.models.config import qwen_layer_types
from mlx_engine.models.llama import Model, ModelArgs, make_args

__all__ = ["Model", "ModelArgs", "args_from_config"]


def args_from_config(config: dict[str, Any]) -> ModelArgs:
    # HF's Qwen2 ignores sliding_window unless use_sliding_window is set
    window = config.get("sliding_window") if config.get("use_sliding_window") else None
    return make_args(
        config,
        qkv_bias=True,
        attention_bias=False,
        sliding_window=window,
        layer_types=qwen_layer_types(config, window),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
    )
