"""Each GGUF block format's layout, declared once as llama.cpp's structs declare it (ggml-common.h): the weights a
block holds and its fields in order, each a count of little-endian values of one dtype. Offsets and block sizes
follow from the declarations (tests/test_quant.py holds them to gguf-py's `GGML_QUANT_SIZES`).

gguf-py is not imported here: its package __init__ pulls in its writer, sentencepiece and yaml (0.1 s), and every
module that knows a layout (the Metal kernels' references included) imports this one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

QK = 32  # weights per block of the 32-weight formats (ggml's QK4_0, QK8_0, QK_MXFP4, QK4_NL ...)
QK_K = 256  # weights per k-quant super-block (and IQ4_XS block)


@dataclass(frozen=True)
class Field:
    name: str
    offset: int  # bytes from the block's start
    count: int
    dtype: str  # numpy dtype, little-endian: "u1", "i1", "<f2", "<u2"

    @property
    def nbytes(self) -> int:
        return self.count * np.dtype(self.dtype).itemsize

    @property
    def stop(self) -> int:
        return self.offset + self.nbytes


@dataclass(frozen=True)
class BlockFormat:
    name: str  # ggml type name, "Q4_K"
    block_weights: int
    fields: tuple[Field, ...]

    @property
    def block_bytes(self) -> int:
        return self.fields[-1].stop

    def field(self, name: str) -> Field:
        return next(f for f in self.fields if f.name == name)

    def fp16_offsets(self) -> tuple[int, ...]:
        """Where the block keeps float16 scales: random bytes there could be inf or NaN (anywhere else: valid)."""
        return tuple(f.offset + 2 * i for f in self.fields if f.dtype == "<f2" for i in range(f.count))

    def blocks(self, raw: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
        """A tensor's bytes (rows, row length in weights) -> (rows, blocks a row, block bytes) uint8, checked."""
        rows, cols = shape
        nbytes = np.asarray(raw).nbytes
        if cols % self.block_weights or nbytes != rows * cols // self.block_weights * self.block_bytes:
            raise ValueError(f"raw: {nbytes} bytes do not hold a {self.name} tensor of shape {shape}")
        return np.ascontiguousarray(raw).view(np.uint8).reshape(rows, cols // self.block_weights, self.block_bytes)

    def read(self, blocks: np.ndarray, name: str) -> np.ndarray:
        """Field `name` of (..., block bytes) uint8 blocks -> (..., count) in its dtype (float16 widened to float32)."""
        f = self.field(name)
        values = np.ascontiguousarray(blocks[..., f.offset:f.stop]).view(f.dtype)
        return values.astype(np.float32) if f.dtype == "<f2" else values


def _format(name: str, block_weights: int, *fields: tuple[str, int, str]) -> BlockFormat:
    placed, offset = [], 0
    for field_name, count, dtype in fields:
        placed.append(Field(field_name, offset, count, dtype))
        offset = placed[-1].stop
    return BlockFormat(name, block_weights, tuple(placed))


FORMATS: dict[str, BlockFormat] = {f.name: f for f in (
    _format("Q4_0", QK, ("d", 1, "<f2"), ("qs", 16, "u1")),
    _format("Q4_1", QK, ("d", 1, "<f2"), ("m", 1, "<f2"), ("qs", 16, "u1")),
    _format("Q5_0", QK, ("d", 1, "<f2"), ("qh", 4, "u1"), ("qs", 16, "u1")),
    _format("Q5_1", QK, ("d", 1, "<f2"), ("m", 1, "<f2"), ("qh", 4, "u1"), ("qs", 16, "u1")),
    _format("Q8_0", QK, ("d", 1, "<f2"), ("qs", 32, "i1")),
    _format("Q2_K", QK_K, ("scales", 16, "u1"), ("qs", 64, "u1"), ("d", 1, "<f2"), ("dmin", 1, "<f2")),
    _format("Q3_K", QK_K, ("hmask", 32, "u1"), ("qs", 64, "u1"), ("scales", 12, "u1"), ("d", 1, "<f2")),
    _format("Q4_K", QK_K, ("d", 1, "<f2"), ("dmin", 1, "<f2"), ("scales", 12, "u1"), ("qs", 128, "u1")),
    _format("Q5_K", QK_K, ("d", 1, "<f2"), ("dmin", 1, "<f2"), ("scales", 12, "u1"), ("qh", 32, "u1"),
            ("qs", 128, "u1")),
    _format("Q6_K", QK_K, ("ql", 128, "u1"), ("qh", 64, "u1"), ("scales", 16, "i1"), ("d", 1, "<f2")),
    _format("IQ4_NL", QK, ("d", 1, "<f2"), ("qs", 16, "u1")),
    _format("IQ4_XS", QK_K, ("d", 1, "<f2"), ("scales_h", 1, "<u2"), ("scales_l", 4, "u1"), ("qs", 128, "u1")),
    _format("MXFP4", QK, ("e", 1, "u1"), ("qs", 16, "u1")),
)}

KQUANT_TYPES = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
# GGUF types MLX holds exactly as affine groups of 32 (w = scale * q + bias): their codes' bits
MLX_AFFINE_BITS = {"Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q5_1": 5, "Q8_0": 8}
MLX_GROUP = QK  # the group of each GGUF format MLX holds (these, and MXFP4 in its "mxfp4" mode): one block
# The bits of each k-quant's codes (in its affine form, `kquant.kquant_affine`, Q3_K's high bit joins its codes)
KQUANT_CODE_BITS = {"Q2_K": 2, "Q3_K": 3, "Q4_K": 4, "Q5_K": 5, "Q6_K": 6}
# k-quant -> (container bits, group) of `kquant.kquant_affine`: groups are the sub-blocks, codes widened to a width
# MLX's and Triton's affine kernels take (2 and 3 to 4, 5 and 6 to 8)
KQUANT_AFFINE = {"Q2_K": (4, 16), "Q3_K": (4, 16), "Q4_K": (4, 32), "Q5_K": (8, 32), "Q6_K": (8, 16)}
TWO_LEVEL_SCALES = ("Q4_K", "Q5_K")  # six-bit scales and mins per 32 under a float16 d and dmin per 256


def block_format(ggml_type: str) -> BlockFormat:
    """The layout of `ggml_type`, or a ValueError naming the types there are."""
    if ggml_type not in FORMATS:
        raise ValueError(f"ggml_type: expected one of {', '.join(FORMATS)}, got {ggml_type!r}")
    return FORMATS[ggml_type]


def block_bytes(ggml_type: str) -> int:
    return block_format(ggml_type).block_bytes


def row_bytes(ggml_type: str, in_features: int) -> int:
    """Bytes of one row of `in_features` weights."""
    f = block_format(ggml_type)
    return in_features // f.block_weights * f.block_bytes
