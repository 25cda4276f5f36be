"""Exact smoothing of a quantized KV cache: per-model offsets and key scales, measured once at load.

4-bit KV spends each token's 16 levels on the range of its group, and SmolLM2's keys and values carry a large
shared part (an offset, and the attention sink's key at position 0 that most late-layer queries attend to).
Both are removed before quantizing, in ways that change no attention output in exact arithmetic:

- keys are stored as ((k - m_k) * s) @ H and queries attend as (q / s) @ H (H: the Hadamard rotation of
  `paged.hadamard`, s: a per-channel scale): the score is q . k - q . m_k, and q . m_k is the same for
  every key a query sees, so the softmax drops it (SageAttention's "smooth K", with SmoothQuant's per-channel
  scale moved between key and query; s on a grid of 2 ** (i / 16), near 1 for most channels).
- values are stored as (v - m_v) @ H and the attention output gets @ H.T + m_v back: softmax weights sum to 1.

m_k and m_v are the attention-weighted mean key and value of each (layer, KV head) over a short built-in text
(`calibration.txt`, not the benchmark's), so the sink's key and value, which receive most of the attention in
SmolLM2's later layers, are stored small. s = sqrt(rms(q) / rms(k - m_k)) per channel leans the keys' quantization
error away from the channels queries weigh most: a key's 4-bit error is about proportional to its norm
|(k - m_k) s|, the score error to that times |q / s|, and this s minimizes the product of their means over the
calibration text. All fixed per model (not per sequence), so prefix-cached blocks stay shareable and reads need
no correction. Measured in docs/benchmarks/kv-cache.md (bench/kv.py, figure 4).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

CALIBRATION_TEXT = Path(__file__).with_name("calibration.txt")  # Pride and Prejudice, ch. 1 (1813)
NUM_FALLBACK_IDS = 128  # a model without a tokenizer calibrates on fixed pseudo-random ids
OFFSET_STEP = 2.0**-6  # offsets are rounded to this grid: last-bit differences between machines keep the fingerprint
SCALE_EXPONENT = 0.5  # s = sqrt(rms q / rms k) minimizes E|q'|^2 E|k'|^2, the expected score error (docstring)
SCALE_STEPS = 16  # scales are rounded to 2 ** (i / 16), for the fingerprint as the offsets


@dataclass(frozen=True)
class KVSmoothing:
    """Per (layer, KV head) offsets and key scales, float32 (num_layers, num_kv_heads, head_dim) each."""

    key_offset: np.ndarray
    key_scale: np.ndarray  # on a grid of 2 ** (i / SCALE_STEPS)
    value_offset: np.ndarray

    def fingerprint(self) -> str:
        """What saved KV files record: blocks stored under other offsets or scales read wrongly."""
        h = hashlib.sha256()
        for a in (self.key_offset, self.key_scale, self.value_offset):
            h.update(np.ascontiguousarray(a, dtype=np.float32).tobytes())
        return h.hexdigest()[:16]


def calibration_ids(tokenizer: Any, vocab_size: int) -> list[int]:
    """The calibration text's tokens, or fixed pseudo-random ids when the model has no tokenizer."""
    try:
        ids = list(tokenizer.encode(CALIBRATION_TEXT.read_text()))
    except Exception:  # NoTokenizer refuses text (RequestError)
        ids = []
    ids = [t for t in ids if 0 <= t < vocab_size]
    if len(ids) < 16:
        ids = np.random.default_rng(0).integers(0, vocab_size, NUM_FALLBACK_IDS).tolist()
    return ids


class _Recorder:
    """A layer's cache during the calibration forward: exact causal attention, and the statistics."""

    offset = 0

    def __init__(self, out: list):
        self.out = out

    def rope(self, rope: Any, q: mx.array, k: mx.array) -> tuple[mx.array, mx.array]:
        return rope(q, offset=0), rope(k, offset=0)

    def attention(self, q: mx.array, k: mx.array, v: mx.array, scale: float, softcap: float | None = None,
                  sinks: mx.array | None = None) -> mx.array:
        """q (1, Hq, T, D), k/v (1, Hkv, T, D) after rope. A soft cap or sinks (`MLXLayerView.attention`) make
        the softmax depend on a shift of every score, so such a layer gets no key offset; with sinks the weights
        sum to less than 1, so no value offset either (the stored values' attention would not add it back)."""
        _, Hq, T, D = q.shape
        Hkv = k.shape[1]
        G = Hq // Hkv
        q32, k32, v32 = (x[0].astype(mx.float32) for x in (q, k, v))
        qg = q32.reshape(Hkv, G * T, D)  # (Hkv, G * T, D): a KV head's queries
        scores = (qg @ k32.swapaxes(-1, -2)) * scale  # (Hkv, G * T, T)
        if softcap is not None:
            scores = mx.tanh(scores / softcap) * softcap
        causal = mx.arange(T)[None, :] <= mx.arange(T)[:, None]  # (T, T)
        scores = mx.where(mx.tile(causal, (G, 1))[None], scores, -mx.inf)
        if sinks is None:
            probs = mx.softmax(scores, axis=-1)  # (Hkv, G * T, T)
        else:
            sink = mx.broadcast_to(sinks.astype(mx.float32).reshape(Hkv, G, 1, 1), (Hkv, G, T, 1))
            probs = mx.softmax(mx.concatenate([scores, sink.reshape(Hkv, G * T, 1)], axis=-1), axis=-1)[..., :T]
        weight = probs.mean(axis=1)  # (Hkv, T): attention each key receives, on average
        weight = weight / weight.sum(axis=-1, keepdims=True)
        m_k = (weight[..., None] * k32).sum(axis=1)  # (Hkv, D)
        m_v = (weight[..., None] * v32).sum(axis=1)
        if softcap is not None or sinks is not None:
            m_k = mx.zeros_like(m_k)
        if sinks is not None:
            m_v = mx.zeros_like(m_v)
        rms_k = mx.sqrt(mx.mean((k32 - m_k[:, None]) ** 2, axis=1))  # (Hkv, D)
        rms_q = mx.sqrt(mx.mean(qg**2, axis=1))
        self.out.append((m_k, m_v, rms_k, rms_q))
        return (probs @ v32).reshape(1, Hq, T, D).astype(q.dtype)  # (Hkv, G * T, D) -> (1, Hq, T, D)


def measure(model: Any, ids: list[int]) -> KVSmoothing:
    """One forward of `ids` through `model` (a native model: `model(inputs, caches)`) -> its smoothing."""
    stats: list[tuple[mx.array, ...]] = []
    h = model(mx.array([ids], dtype=mx.int32), [_Recorder(stats) for _ in model.layers])
    mx.eval(h, stats)
    m_k, m_v, rms_k, rms_q = (np.stack([np.array(s[i]) for s in stats]).astype(np.float64) for i in range(4))
    tiny = 1e-3 * max(float(rms_k.max()), float(rms_q.max()), 1e-30)
    ratio = (rms_q + tiny) / (rms_k + tiny)
    log2 = SCALE_EXPONENT * np.log2(ratio)
    log2 -= log2.mean(axis=-1, keepdims=True)  # centred on 1 per head (a head-wide factor changes nothing)
    scale = np.exp2(np.round(log2 * SCALE_STEPS) / SCALE_STEPS)
    grid = lambda x: (np.round(x / OFFSET_STEP) * OFFSET_STEP).astype(np.float32)  # noqa: E731
    return KVSmoothing(grid(m_k), scale.astype(np.float32), grid(m_v))


def calibrate(model: Any, tokenizer: Any, vocab_size: int) -> KVSmoothing:
    return measure(model, calibration_ids(tokenizer, vocab_size))
