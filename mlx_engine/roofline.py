"""The roofline: bytes a decode step must read, and how fast this machine can read them.

Decode at batch 1 reads every weight once per token (plus the KV cache so far), so
tokens/s <= bandwidth / bytes_per_token. "% of roofline" = bytes_per_token * tokens/s / bandwidth.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class DecodeBytes:
    weights: int  # weight bytes read per token (the embedding table counts once only if tied to the head)
    kv: int  # KV bytes read per token at the given context length

    @property
    def total(self) -> int:
        return self.weights + self.kv


def decode_bytes_per_token(
    weight_bytes: int,
    embedding_bytes: int,
    tied_embeddings: bool,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    context: int,
    kv_bytes_per_element: float,
) -> DecodeBytes:
    """`weight_bytes` counts every parameter as stored; an untied input embedding is a row lookup, so
    its table is not read per token (a tied one is read in full by the output head)."""
    weights = weight_bytes if tied_embeddings else weight_bytes - embedding_bytes
    kv = int(2 * num_layers * num_kv_heads * head_dim * context * kv_bytes_per_element)
    return DecodeBytes(weights=weights, kv=kv)


def measure_bandwidth(nbytes: int = 256 * 2**20, repeats: int = 5) -> float:
    """Sustained read+write bandwidth in bytes/s: the best of `repeats` copies of an `nbytes` buffer
    (counts the bytes read plus the bytes written, as STREAM's copy does)."""
    src = np.ones(nbytes // 8, dtype=np.float64)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    return 2 * src.nbytes / best
