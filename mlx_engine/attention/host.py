"""Attention on the host for MLX's CPU backend: `sdpa`, scaled dot-product attention in numpy's BLAS in float32
(MLX's CPU SDPA is several times slower there), MLX's fused kernel elsewhere. The figures behind the thresholds:
docs/benchmarks/code-figures.md, "Figures the code's comments used to carry"."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mlx_engine.backends.mlx.host_blas import one_blas_thread

# Scores held at once by the host attention, in float32 elements: query rows are taken in slabs below it.
HOST_ATTENTION_MAX_SCORES = 16 * 2**20
# Query x key pairs from which the host attention pays for the evaluation of MLX's pending graph it forces, which
# a single decode token over fewer keys does not repay.
HOST_ATTENTION_MIN_PAIRS = 256


def sdpa(q: mx.array, k: mx.array | list[mx.array], v: mx.array | list[mx.array], scale: float,
         causal: bool, own: tuple[mx.array, mx.array, int] | None = None, window: int | None = None) -> mx.array:
    """Scaled dot-product attention, q (1, Hq, L, D), k/v (1, Hkv, S, D) -> (1, Hq, L, D); `causal` aligns
    the L queries with the last L keys. k and v may also be lists of segments (1, Hkv, S_i, D) that together
    are the S keys in order (a paged sequence's runs of blocks, read in place rather than gathered). On MLX's
    CPU backend in float32 it runs in numpy (OpenBLAS), several times faster than MLX's CPU SDPA there;
    elsewhere, and below HOST_ATTENTION_MIN_PAIRS, MLX's fused kernel.

    `own` (causal only): (cols (L, W) int32, keys (Hkv, L, W, D), width): query i reads keys[:, i, w] in place of
    key cols[i, w] (per-channel quantized keys: a query's own block as quantized up to it,
    `attention.paged.prefill_channel`); columns past the S keys, up to width - 1 (>= S), are allowed (masked, as
    the future).

    `window` (causal only): a sliding window, query i (at column S - L + i) sees the columns within `window` of
    it, S - L + i - window < column <= S - L + i."""
    ks, vs = (k, v) if isinstance(k, list) else ([k], [v])
    s = sum(x.shape[2] for x in ks)
    if own is not None:
        if mx.metal.is_available() or q.dtype != mx.float32 or q.shape[0] != 1:
            return _sdpa_own_mlx(q, ks, vs, scale, own, window)
    elif (mx.metal.is_available() or q.dtype != mx.float32 or q.shape[0] != 1
            or q.shape[2] * s < HOST_ATTENTION_MIN_PAIRS):
        if len(ks) > 1:
            ks, vs = [mx.concatenate(ks, axis=2)], [mx.concatenate(vs, axis=2)]
        mask = "causal" if causal else None
        if causal and window is not None:
            mask = _window_mask(q.shape[2], s, s, window)
        return mx.fast.scaled_dot_product_attention(q, ks[0], vs[0], scale=scale, mask=mask)
    _, hq, length, d = q.shape
    hkv = ks[0].shape[1]
    g = hq // hkv
    mx.eval(q, ks, vs, own[:2] if own is not None else [])  # one evaluation for all
    qn = np.asarray(q).reshape(hkv, g, length, d)  # query head h reads kv head h // g
    kts = [np.asarray(x)[0].transpose(0, 2, 1) for x in ks]  # (Hkv, D, S_i), views of the pool where it can
    vns = [np.asarray(x)[0] for x in vs]
    bounds = np.cumsum([0] + [x.shape[-1] for x in kts])
    width = s  # score columns: with `own`, up to its last column
    if own is not None:
        cols, own_keys, width = np.asarray(own[0]), np.asarray(own[1]), own[2]
    out = np.empty((hkv, g, length, d), np.float32)
    slab = max(1, HOST_ATTENTION_MAX_SCORES // (hq * width))
    with one_blas_thread():
        for a in range(0, length, slab):
            b = min(length, a + slab)
            qs = qn[:, :, a:b].reshape(hkv, g * (b - a), d)
            # columns past the S keys (`own`'s) start at 0, not garbage: they are scaled before they are masked
            scores = (np.zeros if width > s else np.empty)((hkv, g * (b - a), width), np.float32)
            for kt, lo, hi in zip(kts, bounds[:-1], bounds[1:]):
                np.matmul(qs, kt, out=scores[:, :, lo:hi])
            scores = scores.reshape(hkv, g, b - a, width)
            if own is not None:  # (Hkv, G, l, 1, D) @ (Hkv, 1, l, D, W) -> (Hkv, G, l, W)
                mine = (qn[:, :, a:b, None, :] @ own_keys[:, None, a:b].swapaxes(-1, -2))[:, :, :, 0]
                np.put_along_axis(scores, np.broadcast_to(cols[a:b], mine.shape), mine, axis=-1)
            scores *= scale
            if causal and (length > 1 or width > s or window is not None):  # query i at column s - length + i
                at = (np.arange(a, b) + (s - length))[:, None]
                visible = np.arange(width)[None, :] <= at
                if window is not None:
                    visible &= np.arange(width)[None, :] > at - window
                scores = np.where(visible, scores, np.float32(-np.inf))
            scores -= scores.max(-1, keepdims=True)
            np.exp(scores, out=scores)
            scores /= scores.sum(-1, keepdims=True)
            p = scores.reshape(hkv, g * (b - a), width)
            acc = p[:, :, bounds[0]:bounds[1]] @ vns[0]
            for vn, lo, hi in zip(vns[1:], bounds[1:-1], bounds[2:]):
                acc += p[:, :, lo:hi] @ vn
            out[:, :, a:b] = acc.reshape(hkv, g, b - a, d)
    return mx.array(out.reshape(1, hq, length, d))


def _window_mask(length: int, s: int, width: int, window: int) -> mx.array:
    """(length, width) bool: query i, at column s - length + i, sees the columns of its window up to itself."""
    at = (mx.arange(length) + (s - length))[:, None]
    cols = mx.arange(width)[None, :]
    return (cols <= at) & (cols > at - window)


def _sdpa_own_mlx(q: mx.array, ks: list[mx.array], vs: list[mx.array], scale: float,
                  own: tuple[mx.array, mx.array, int], window: int | None = None) -> mx.array:
    """`sdpa` with `own` in MLX ops (Metal, half precision), float32 math."""
    cols, own_keys, width = own
    _, hq, length, d = q.shape
    hkv = ks[0].shape[1]
    s = sum(x.shape[2] for x in ks)
    pad = mx.zeros((1, hkv, width - s, d), mx.float32)
    k = mx.concatenate([*(x.astype(mx.float32) for x in ks), pad], axis=2)[0]  # (Hkv, width, D)
    v = mx.concatenate([*(x.astype(mx.float32) for x in vs), pad], axis=2)[0]
    qg = q.astype(mx.float32)[0].reshape(hkv, hq // hkv, length, d)
    scores = qg @ k[:, None].swapaxes(-1, -2)  # (Hkv, G, L, width)
    mine = (qg[:, :, :, None, :] @ own_keys.astype(mx.float32)[:, None].swapaxes(-1, -2))[:, :, :, 0]
    scores = mx.put_along_axis(scores, mx.broadcast_to(cols, mine.shape), mine, axis=-1) * scale
    visible = _window_mask(length, s, width, window if window is not None else width + 1)
    scores = mx.where(visible, scores, -mx.inf)
    return (mx.softmax(scores, axis=-1) @ v[:, None]).reshape(1, hq, length, d).astype(q.dtype)
