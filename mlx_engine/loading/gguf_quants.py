"""The GGUF block types beside the k-quants, as llama.cpp lays them out (ggml-common.h), unpacked with numpy.

- Q5_0 / Q5_1 (32 weights: fp16 d [, fp16 m], 32 high bits, 16 bytes of low nibbles): w = d * (q - 16) and
  w = d * q + m, i.e. MLX's affine 5-bit groups of 32 exactly: `affine_codes` gives (q, scale, bias).
- MXFP4 (32 weights: an E8M0 exponent byte, 16 bytes of FP4 E2M1 nibbles): w = e2m1(q) * 2**(e - 127), i.e.
  MLX's "mxfp4" mode exactly: `mxfp4_codes` gives (q, e).
- IQ4_NL (32 weights: fp16 d, 16 bytes of nibbles indexing a fixed 16-value codebook) and IQ4_XS (256 weights:
  fp16 d, 6-bit scales of eight 32-weight sub-blocks, the same codebook): no MLX layout holds a codebook, so
  `dequantize_iq4` gives float32 values (exactly d * scale * codebook, as gguf.quants.dequantize).

Inside every 32-weight block, byte j holds weight j in its low nibble and weight j + 16 in its high one.
All functions take the raw bytes of a whole tensor and its shape (rows, row length) in numpy order.
"""

from __future__ import annotations

import numpy as np

IQ4_CODEBOOK = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)
BLOCK_BYTES = {"Q5_0": 22, "Q5_1": 24, "MXFP4": 17, "IQ4_NL": 18, "IQ4_XS": 136}
BLOCK_WEIGHTS = {"Q5_0": 32, "Q5_1": 32, "MXFP4": 32, "IQ4_NL": 32, "IQ4_XS": 256}


def _blocks(raw: np.ndarray, ggml_type: str, shape: tuple[int, int]) -> np.ndarray:
    rows, cols = shape
    per, nbytes = BLOCK_WEIGHTS[ggml_type], BLOCK_BYTES[ggml_type]
    if cols % per or np.asarray(raw).nbytes != rows * cols // per * nbytes:
        raise ValueError(f"raw: {np.asarray(raw).nbytes} bytes do not hold a {ggml_type} tensor of shape {shape}")
    return np.ascontiguousarray(raw).view(np.uint8).reshape(rows, cols // per, nbytes)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """(..., 16) bytes -> (..., 32) codes: byte j's low nibble is weight j, its high nibble weight j + 16."""
    return np.concatenate([qs & 0xF, qs >> 4], axis=-1)


def _fp16(b: np.ndarray) -> np.ndarray:
    return b.copy().view(np.float16)[..., 0].astype(np.float32)


def affine_codes(raw: np.ndarray, ggml_type: str, shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q5_0 / Q5_1 -> (q (rows, cols) uint8 in 0..31, scales, biases (rows, cols / 32) float32): w = scale * q + bias."""
    b = _blocks(raw, ggml_type, shape)
    d = _fp16(b[..., 0:2])
    if ggml_type == "Q5_0":
        m, qh, qs = -16 * d, b[..., 2:6], b[..., 6:22]
    elif ggml_type == "Q5_1":
        m, qh, qs = _fp16(b[..., 2:4]), b[..., 4:8], b[..., 8:24]
    else:
        raise ValueError(f"ggml_type={ggml_type!r}: expected Q5_0 or Q5_1")
    high = qh.copy().view("<u4")  # (rows, blocks, 1): bit j is weight j's fifth bit
    fifth = ((high >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)  # (rows, blocks, 32)
    q = _nibbles(qs) | (fifth << 4)
    return q.reshape(shape), d, m


def mxfp4_codes(raw: np.ndarray, shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """MXFP4 -> (q (rows, cols) uint8 FP4 E2M1 codes, e (rows, cols / 32) uint8 E8M0 exponents)."""
    b = _blocks(raw, "MXFP4", shape)
    return _nibbles(b[..., 1:17]).reshape(shape), b[..., 0].copy()


def dequantize_iq4(raw: np.ndarray, ggml_type: str, shape: tuple[int, int]) -> np.ndarray:
    """IQ4_NL / IQ4_XS -> float32 (rows, cols)."""
    b = _blocks(raw, ggml_type, shape)
    if ggml_type == "IQ4_NL":
        d = _fp16(b[..., 0:2])[..., None]  # (rows, blocks, 1)
        return (d * IQ4_CODEBOOK[_nibbles(b[..., 2:18])]).reshape(shape)
    if ggml_type != "IQ4_XS":
        raise ValueError(f"ggml_type={ggml_type!r}: expected IQ4_NL or IQ4_XS")
    d = _fp16(b[..., 0:2])  # (rows, super-blocks)
    scales_h = b[..., 2:4].copy().view("<u2")[..., 0].astype(np.int32)
    scales_l = b[..., 4:8].astype(np.int32)  # two 4-bit low halves per byte
    sub = np.arange(8)
    low = (scales_l[..., sub // 2] >> (4 * (sub % 2))) & 0xF  # (rows, super-blocks, 8)
    high = (scales_h[..., None] >> (2 * sub)) & 3
    dl = d[..., None] * ((low | (high << 4)) - 32)  # (rows, super-blocks, 8)
    codes = _nibbles(b[..., 8:136].reshape(*b.shape[:2], 8, 16))  # (rows, super-blocks, 8, 32)
    return (dl[..., None] * IQ4_CODEBOOK[codes]).reshape(shape)


def pack_bits(q: np.ndarray, bits: int) -> np.ndarray:
    """Codes (rows, cols) in [0, 2**bits) -> uint32 words (rows, cols * bits / 32): each row one little-endian bit
    stream, code i in bits [i * bits, (i + 1) * bits) (MLX's affine layout for every bit width)."""
    rows, cols = q.shape
    out = np.empty((rows, cols * bits // 32), dtype=np.uint32)
    step = max(1, (1 << 22) // max(cols, 1))  # rows per chunk: the bit array stays ~4M entries per bits
    shifts = np.arange(bits, dtype=np.uint8)
    for start in range(0, rows, step):
        chunk = q[start:start + step].astype(np.uint8)
        bit_array = (chunk[..., None] >> shifts) & 1  # (r, cols, bits)
        packed = np.packbits(bit_array.reshape(chunk.shape[0], -1), axis=-1, bitorder="little")
        out[start:start + step] = packed.view("<u4")
    return out
