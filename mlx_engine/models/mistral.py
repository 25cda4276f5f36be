"""Mistral: the Llama block with an optional sliding window."""

from __future__ import annotations

from typing import Any

from mlx_engine.models.llama import Model, ModelArgs, make_args

__all__ = ["Model", "ModelArgs", "args_from_config"]


def args_from_config(config: dict[str, Any]) -> ModelArgs:
    return make_args(config, tie_word_embeddings=bool(config.get("tie_word_embeddings", False)))
