"""MLX's affine layout (`mx.quantize`): each row's codes one little-endian bit stream in uint32 words, code i in bits
[i * bits, (i + 1) * bits), with a scale and a bias per group of the row's codes."""

from __future__ import annotations

import numpy as np


def pack_codes(q: np.ndarray, bits: int) -> np.ndarray:
    """Codes (rows, cols) in [0, 2**bits) -> uint32 words (rows, cols * bits / 32)."""
    rows, cols = q.shape
    if 8 % bits == 0:  # whole codes a byte, and a word is four little-endian bytes
        per_byte = 8 // bits
        codes = q.astype(np.uint8, copy=False).reshape(rows, cols // per_byte, per_byte)
        packed = codes[..., 0].copy()
        for i in range(1, per_byte):
            packed |= codes[..., i] << np.uint8(i * bits)
        return packed.reshape(rows, -1).view("<u4")
    if cols * bits % 32:
        raise ValueError(f"q: rows of {cols} codes of {bits} bits do not fill whole uint32 words")
    # eight codes are `bits` whole bytes: built in a uint64, its low bytes kept
    codes = q.reshape(rows, cols // 8, 8).astype(np.uint64)
    packed = codes[..., 0].copy()
    for i in range(1, 8):
        packed |= codes[..., i] << np.uint64(i * bits)
    low = packed.view(np.uint8).reshape(rows, cols // 8, 8)[..., :bits]
    return np.ascontiguousarray(low).reshape(rows, -1).view("<u4")
