"""Attention over the MLX paged KV storage (`kv.paged.PagedKVStorage`): the table's decode and prefill paths.

Every path here reads K and V as stored (quantized K and V transformed, `kv.paged`): the view maps its queries
in with `storage.queries` and the output back with `storage.outputs`. Decode paths take a step's shared state
(`kv.views.DecodeStep`), the layer and q (B, Hq, 1, D) and return (B, Hq, 1, D); prefill paths take the chunk's
view (`kv.views.PagedPrefillView`) and q (1, Hq, L, D) and return (1, Hq, L, D), causal.

A storage with a sliding window (`storage.window`, sliding layers): the query at position p reads keys p - window + 1
.. p. A step's block tables and lengths then start at the block of the earliest key any of its queries reads (the
blocks before it may be freed), and a view's slots start at `view.base`, a block boundary at or before it: paths
mask by the window (where they read whole slot lists, a decode step's slots are the window's exactly).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from kernels_metal import paged_decode_attention
from kernels_metal import reference as kernel_reference
from kernels_metal.reference import channel_codes
from mlx_engine.attention.host import sdpa
from mlx_engine.backends.mlx.host_blas import one_blas_thread

# --- decode ---


def decode_runs_quantized(step: Any, layer: int, q: mx.array, scale: float) -> mx.array:
    """One sequence on MLX's CPU backend, per-token quantized K and V in a head-major pool, its blocks in runs of
    slots (`step.all_slots`): `mx.quantized_matmul` reads the codes in place, per KV head and run (faster than
    dequantizing the runs for `sdpa`). Per-channel keys take `decode_slots_sdpa`."""
    st, runs = step.storage, step.all_slots
    Hq, D = q.shape[1], q.shape[3]
    Hkv = st.num_kv_heads
    G = Hq // Hkv
    qg = q.reshape(Hkv, G, D).astype(mx.float32)
    gs = st.group_size
    outs = []
    for h in range(Hkv):
        scores = [mx.quantized_matmul(qg[h], st.k[layer][h, r], st.k_scales[layer][h, r].astype(mx.float32),
                                      st.k_biases[layer][h, r].astype(mx.float32), transpose=True,
                                      group_size=gs, bits=st.key_bits) for r in runs]  # (G, S_r) each
        p = mx.softmax(mx.concatenate(scores, axis=-1) * scale, axis=-1)  # (G, S)
        out, start = None, 0
        for r, sc in zip(runs, scores):
            n = sc.shape[-1]
            part = mx.quantized_matmul(p[:, start:start + n], st.v[layer][h, r],
                                       st.v_scales[layer][h, r].astype(mx.float32),
                                       st.v_biases[layer][h, r].astype(mx.float32), transpose=False,
                                       group_size=gs, bits=st.bits)  # (G, D)
            out = part if out is None else out + part
            start += n
        outs.append(out)
    return mx.stack(outs).reshape(1, Hq, 1, D).astype(q.dtype)


def decode_slots_sdpa(step: Any, layer: int, q: mx.array, scale: float) -> mx.array:
    """One sequence on MLX's CPU backend: its slots straight into `sdpa`, slices of a head-major pool for its runs
    of blocks (read in place, as mlx-lm's contiguous buffer)."""
    keys, values = step.storage.gather_runs(layer, step.all_slots, q.dtype)  # (1, Hkv, S_i, D) each
    return sdpa(q, keys, values, scale, causal=False)


def decode_host(step: Any, layer: int, q: mx.array, scale: float) -> mx.array:
    """`decode_head_major`'s math in numpy (OpenBLAS), float32 on MLX's CPU backend, where MLX's batched small
    matmuls are slow."""
    st = step.storage
    B, Hq, _, D = q.shape
    Hkv = st.num_kv_heads
    slots, padding = step.host_tables()  # (B, T) each (the window's keys only)
    T = slots.shape[1]
    if st.bits is None:
        mx.eval(q, st.k[layer], st.v[layer])
        k, v = np.asarray(st.k[layer])[:, slots], np.asarray(st.v[layer])[:, slots]  # (Hkv, B, T, D)
    else:
        kd, vd = st.gather(layer, mx.array(slots.reshape(-1)), whole_blocks=True)  # dequantized (Hkv, B * T, D)
        mx.eval(q, kd, vd)
        k, v = (np.asarray(x.astype(mx.float32)).reshape(Hkv, B, T, D) for x in (kd, vd))
    qn = np.asarray(q).reshape(B, Hkv, Hq // Hkv, D).transpose(1, 0, 2, 3)  # (Hkv, B, G, D)
    with one_blas_thread():
        scores = (qn @ k.transpose(0, 1, 3, 2)) * np.float32(scale)  # (Hkv, B, G, T)
        scores[np.broadcast_to(padding[None, :, None, :], scores.shape)] = -np.inf
        scores -= scores.max(-1, keepdims=True)
        np.exp(scores, out=scores)
        scores /= scores.sum(-1, keepdims=True)
        out = scores @ v  # (Hkv, B, G, D)
    return mx.array(np.ascontiguousarray(out.transpose(1, 0, 2, 3)).reshape(B, Hq, 1, D))


def decode_head_major(step: Any, layer: int, q: mx.array, scale: float) -> mx.array:
    """The kernels' reference math (gather through the tables, grouped-query masked softmax in float32) on
    head-major pools."""
    st = step.storage
    B, Hq, _, D = q.shape
    Hkv, bs = st.num_kv_heads, st.block_size
    block_tables, seq_lens = step.block_tables, step.seq_lens
    T = block_tables.shape[1] * bs
    slots = (block_tables[:, :, None] * bs + mx.arange(bs)[None, None, :]).reshape(-1)  # (B * T,)
    k, v = st.gather(layer, slots, whole_blocks=True)  # (Hkv, B * T, D)
    k = k.reshape(Hkv, B, T, D).swapaxes(0, 1).astype(mx.float32)  # (B, Hkv, T, D)
    v = v.reshape(Hkv, B, T, D).swapaxes(0, 1).astype(mx.float32)
    qg = q.astype(mx.float32).reshape(B, Hkv, Hq // Hkv, D)  # (B, Hkv, G, D)
    scores = (qg @ k.swapaxes(-1, -2)) * scale  # (B, Hkv, G, T)
    valid = mx.arange(T)[None, :] < seq_lens[:, None]  # (B, T)
    if st.window is not None:
        valid = valid & (mx.arange(T)[None, :] >= seq_lens[:, None] - st.window)
    scores = mx.where(valid[:, None, None, :], scores, -mx.inf)
    return (mx.softmax(scores, axis=-1) @ v).reshape(B, Hq, 1, D).astype(q.dtype)


def decode_kernel(step: Any, layer: int, q: mx.array, scale: float) -> mx.array:
    """`kernels_metal.paged_decode_attention` on a token-major pool: the Metal kernel on a Mac (the interpreter
    under ROOFLINE_METAL_INTERPRET=1), the reference where it failed its self-check or there is no Metal."""
    B, Hq, _, D = q.shape
    # the block manager built the tables: skip the kernel's host-side data checks (a sync per layer)
    out = paged_decode_attention(q[:, :, 0, :], step.storage.pool(layer), step.block_tables, step.seq_lens, scale,
                                 check_data=False, window=step.storage.window)
    return out.reshape(B, Hq, 1, D)


def decode_reference(step: Any, layer: int, q: mx.array, scale: float) -> mx.array:
    """The kernels' reference on a token-major pool, unvalidated (head dims the kernel is not built for)."""
    B, Hq, _, D = q.shape
    out = kernel_reference.paged_decode_attention(q[:, :, 0, :], step.storage.pool(layer), step.block_tables,
                                                  step.seq_lens, scale, max_seq_len=step.max_seq_len,
                                                  window=step.storage.window)
    return out.reshape(B, Hq, 1, D)


# --- prefill ---


def prefill_sdpa(view: Any, q: mx.array, scale: float) -> mx.array:
    """The chunk's queries over the sequence's slots so far (runs read in place where they can be), causal: the
    L queries align with the last L of the S keys (and see the last `window` of them, with a window)."""
    keys, values = view.storage.gather_runs(view.layer, view.all_slots, q.dtype)  # (1, Hkv, S_i, D) each
    return sdpa(q, keys, values, scale, causal=True, window=view.storage.window)


def prefill_channel(view: Any, q: mx.array, scale: float) -> mx.array:
    """Causal attention over per-channel keys as one-token decode steps would have read them: query i reads the
    blocks before its own as stored (full), and its own block's keys up to i quantized over exactly those (from
    the float staging, the range of rows 0..t by a running min and max), never over later tokens of the chunk.
    So prefill chunks, verifications and decode steps read the same numbers, and no query sees a quantization
    grid shaped by keys after it."""
    st, plan = view.storage, view.key_plan
    L = q.shape[2]
    Hkv, D, bs = st.num_kv_heads, st.head_dim, st.block_size
    first = view.offset // bs  # the chunk's first block, in the sequence's blocks
    nb = plan.valid.shape[0]
    x = st.key_stage[view.layer][plan.block_stage_rows].astype(mx.float32).reshape(nb, bs, Hkv, D)
    pos = mx.arange(view.offset, view.offset + L)  # (L,)
    blk, t = pos // bs - first, pos % bs
    lo, hi = mx.cummin(x, axis=1)[blk, t][:, None], mx.cummax(x, axis=1)[blk, t][:, None]  # (L, 1, Hkv, D)
    codes, step = channel_codes(x[blk], lo, hi, st.key_bits)  # (L, bs, Hkv, D): as the stored blocks went
    # dequantized with the scale and bias rounded to the storage dtype, as the pool keeps them
    own = codes * step.astype(st.dtype).astype(mx.float32) + lo.astype(st.dtype).astype(mx.float32)
    # (L, bs): the own block's positions, as columns of the slots read (they start at view.base)
    cols = ((blk + first) * bs - view.base)[:, None] + mx.arange(bs)[None, :]
    keys, values = st.gather_runs(view.layer, view.all_slots, q.dtype)  # (1, Hkv, S_i, D) each
    width = (first + nb) * bs - view.base  # the last own block's end
    return sdpa(q, keys, values, scale, causal=True, own=(cols, own.transpose(2, 0, 1, 3).astype(q.dtype), width),
                window=st.window)
