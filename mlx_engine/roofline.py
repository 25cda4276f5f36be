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


@dataclass(frozen=True)
class MoEShape:
    """A mixture-of-experts model's experts: a decode step reads only those its router picks."""

    expert_bytes: tuple[int, ...]  # one expert's bytes (its projections, as stored), per MoE layer
    num_experts: tuple[int, ...]  # per MoE layer
    experts_per_token: int  # the router's top k

    @property
    def all_experts_bytes(self) -> int:
        return sum(b * n for b, n in zip(self.expert_bytes, self.num_experts))


def moe_step_bytes(weight_bytes: int, moe: MoEShape, experts: list[list[int]]) -> int:
    """Weight bytes one decode step reads: `weight_bytes` (every weight read per token) less the experts, plus
    the experts routed in the step, per MoE layer (`experts[l]`: for a batch, the union of its rows' choices)."""
    if len(experts) != len(moe.expert_bytes):
        raise ValueError(f"routing for {len(experts)} MoE layers, the model has {len(moe.expert_bytes)}")
    routed = sum(len(set(e)) * b for e, b in zip(experts, moe.expert_bytes))
    return weight_bytes - moe.all_experts_bytes + routed


def moe_weights_per_step(report: dict | None, batch: int) -> float | None:
    """Mean weight bytes of a mixture-of-experts model's recorded decode steps (`Engine.moe_routing`) of exactly
    `batch` decode rows and nothing else (no prefill packed in); None for a dense model or without such steps."""
    if not report:
        return None
    steps = [s["bytes"] for s in report["steps"] if s["decode_rows"] == batch == len(s["rows"][0])]
    return sum(steps) / len(steps) if steps else None


def decode_bytes_per_token(
    weight_bytes: int,
    embedding_bytes: int,
    tied_embeddings: bool,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    context: int,
    kv_bytes_per_element: float,
    moe: MoEShape | None = None,
) -> DecodeBytes:
    """`weight_bytes` counts every parameter as stored; an untied input embedding is a row lookup, so
    its table is not read per token (a tied one is read in full by the output head). With `moe`, one
    sequence's token reads the shared weights and its top-k experts of each MoE layer."""
    weights = weight_bytes if tied_embeddings else weight_bytes - embedding_bytes
    if moe is not None:
        weights = moe_step_bytes(weights, moe, [list(range(min(moe.experts_per_token, n))) for n in moe.num_experts])
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
