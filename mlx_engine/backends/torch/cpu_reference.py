"""The numpy twins of Roofline's CPU kernel (cpu_kernel/): each primitive as plain, obviously correct array code,
named as the C++ piece it mirrors, for tests/test_torch_cpu_reference.py to hold the kernel to. Nothing at run time
calls them.

- the layouts (formats.h): `codes_of` (a row's integer codes, any bit width), `scales_of` (its scales as float32,
  two-level and Q6_K's half-block ones multiplied out), `weights_of` (d (c - zero) + m in float32, as `dequant`);
- the activations' rounding and the dot products (quants.h, matvec.h): `quantize_rows`, `qmatmul` (in float64: the
  kernel's float32 sums differ from it in their last bits only), `head_logits`;
- a layer's pieces (norm_rope.h, attention.h) and the loop (layers.h): `rms_norm`, `rope`, `attend`, `layer`.

Arrays are numpy; a tensor goes in as `t.numpy()` (bfloat16 has no numpy dtype: `to_bfloat16` gives its values).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

QK = 32  # inputs a block


def row_bytes(bits: int, K: int) -> int:
    """A row's bytes of codes for K inputs (formats.h's `row_bytes_of`)."""
    return {4: K // 2, 5: K // 2 + K // 8, 6: K // 2 + K // 4, 8: K}[bits]


def codes_of(codes: np.ndarray, bits: int, K: int) -> np.ndarray:
    """codes (N, row_bytes) as the kernel holds them -> the integer codes (N, K) int32: 4-bit nibbles (byte j of a
    block: code j low, j + 16 high), plus a word of fifth bits a block (5), plus 8 bytes a block of top bits less 32
    (6: Q6_K's signed codes), or int8 (8)."""
    N = codes.shape[0]
    if bits == 8:
        return codes.view(np.int8).astype(np.int32)
    nb = K // QK
    low = codes[:, : K // 2].reshape(N, nb, 16).astype(np.int32)
    c = np.concatenate([low & 15, low >> 4], axis=-1)  # (N, nb, 32)
    if bits == 5:
        words = codes[:, K // 2:].reshape(N, nb, 4).astype(np.int64)
        word = words[..., 0] | words[..., 1] << 8 | words[..., 2] << 16 | words[..., 3] << 24  # (N, nb)
        c = c | (((word[..., None] >> np.arange(32)) & 1) << 4).astype(np.int32)
    elif bits == 6:
        top = codes[:, K // 2:].reshape(N, nb, 8).astype(np.int32)  # byte i: codes i, i + 8, i + 16, i + 24
        high = np.stack([(top >> (2 * q)) & 3 for q in range(4)], axis=2).reshape(N, nb, 32)
        c = (c | high << 4) - 32
    return c.reshape(N, K)


def _supers(raw: np.ndarray, start: int) -> np.ndarray:
    """A row's float16 supers, stored as bytes from column `start` on -> float32 (N, supers)."""
    return np.ascontiguousarray(raw[:, start:]).view(np.float16).astype(np.float32)


def scales_of(d: np.ndarray, K: int) -> np.ndarray:
    """A weight's scales (or offsets) -> float32 (N, K / 32), or (N, K / 16) for Q6_K's int8 rows: float32 or float16
    as they are; two-level uint8 rows (a 6-bit scale a block, then a float16 a super-block of 8) and Q6_K's int8 rows
    (a scale a half block, then a float16 a super-block) multiplied out in float32, exact."""
    nb = K // QK
    if d.dtype == np.uint8:
        return _supers(d, nb).repeat(8, axis=1) * d[:, :nb].astype(np.float32)
    if d.dtype == np.int8:
        return _supers(d.view(np.uint8), 2 * nb).repeat(16, axis=1) * d[:, : 2 * nb].astype(np.float32)
    return d.astype(np.float32)


def weights_of(codes: np.ndarray, d: np.ndarray, m: np.ndarray, bits: int, zero: int, K: int) -> np.ndarray:
    """The matrix (N, K) float32: d (c - zero) + m per block (6-bit: d (c - 32) a half block), a product then a sum
    in float32, as `dequant` computes it before its rounding to bfloat16."""
    c = codes_of(codes, bits, K).astype(np.float32) - np.float32(zero)
    N, per = c.shape[0], 16 if bits == 6 else QK
    w = c.reshape(N, -1, per) * scales_of(d, K)[..., None]
    if m.size:
        w = w + scales_of(m, K)[..., None]
    return w.reshape(N, K)


def to_bfloat16(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to bfloat16 (to nearest, ties to even), as float32."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16 << 16
    return u.astype(np.uint32).view(np.float32)


def dequant(codes: np.ndarray, d: np.ndarray, m: np.ndarray, bits: int, zero: int = 0) -> np.ndarray:
    """`roofline_cpu::dequant`: the matrix's values rounded to bfloat16 (as float32)."""
    K = row_bytes_inverse(codes.shape[1], bits)
    return to_bfloat16(weights_of(codes, d, m, bits, zero, K))


def row_bytes_inverse(nbytes: int, bits: int) -> int:
    """K from a row's bytes of codes."""
    return {4: nbytes * 2, 5: nbytes * 8 // 5, 6: nbytes * 4 // 3, 8: nbytes}[bits]


def quantize_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x (M, K) float32 -> (xq (M, K) int32 in [-127, 127], dx (M, K / 32) float32): each block of 32 over its scale
    max|x| / 127, x times the scale's float32 inverse rounded half to even (quants.h's `quantize_rows`)."""
    M, K = x.shape
    xb = x.astype(np.float32).reshape(M, K // QK, QK)
    dx = np.abs(xb).max(-1) / np.float32(127)
    inv = np.where(dx > 0, np.float32(1) / np.where(dx > 0, dx, 1), np.float32(0)).astype(np.float32)
    xq = np.rint(xb * inv[..., None]).astype(np.int32)
    return xq.reshape(M, K), dx


def qmatmul(x: np.ndarray, codes: np.ndarray, d: np.ndarray, m: np.ndarray, bits: int, zero: int = 0) -> np.ndarray:
    """`roofline_cpu::qmatmul` in float64: x rounded to int8 per block (`quantize_rows`), then each block's integer
    dot product with the codes times its scales, sum_b d dx sum(c xq) + m dx sum(xq), over the blocks (6-bit: half
    blocks, each with its scale) -> (M, N) float64."""
    M, K = x.shape
    xq, dx = quantize_rows(x)
    c = codes_of(codes, bits, K).astype(np.float64) - zero
    per = 16 if bits == 6 else QK
    isum = np.einsum("mbj,nbj->mnb", xq.reshape(M, -1, per).astype(np.float64), c.reshape(c.shape[0], -1, per))
    dxp = dx.astype(np.float64).repeat(QK // per, axis=1)  # (M, parts)
    y = (isum * scales_of(d, K).astype(np.float64)[None] * dxp[:, None]).sum(-1)
    if m.size:
        sums = xq.reshape(M, -1, QK).sum(-1).astype(np.float64) * dx
        y = y + (scales_of(m, K).astype(np.float64)[None] * sums[:, None]).sum(-1)
    return y


def head_logits(x: np.ndarray, codes: np.ndarray, d: np.ndarray, m: np.ndarray, bits: int, zero: int,
                top: int) -> np.ndarray:
    """`roofline_cpu::head_logits`: `qmatmul`'s logits, each row's `top` largest recomputed from the exact float32
    rows and x unrounded (float64 here) -> (R, N) float64."""
    y = qmatmul(x, codes, d, m, bits, zero)
    w = weights_of(codes, d, m, bits, zero, x.shape[1]).astype(np.float64)
    for r in range(y.shape[0]):
        idx = np.argsort(-y[r], kind="stable")[:top]
        y[r, idx] = w[idx] @ x[r].astype(np.float64)
    return y


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """x (..., W) / sqrt(mean(x^2) + eps) * w (norm_rope.h's `rms_norm_rows`), in float64."""
    x = x.astype(np.float64)
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, mscale: float, traditional: bool) -> np.ndarray:
    """x (N, H, D) rotated at each row's angles, cos and sin (N, D / 2), after scaling by mscale (norm_rope.h's
    `rope_heads`): pairs (j, j + D / 2), or adjacent pairs where `traditional`."""
    x = x.astype(np.float64) * mscale
    c, s = cos[:, None].astype(np.float64), sin[:, None].astype(np.float64)
    if traditional:
        a, b = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2], out[..., 1::2] = a * c - b * s, a * s + b * c
        return out
    a, b = np.split(x, 2, axis=-1)
    return np.concatenate([a * c - b * s, a * s + b * c], axis=-1)


def attend(q: np.ndarray, pool_k: np.ndarray, pool_v: np.ndarray, gather: np.ndarray, bias: np.ndarray,
           scale: float) -> np.ndarray:
    """Each row's query heads q (N, Hq, D) over the slots it gathers (N, S) of the pools (slots, Hkv, D), bias (N, S)
    added to the scores (attention.h's `attend`; a K/V head serves Hq / Hkv query heads) -> (N, Hq, D) float64."""
    N, Hq, D = q.shape
    G = Hq // pool_k.shape[1]
    k = pool_k[gather].astype(np.float64).repeat(G, axis=2)  # (N, S, Hq, D)
    v = pool_v[gather].astype(np.float64).repeat(G, axis=2)
    scores = np.einsum("nhd,nshd->nhs", q.astype(np.float64), k) * scale + bias[:, None]
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("nhs,nshd->nhd", p, v)


@dataclass
class Matrix:
    """A quantized matrix as the kernel reads it (`cpu_native.NativeWeight`'s fields, as numpy)."""

    codes: np.ndarray
    d: np.ndarray
    m: np.ndarray
    bits: int
    zero: int = 0

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return qmatmul(x.astype(np.float32), self.codes, self.d, self.m, self.bits, self.zero)


def layer(h: np.ndarray, in_norm: np.ndarray, post_norm: np.ndarray, qkv: Matrix, o: Matrix, gate_up: Matrix,
          down: Matrix, pool_k: np.ndarray, pool_v: np.ndarray, write: np.ndarray, gather: np.ndarray,
          bias: np.ndarray, cos: np.ndarray, sin: np.ndarray, Hq: int, Hkv: int, D: int, eps: float, scale: float,
          mscale: float = 1.0, traditional: bool = False) -> np.ndarray:
    """One layer of `forward_layers` (layers.h) without biases or q/k norms: h (N, H) -> (N, H) float64; the new
    K/V written to the pools at `write` (in the pools' dtype) before the rows attend."""
    N = h.shape[0]
    qw, kw = Hq * D, Hkv * D
    y = qkv(rms_norm(h, in_norm, eps))
    q = rope(y[:, :qw].reshape(N, Hq, D), cos, sin, mscale, traditional)
    k = rope(y[:, qw:qw + kw].reshape(N, Hkv, D), cos, sin, mscale, traditional)
    pool_k[write], pool_v[write] = k, y[:, qw + kw:qw + 2 * kw].reshape(N, Hkv, D)
    h = h + o(attend(q, pool_k, pool_v, gather, bias, scale).reshape(N, qw))
    z = gate_up(rms_norm(h, post_norm, eps))
    inter = z.shape[1] // 2
    g = z[:, :inter]
    return h + down(g / (1 + np.exp(-g)) * z[:, inter:])
