"""The GGUF formats whose codes index a table rather than a grid, unpacked with numpy.

- MXFP4 (32 weights: an E8M0 exponent byte, 16 bytes of FP4 E2M1 nibbles): w = e2m1(q) * 2**(e - 127), i.e.
  MLX's "mxfp4" mode exactly: `mxfp4_codes` gives (q, e).
- IQ4_NL (32 weights: fp16 d, 16 bytes of nibbles indexing a fixed 16-value codebook) and IQ4_XS (256 weights:
  fp16 d, 6-bit scales of eight 32-weight sub-blocks, the same codebook): no MLX layout holds a codebook, so
  `dequantize_iq4` gives float32 values: gguf-py's exactly (zeros' signs aside), in half its time.
"""

from __future__ import annotations

import numpy as np

from quant.affine import nibbles
from quant.formats import block_format


def mxfp4_codes(raw: np.ndarray, shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """MXFP4 -> (q (rows, cols) uint8 FP4 E2M1 codes, e (rows, cols / 32) uint8 E8M0 exponents)."""
    f = block_format("MXFP4")
    b = f.blocks(raw, shape)
    return nibbles(f.read(b, "qs")).reshape(shape), f.read(b, "e")[..., 0].copy()


IQ4_CODEBOOK = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)


def dequantize_iq4(raw: np.ndarray, ggml_type: str, shape: tuple[int, int]) -> np.ndarray:
    """IQ4_NL / IQ4_XS -> float32 (rows, cols): d * scale * codebook."""
    if ggml_type not in ("IQ4_NL", "IQ4_XS"):
        raise ValueError(f"ggml_type={ggml_type!r}: expected IQ4_NL or IQ4_XS")
    f = block_format(ggml_type)
    b = f.blocks(raw, shape)
    d = f.read(b, "d")  # (rows, blocks, 1)
    if ggml_type == "IQ4_NL":
        return (d * IQ4_CODEBOOK[nibbles(f.read(b, "qs"))]).reshape(shape)
    scales_h = f.read(b, "scales_h").astype(np.int32)  # (rows, super-blocks, 1)
    scales_l = f.read(b, "scales_l").astype(np.int32)  # two 4-bit low halves per byte
    sub = np.arange(8)
    low = (scales_l[..., sub // 2] >> (4 * (sub % 2))) & 0xF  # (rows, super-blocks, 8)
    high = (scales_h >> (2 * sub)) & 3
    dl = d * ((low | (high << 4)) - 32)  # (rows, super-blocks, 8)
    codes = nibbles(f.read(b, "qs").reshape(*b.shape[:2], 8, 16))  # (rows, super-blocks, 8, 32)
    return (dl[..., None] * IQ4_CODEBOOK[codes]).reshape(shape)
