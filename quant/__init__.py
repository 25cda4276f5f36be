"""Every quantization format's knowledge in one place, below the engine and the kernels (imports nothing of ours;
numpy, and gguf-py for dequantization): each GGUF block format's layout (`formats`), its unpacking into codes and
scales (`affine`, `kquant`, `codebook`), MLX's packed layout (`mlx_layout`), and dequantization to float32
(`dequantize`, gguf-py's own: llama.cpp's values by definition). The Metal, Triton and C++ kernels keep their own
code; their Python-side constants and references come from here, and tests hold each to `dequantize`.
"""

from __future__ import annotations

import numpy as np

from quant.formats import (
    FORMATS,
    KQUANT_AFFINE,
    KQUANT_CODE_BITS,
    KQUANT_TYPES,
    MLX_AFFINE_BITS,
    MLX_GROUP,
    QK,
    QK_K,
    TWO_LEVEL_SCALES,
    BlockFormat,
    Field,
    block_bytes,
    block_format,
    row_bytes,
)

__all__ = ["FORMATS", "KQUANT_AFFINE", "KQUANT_CODE_BITS", "KQUANT_TYPES", "MLX_AFFINE_BITS", "MLX_GROUP",
           "QK", "QK_K", "TWO_LEVEL_SCALES", "BlockFormat", "Field", "block_bytes", "block_format", "dequantize",
           "row_bytes"]


def dequantize(raw: np.ndarray, ggml_type: str, shape: tuple[int, int]) -> np.ndarray:
    """A (rows, cols) tensor's GGUF bytes -> float32 (rows, cols), as llama.cpp computes them (gguf-py's
    `gguf.quants.dequantize`, imported here so that only a caller that dequantizes pays for gguf-py's __init__)."""
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    blocks = block_format(ggml_type).blocks(raw, shape)  # checked here: gguf-py's own error names no shape
    return gguf_dequantize(blocks.reshape(shape[0], -1), GGMLQuantizationType[ggml_type]).reshape(shape)
