"""MLX's affine layout (`mx.quantize`): each row's codes one little-endian bit stream in uint32 words, code i in bits
[i * bits, (i + 1) * bits), with a scale and a bias per group of the row's codes."""

from __future__ import annotations

import numpy as np


def pack_codes(q: np.ndarray, bits: int) -> np.ndarray:
    """Codes (rows, cols) in [0, 2**bits) -> uint32 words (rows, cols * bits / 32)."""
    rows, cols = q.shape
    if 32 % bits == 0:  # whole codes a word: shifted and or-ed
        per_word = 32 // bits
        words = q.reshape(rows, cols // per_word, per_word).astype(np.uint32)
        return np.bitwise_or.reduce(words << (np.arange(per_word, dtype=np.uint32) * bits), axis=-1)
    out = np.empty((rows, cols * bits // 32), dtype=np.uint32)
    step = max(1, (1 << 22) // max(cols, 1))  # rows per chunk: the bit array stays ~4M entries per bits
    shifts = np.arange(bits, dtype=np.uint8)
    for start in range(0, rows, step):
        chunk = q[start:start + step].astype(np.uint8)
        bit_array = (chunk[..., None] >> shifts) & 1  # (r, cols, bits)
        packed = np.packbits(bit_array.reshape(chunk.shape[0], -1), axis=-1, bitorder="little")
        out[start:start + step] = packed.view("<u4")
    return out


def unpack_codes(words: np.ndarray, bits: int, cols: int) -> np.ndarray:
    """`pack_codes`' inverse: uint32 words (rows, cols * bits / 32) -> codes (rows, cols) uint8."""
    rows = words.shape[0]
    bit_array = np.unpackbits(np.ascontiguousarray(words).astype("<u4").view(np.uint8).reshape(rows, -1),
                              axis=-1, bitorder="little")
    weights = (1 << np.arange(bits, dtype=np.uint16)).astype(np.uint16)
    return (bit_array[:, :cols * bits].reshape(rows, cols, bits) * weights).sum(-1).astype(np.uint8)
