"""The padding-free forward of an embedding model: many inputs packed into one (1, T) row, each attending only to
itself (a block-diagonal causal mask) at its own positions, no KV kept; then pooling, normalization and Matryoshka
truncation. vLLM's pooling runner packs the same way (its varlen attention over `cu_seqlens`)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

# tokens per packed forward: the mask and the attention scores grow with its square (16 heads x 1024^2 float32 is
# 64 MiB); an input longer than this runs alone
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

    def __init__(self, positions: mx.array, mask: mx.array):
        self.positions = positions  # (T,) int32
        self.mask = mask  # (T, T) bool: query row may see key column

    def rope(self, rope: Any, q: mx.array, k: mx.array) -> tuple[mx.array, mx.array]:
        # (1, H, T, D) -> (T, H, 1, D): each token a batch row, roped at its own offset
        def one(x: mx.array) -> mx.array:
            return rope(x.transpose(2, 1, 0, 3), offset=self.positions).transpose(2, 1, 0, 3)

        return one(q), one(k)

    def attention(self, q: mx.array, k: mx.array, v: mx.array, scale: float, **scores: Any) -> mx.array:
        """q (1, Hq, T, D), k/v (1, Hkv, T, D) after rope -> (1, Hq, T, D)."""
        if scores:  # softcaps and sinks: not in the families embeddings run on (`embedding.model.check_family`)
            raise NotImplementedError(f"packed embedding attention takes no {', '.join(scores)}")
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=self.mask)


def segment_views(lengths: list[int], windows: list[int | None]) -> list[PackedSegmentsView]:
    """One view per layer (layers with the same window share one) for inputs of `lengths` packed in order."""
    seg = np.repeat(np.arange(len(lengths)), lengths)  # (T,) input of each token
    pos = np.concatenate([np.arange(n) for n in lengths])  # (T,) position within its input
    positions = mx.array(pos.astype(np.int32))
    same = seg[:, None] == seg[None, :]
    behind = pos[:, None] - pos[None, :]  # query position minus key position (within one input)
    by_window: dict[int | None, PackedSegmentsView] = {}
    for w in dict.fromkeys(windows):
        visible = same & (behind >= 0) & (behind < w if w is not None else True)
        by_window[w] = PackedSegmentsView(positions, mx.array(visible))
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


def embed_packed(model: Any, inputs: list[list[int]], pooling: str, skip: list[int]) -> np.ndarray:
    """(N, hidden) float32 pooled final hidden states of `inputs` (token ids), packed PACK_TOKENS at a time."""
    lengths = [len(ids) for ids in inputs]
    windows = model.args.layer_windows()
    out: list[np.ndarray] = []
    for group in packs(lengths):
        group_lengths = [lengths[i] for i in group]
        tokens = mx.array(np.concatenate([inputs[i] for i in group]).astype(np.int32))[None]  # (1, T)
        h = model(tokens, segment_views(group_lengths, windows))[0]  # (T, hidden), after the final norm
        weights = mx.array(pooling_weights(group_lengths, pooling, [skip[i] for i in group]))  # (n, T)
        pooled = weights @ h.astype(mx.float32)  # (n, hidden)
        mx.eval(pooled)
        out.append(np.array(pooled, copy=True))
    return np.concatenate(out)


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
