"""The slow twins of the attention table's paths: every one computes its path's attention with
`kernels_metal.reference.paged_decode_attention` (gather through block tables, masked softmax in float32).

A causal chunk is that kernel's rows: query i of a chunk at `offset` is one decode row whose sequence ends at
position offset + i (the torch backend replays short verifications the same way). With a sliding window
(`storage.window`) each row reads its last `window` keys. Signatures are their paths' (`softcap` and `sinks`: the
scored rows', `attention.scored`, passed to the reference).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import mlx.core as mx

from kernels_metal import KVPool
from kernels_metal import reference as kernel_reference


def decode_twin(step: Any, layer: int, q: mx.array, scale: float, softcap: float | None = None,
                sinks: mx.array | None = None) -> mx.array:
    B, Hq, _, D = q.shape
    out = kernel_reference.paged_decode_attention(q[:, :, 0, :], step.storage.pool(layer), step.block_tables,
                                                  step.seq_lens, scale, window=step.storage.window,
                                                  softcap=softcap, sinks=sinks)
    return out.reshape(B, Hq, 1, D)


def _rows(q: mx.array, pool: KVPool, table: list[int], offset: int, scale: float,
          window: int | None = None, **scores: Any) -> mx.array:
    """q (1, Hq, L, D) at positions offset.. as L decode rows over one block table -> (1, Hq, L, D)."""
    L = q.shape[2]
    rows = q[0].swapaxes(0, 1)  # (L, Hq, D)
    tables = mx.array([table] * L, dtype=mx.int32)
    lens = mx.arange(offset + 1, offset + L + 1, dtype=mx.int32)
    out = kernel_reference.paged_decode_attention(rows, pool, tables, lens, scale, window=window,
                                                  **scores)  # (L, Hq, D)
    return out.swapaxes(0, 1)[None]


def prefill_twin(view: Any, q: mx.array, scale: float, softcap: float | None = None,
                 sinks: mx.array | None = None) -> mx.array:
    return _rows(q, view.storage.pool(view.layer), view.table, view.offset, scale, view.storage.window,
                 softcap=softcap, sinks=sinks)


def prefill_channel_twin(view: Any, q: mx.array, scale: float) -> mx.array:
    """Query i reads its own block's keys quantized over the block's tokens up to it (from the float staging,
    by `reference.quantize_channels`), every other block as stored."""
    st, plan = view.storage, view.key_plan
    L, bs = q.shape[2], st.block_size
    pool = st.pool(view.layer)
    first, nb = view.offset // bs, plan.valid.shape[0]
    staged = st.key_stage[view.layer][plan.block_stage_rows].reshape(nb, bs, st.num_kv_heads, st.head_dim)
    ids = mx.arange(pool.k.shape[0])[:, None, None, None]
    outs = []
    for i in range(L):
        pos = view.offset + i
        b, t = divmod(pos, bs)
        packed, scales, biases = kernel_reference.quantize_channels(staged[b - first][None], mx.array([t + 1]),
                                                                   st.key_bits)
        own = ids == view.table[b]
        mine = dataclasses.replace(pool, k=mx.where(own, packed, pool.k), k_scales=mx.where(own, scales, pool.k_scales),
                                   k_biases=mx.where(own, biases, pool.k_biases))
        outs.append(_rows(q[:, :, i:i + 1], mine, view.table, pos, scale, st.window))
    return mx.concatenate(outs, axis=2)


def contiguous_twin(q: mx.array, keys: mx.array, values: mx.array, scale: float, offset: int,
                    window: int | None, softcap: float | None = None, sinks: mx.array | None = None) -> mx.array:
    """Each token its own block of a float pool: query i's table lists the positions it sees (the last `window`
    of those up to offset + i)."""
    B, _, L, _ = q.shape
    S = keys.shape[2]
    outs = []
    for b in range(B):
        pool = KVPool(keys[b].swapaxes(0, 1)[:, None], values[b].swapaxes(0, 1)[:, None])  # (S, 1, Hkv, D)
        seen = [list(range(max(0, offset + i + 1 - (window or S)), offset + i + 1)) for i in range(L)]
        width = max(len(s) for s in seen)
        tables = mx.array([s + [0] * (width - len(s)) for s in seen], dtype=mx.int32)
        lens = mx.array([len(s) for s in seen], dtype=mx.int32)
        out = kernel_reference.paged_decode_attention(q[b].swapaxes(0, 1), pool, tables, lens, scale,
                                                      softcap=softcap, sinks=sinks)  # (L, Hq, D)
        outs.append(out.swapaxes(0, 1))
    return mx.stack(outs)
