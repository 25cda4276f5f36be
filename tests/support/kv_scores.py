"""Attention scores read back from a KV storage, as the quantized-KV tests compare them."""

from __future__ import annotations

import numpy as np


def stored_scores(st, k: np.ndarray, v: np.ndarray, q: np.ndarray) -> tuple[np.ndarray, object]:
    """Writes k, v (n, Hkv, D) to slots 0..n-1 of layer 0 of `st`, reads them back as stored -> the scores
    of one query per KV head q (Hkv, D) against the stored keys (Hkv, n), and the stored values."""
    import mlx.core as mx

    slots = mx.arange(k.shape[0], dtype=mx.int32)
    st.write(0, slots, mx.array(k), mx.array(v))
    keys, values = st.gather(0, slots)  # (Hkv, n, D)
    queries = np.array(st.queries(0, mx.array(q)[None, :, None]))[0, :, 0]
    return np.einsum("hd,hnd->hn", queries, np.array(keys)), values
