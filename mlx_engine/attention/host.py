"""Attention on the host for MLX's CPU backend: `sdpa` (numpy's BLAS in float32, MLX's fused kernel elsewhere)."""

from __future__ import annotations

from mlx_engine.models.layers import one_blas_thread, sdpa

__all__ = ["one_blas_thread", "sdpa"]
