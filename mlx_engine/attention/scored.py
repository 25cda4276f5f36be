"""Attention whose scores change before the softmax: Gemma 2's soft cap (scores -> tanh(scores / cap) * cap, before
the mask) and gpt-oss's sinks (one logit per query head that joins each softmax's denominator and weighs no
value). The table's rows for every phase: the sequence's K/V read out of the storage (dequantized, as
`kv.paged.PagedKVStorage.gather` returns them; runs of a head-major pool in place, a batch's blocks gathered),
then unfused MLX ops in float32. Neither MLX's fused attention nor our Metal kernel takes a soft cap, so these
rows hold the (Hq, L, S) float32 scores and make several passes over them where the fused paths make one.

Signatures are their phases' (`mlx_engine.attention`) plus `softcap` (float or None) and `sinks` ((Hq,) or None).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx


def softmax_scores(q: mx.array, k: mx.array, v: mx.array, scale: float, visible: mx.array,
                   softcap: float | None, sinks: mx.array | None) -> mx.array:
    """q (B, Hq, L, D) over k/v (B, Hkv, S, D), `visible` broadcastable to (B, 1, 1, L, S) -> (B, Hq, L, D), float32
    math, grouped-query (K and V never repeated)."""
    B, Hq, L, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    G = Hq // Hkv
    qg = q.astype(mx.float32).reshape(B, Hkv, G * L, D)  # a KV head's queries as rows: one plain matmul
    scores = (qg @ k.astype(mx.float32).swapaxes(-1, -2)).reshape(B, Hkv, G, L, S) * scale
    if softcap is not None:
        scores = mx.tanh(scores / softcap) * softcap
    scores = mx.where(visible, scores, -mx.inf)
    if sinks is None:
        p = mx.softmax(scores, axis=-1)
    else:  # the sink joins the max and the denominator
        sink = sinks.astype(mx.float32).reshape(1, Hkv, G, 1, 1)
        top = mx.maximum(scores.max(axis=-1, keepdims=True), sink)
        e = mx.exp(scores - top)
        p = e / (e.sum(axis=-1, keepdims=True) + mx.exp(sink - top))
    out = p.reshape(B, Hkv, G * L, S) @ v.astype(mx.float32)  # (B, Hkv, G * L, D)
    return out.reshape(B, Hq, L, D).astype(q.dtype)


def decode_scored_slots(step: Any, layer: int, q: mx.array, scale: float, softcap: float | None = None,
                        sinks: mx.array | None = None) -> mx.array:
    """One sequence: its slots (`step.all_slots`, the window's exactly), runs of a head-major pool read in place."""
    k, v = _joined(*step.storage.gather_runs(layer, step.all_slots, q.dtype))
    return softmax_scores(q, k, v, scale, mx.array(True), softcap, sinks)


def _joined(keys: list[mx.array], values: list[mx.array]) -> tuple[mx.array, mx.array]:
    """`gather_runs`' segments as one (1, Hkv, S, D) K and V (a single run as it is)."""
    return tuple(x[0] if len(x) == 1 else mx.concatenate(x, axis=2) for x in (keys, values))


def decode_scored(step: Any, layer: int, q: mx.array, scale: float, softcap: float | None = None,
                  sinks: mx.array | None = None) -> mx.array:
    """B sequences, one token each: every block of their tables gathered, masked by length (and window)."""
    st = step.storage
    B, _, _, D = q.shape
    Hkv, bs = st.num_kv_heads, st.block_size
    T = step.block_tables.shape[1] * bs
    slots = (step.block_tables[:, :, None] * bs + mx.arange(bs)[None, None, :]).reshape(-1)  # (B * T,)
    k, v = st.gather(layer, slots, whole_blocks=True)  # (Hkv, B * T, D)
    k, v = (x.reshape(Hkv, B, T, D).swapaxes(0, 1) for x in (k, v))  # (B, Hkv, T, D)
    cols, lens = mx.arange(T)[None, :], step.seq_lens[:, None]
    valid = cols < lens
    if st.window is not None:
        valid = valid & (cols >= lens - st.window)
    return softmax_scores(q, k, v, scale, valid[:, None, None, None, :], softcap, sinks)


def _causal(length: int, s: int, window: int | None) -> mx.array:
    """(length, s): query i, at column s - length + i, sees the columns up to it (within `window` of it)."""
    at = (mx.arange(length) + (s - length))[:, None]
    cols = mx.arange(s)[None, :]
    visible = cols <= at
    return visible if window is None else visible & (cols > at - window)


def prefill_scored(view: Any, q: mx.array, scale: float, softcap: float | None = None,
                   sinks: mx.array | None = None) -> mx.array:
    """A causal chunk over the sequence's slots so far (from `view.base`), read as stored (per-channel keys too:
    whole blocks as quantized, not `prefill_channel`'s own-block grids)."""
    k, v = _joined(*view.storage.gather_runs(view.layer, view.all_slots, q.dtype))
    return softmax_scores(q, k, v, scale, _causal(q.shape[2], k.shape[2], view.storage.window), softcap, sinks)


def contiguous_scored(q: mx.array, keys: mx.array, values: mx.array, scale: float, offset: int,
                      window: int | None, softcap: float | None = None, sinks: mx.array | None = None) -> mx.array:
    """One sequence's own buffer, causal (the last `window` keys of each query)."""
    return softmax_scores(q, keys, values, scale, _causal(q.shape[2], keys.shape[2], window), softcap, sinks)
