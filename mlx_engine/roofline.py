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


def kv_dtype_here() -> tuple[str, str]:
    """(dtype, why) of an unquantized KV cache as the MLX engine stores it on this machine, by default: its
    activation dtype (`runner.pick_dtype`), float32 on MLX's CPU backend, on Metal the checkpoint's (float16 for
    GGUF and most checkpoints; `roofline kv --dtype bfloat16` for a bfloat16 one)."""
    import mlx.core as mx

    if not mx.metal.is_available():
        return "float32", "what MLX's CPU backend stores here"
    return "float16", "what Metal stores for a float16 or GGUF checkpoint"


def measure_bandwidth(nbytes: int = 256 * 2**20, repeats: int = 5) -> float:
    """Sustained read+write bandwidth in bytes/s: the best of `bandwidth_readings(repeats, nbytes)`."""
    return max(bandwidth_readings(repeats, nbytes))


def bandwidth_readings(runs: int = 9, nbytes: int = 256 * 2**20, pause_s: float = 0.02) -> list[float]:
    """`runs` timed copies of an `nbytes` buffer (far beyond any cache), each as bytes/s counting the bytes read
    plus the bytes written (STREAM's copy), after an untimed first copy that faults the pages in. A short pause
    between copies spreads them over time, so that a burst of another process's work spoils a few, not all (on a
    shared VM single copies vary more than twofold)."""
    src = np.ones(nbytes // 8, dtype=np.float64)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    out = []
    for i in range(runs):
        if i:
            time.sleep(pause_s)
        t = time.perf_counter()
        np.copyto(dst, src)
        out.append(2 * src.nbytes / (time.perf_counter() - t))
    return out
