"""The padding-free forward of an embedding model: many inputs packed into one (1, T) row, each attending only to
itself (a block-diagonal causal mask) at its own positions, no KV kept; then pooling, normalization and Matryoshka
truncation. vLLM's pooling runner packs the same way (its varlen attention over `cu_seqlens`)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

# tokens per packed forward (an input longer than this runs alone): the projections' GEMMs are as efficient from a
# few hundred rows, and the masked twin's scores grow with its square (16 heads x 1024^2 float32 is 64 MiB)
PACK_TOKENS = 1024


def packs(lengths: list[int], budget: int = PACK_TOKENS) -> list[list[int]]:
    """Indices of consecutive inputs, grouped so each group's tokens stay within `budget` (a longer input alone)."""
    out: list[list[int]] = []
    used = 0
    for i, n in enumerate(lengths):
        if out and used + n <= budget:
            out[-1].append(i)
            used += n
        else:
            out.append([i])
            used = n
    return out


class PackedSegmentsView:
    """One layer's view over packed inputs that keeps nothing: q and k roped at each token's position within its own
    input, attention causal within each input and blind across them (a sliding window where the layer has one)."""

    def __init__(self, positions: mx.array, bounds: list[tuple[int, int]], window: int | None):
        self.positions = positions  # (T,) int32: each token's position within its input
        self.bounds = bounds  # each input's [start, end) in the packed row
        self.window = window

    def rope(self, rope: Any, q: mx.array, k: mx.array) -> tuple[mx.array, mx.array]:
        # (1, H, T, D) -> (T, H, 1, D): each token a batch row, roped at its own offset
        def one(x: mx.array) -> mx.array:
            return rope(x.transpose(2, 1, 0, 3), offset=self.positions).transpose(2, 1, 0, 3)

        return one(q), one(k)

    def attention(self, q: mx.array, k: mx.array, v: mx.array, scale: float, **scores: Any) -> mx.array:
        """q (1, Hq, T, D), k/v (1, Hkv, T, D) after rope -> (1, Hq, T, D): each input's causal attention on its own
        (the host's BLAS on MLX's CPU backend, MLX's fused kernel on Metal: `attention.host.sdpa`), so the work is
        the sum of the squares of the lengths, not the square of the sum (vLLM's varlen attention over cu_seqlens).
        Its twin: `masked_attention`."""
        from mlx_engine.attention.host import sdpa

        _no_scores(scores)
        parts = [sdpa(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], scale, causal=True, window=self.window)
                 for a, b in self.bounds]
        return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=2)

    def masked_attention(self, q: mx.array, k: mx.array, v: mx.array, scale: float, **scores: Any) -> mx.array:
        """The slow, obviously correct twin of `attention`: one attention over the whole packed row under a
        block-diagonal causal mask."""
        _no_scores(scores)
        seg = np.concatenate([np.full(b - a, i) for i, (a, b) in enumerate(self.bounds)])
        pos = np.array(self.positions)
        behind = pos[:, None] - pos[None, :]  # query position minus key position (within one input)
        visible = (seg[:, None] == seg[None, :]) & (behind >= 0)
        if self.window is not None:
            visible &= behind < self.window
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mx.array(visible))


class MaskedSegmentsView(PackedSegmentsView):
    """The packed view with the masked twin's attention (tests compare the two)."""

    def attention(self, q: mx.array, k: mx.array, v: mx.array, scale: float, **scores: Any) -> mx.array:
        return self.masked_attention(q, k, v, scale, **scores)


def _no_scores(scores: dict[str, Any]) -> None:
    if scores:  # softcaps and sinks: not in the families embeddings run on (`embedding.model.check_family`)
        raise NotImplementedError(f"packed embedding attention takes no {', '.join(scores)}")


def segment_views(lengths: list[int], windows: list[int | None], masked: bool = False) -> list[PackedSegmentsView]:
    """One view per layer (layers with the same window share one) for inputs of `lengths` packed in order;
    `masked`: the twin (`MaskedSegmentsView`)."""
    positions = mx.array(np.concatenate([np.arange(n) for n in lengths]).astype(np.int32))
    ends = np.cumsum(lengths).tolist()
    bounds = [(e - n, e) for e, n in zip(ends, lengths)]
    kind = MaskedSegmentsView if masked else PackedSegmentsView
    by_window = {w: kind(positions, bounds, w) for w in dict.fromkeys(windows)}
    return [by_window[w] for w in windows]


def pooling_weights(lengths: list[int], pooling: str, skip: list[int]) -> np.ndarray:
    """(N, T) float32: row i picks or averages input i's final hidden states in the packed row. `skip[i]`: leading
    tokens of input i left out of a mean (an instruction prefix, where the checkpoint says include_prompt False)."""
    total = sum(lengths)
    w = np.zeros((len(lengths), total), np.float32)
    start = 0
    for i, n in enumerate(lengths):
        if pooling == "lasttoken":
            w[i, start + n - 1] = 1.0
        elif pooling == "cls":
            w[i, start] = 1.0
        else:  # mean
            first = start + min(skip[i], n - 1)  # at least one token stays
            w[i, first:start + n] = 1.0 / (start + n - first)
        start += n
    return w


def embed_packed(model: Any, inputs: list[list[int]], pooling: str, skip: list[int],
                 masked: bool = False) -> np.ndarray:
    """(N, hidden) float32 pooled final hidden states of `inputs` (token ids), packed PACK_TOKENS at a time;
    `masked`: attention by the twin (`MaskedSegmentsView`)."""
    from mlx_engine.backends.mlx.host_blas import one_blas_thread

    lengths = [len(ids) for ids in inputs]
    windows = model.args.layer_windows()
    out: list[np.ndarray] = []
    with one_blas_thread():  # numpy's BLAS threads would spin against MLX's (backends.mlx.host_blas)
        for group in packs(lengths):
            out.append(_embed_pack(model, [inputs[i] for i in group], pooling, [skip[i] for i in group], windows,
                                   masked))
    return np.concatenate(out)


def _embed_pack(model: Any, inputs: list[list[int]], pooling: str, skip: list[int],
                windows: list[int | None], masked: bool) -> np.ndarray:
    """(n, hidden) float32: one packed forward over `inputs`, pooled."""
    lengths = [len(ids) for ids in inputs]
    tokens = mx.array(np.concatenate(inputs).astype(np.int32))[None]  # (1, T)
    h = model(tokens, segment_views(lengths, windows, masked))[0]  # (T, hidden), after the final norm
    weights = mx.array(pooling_weights(lengths, pooling, skip))  # (n, T)
    pooled = weights @ h.astype(mx.float32)  # (n, hidden)
    mx.eval(pooled)
    return np.array(pooled, copy=True)


def finish(vectors: np.ndarray, normalize: bool, dimensions: int | None) -> np.ndarray:
    """Normalize (sentence-transformers' Normalize: x / max(|x|, 1e-12)), then Matryoshka truncation to `dimensions`
    renormalized (where the model normalizes: a truncated unit vector is not one)."""
    def unit(x: np.ndarray) -> np.ndarray:
        return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)

    if normalize:
        vectors = unit(vectors)
    if dimensions is not None:
        vectors = vectors[:, :dimensions]
        if normalize:
            vectors = unit(vectors)
    return np.ascontiguousarray(vectors, dtype=np.float32)
