"""The 32-weight GGUF formats that are affine groups (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) unpacked with numpy into codes,
scales and biases: w = scale * q + bias exactly, as MLX's affine groups of 32 hold them (`mlx_layout.pack_codes`).

- Q4_0: w = d * (q - 8); Q4_1: w = d * q + m; Q8_0: signed q, w = d * q, shifted by 128 to q in [0, 256).
- Q5_0: w = d * (q - 16); Q5_1: w = d * q + m; the fifth bit of weight j is bit j of the block's 32-bit qh.

Inside every 32-weight block, byte j holds weight j in its low nibble and weight j + 16 in its high one.
"""

from __future__ import annotations

import numpy as np

from quant.formats import MLX_AFFINE_BITS, block_format
from quant.mlx_layout import pack_codes


def nibbles(qs: np.ndarray) -> np.ndarray:
    """(..., 16) bytes -> (..., 32) codes: byte j's low nibble is weight j, its high nibble weight j + 16."""
    return np.concatenate([qs & 0xF, qs >> 4], axis=-1)


def affine_codes(raw: np.ndarray, ggml_type: str, shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray,
                                                                                     np.ndarray]:
    """Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 bytes of a (rows, cols) tensor -> (q (rows, cols) uint8 in
    [0, 2**bits), scales, biases (rows, cols / 32) float32): w = scale * q + bias."""
    if ggml_type not in MLX_AFFINE_BITS:
        raise ValueError(f"ggml_type={ggml_type!r}: expected one of {tuple(MLX_AFFINE_BITS)}")
    f = block_format(ggml_type)
    b = f.blocks(raw, shape)
    d = f.read(b, "d")[..., 0]  # (rows, blocks)
    if ggml_type == "Q8_0":
        q = (f.read(b, "qs").astype(np.int16) + 128).astype(np.uint8)  # (rows, blocks, 32)
        return q.reshape(shape), d, -128 * d
    q = nibbles(f.read(b, "qs"))
    if ggml_type in ("Q5_0", "Q5_1"):
        high = np.ascontiguousarray(f.read(b, "qh")).view("<u4")  # (rows, blocks, 1): bit j is weight j's fifth
        q = q | (((high >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8) << 4)
    offset = {"Q4_0": 8, "Q5_0": 16}.get(ggml_type)  # the symmetric types' zero point
    bias = -offset * d if offset is not None else f.read(b, "m")[..., 0]
    return q.reshape(shape), d, bias


def affine_from_gguf(raw: np.ndarray, ggml_type: str, shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray,
                                                                                         np.ndarray, int]:
    """`affine_codes` packed as MLX holds them: (words (rows, cols * bits / 32) uint32, scales, biases
    (rows, cols / 32) float32, bits), group size 32."""
    q, scales, biases = affine_codes(raw, ggml_type, shape)
    bits = MLX_AFFINE_BITS[ggml_type]
    return pack_codes(q, bits), scales, biases, bits
