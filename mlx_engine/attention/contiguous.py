"""Attention over one sequence's contiguous K/V buffer (`kv.contiguous.ContiguousLayer`, or no cache at all): the
table's contiguous paths. q (B, Hq, L, D) at positions offset..offset + L - 1 over keys/values (B, Hkv, S, D),
S = offset + L, causal."""

from __future__ import annotations

import mlx.core as mx

from mlx_engine.attention.host import sdpa


def contiguous_sdpa(q: mx.array, keys: mx.array, values: mx.array, scale: float, offset: int,
                    window: int | None) -> mx.array:
    """Every earlier key: `sdpa` (causal for a chunk, none for one token)."""
    return sdpa(q, keys, values, scale, causal=q.shape[2] > 1)


def contiguous_window(q: mx.array, keys: mx.array, values: mx.array, scale: float, offset: int,
                      window: int | None) -> mx.array:
    """Queries reaching past the sliding window: each sees its last `window` keys (mlx-lm's mask)."""
    from mlx_lm.models.base import create_causal_mask  # models/ registered mlx-lm without its __init__

    mask = create_causal_mask(q.shape[2], offset, window_size=window)
    return mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask)
