"""Quantized weights held packed for torch's CPU kernels, read in place at every matmul: no float copy.

- `Int4Weight`: `aten._weight_int4pack_mm_for_cpu`, tinygemm's CPU port. Codes 0..15 in the kernel's own
  packed layout (`_convert_weight_to_int4pack_for_cpu`), one (scale, zero) pair per group of 32, 64, 128 or
  256 inputs: w = (c - 8) * scale + zero. An affine code of b bits (w = s * q + bias) is held as
  ceil(b / 4) planes of 4 bits laid side by side along the input (q = sum_p 16^p c_p; plane p's scale is
  16^p s), so its codes stay exact: Q4_0, Q4_1, Q4_K, MLX 2-4 bit as one plane; Q8_0, Q5_*, MLX 5-8 bit
  as two (the input row repeated once per plane).
- `Int8Weight`: `aten._weight_int8pack_mm`, one scale per output row. For the k-quants whose sub-blocks are
  16 wide (Q2_K, Q3_K, and Q6_K where Roofline's kernel is not built: the int4 kernel takes no group under 32):
  their float32 weights rounded to int8 per row, the one rounded format here.

Both kernels are vectorized (AVX2, AVX-512) for bfloat16 activations only; float32 takes a scalar loop
40x slower. So rows go in as bfloat16 and come out as bfloat16, widened back to the model's dtype: scales
and zeros are bfloat16 too (`describe` says what that rounds per format). A CPU without AVX2 (torch's
DEFAULT kernels) gets the portable path instead: `cpu_features.cpu_support`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from mlx_engine.backends.torch import cpu_features, cpu_gemm
from mlx_engine.backends.torch.cpu_features import DEQUANT_MIN_ROWS, CPUSupport
from mlx_engine.backends.torch.cpu_native import QK, NativeWeight
from mlx_engine.backends.torch.cpu_native import fuse as fuse_native

KERNEL_DTYPE = torch.bfloat16
INT4_GROUP_SIZES = (32, 64, 128, 256)
# --- the int4 kernel's packed layout ------------------------------------------------------------------
# `_convert_weight_to_int4pack_for_cpu` (torch 2.13, aten/src/ATen/native/cpu/int4mm_kernel.cpp) stores
# blocks of block_n output rows one after another, each (K, block_n / 2) bytes: byte j of input k holds row
# j in its low nibble and row j + block_n / 2 in its high one (a partial last block is laid out otherwise,
# so weights are padded to whole blocks). `layout_ok` checks this against the kernel's own packer once.


def _unpack_blocks(packed: torch.Tensor, block_n: int) -> torch.Tensor:
    """Packed bytes of whole blocks (nb * block_n, K / 2) -> codes (nb, K, block_n) uint8."""
    nb = packed.shape[0] // block_n
    b = packed.reshape(nb, -1, block_n // 2)  # (nb, K, block_n / 2)
    return torch.cat([b & 15, b >> 4], dim=-1)


def unpack_codes(packed: torch.Tensor, block_n: int) -> torch.Tensor:
    """Packed bytes (N, K / 2), N whole blocks -> codes (N, K) uint8."""
    return _unpack_blocks(packed, block_n).transpose(1, 2).reshape(packed.shape[0], -1)


def unpack_rows(packed: torch.Tensor, block_n: int, ids: torch.Tensor) -> torch.Tensor:
    """Codes of output rows `ids` (n,) -> (n, K) uint8, reading only their bytes."""
    nb, half = packed.shape[0] // block_n, block_n // 2
    b = packed.reshape(nb, -1, half)  # (nb, K, half)
    within = ids % block_n
    col = b[ids // block_n, :, within % half]  # (n, K)
    return torch.where((within >= half)[:, None], col >> 4, col & 15)


def pack_codes(codes: np.ndarray, block_n: int) -> torch.Tensor:
    """Codes (N, K) in [0, 16), N whole blocks -> the kernel's packed bytes (N, K / 2) uint8, laid out as
    `_convert_weight_to_int4pack_for_cpu` lays them (`layout_ok` checks the two agree) without its int32
    input (4 bytes a code) or its scalar loop."""
    n, k = codes.shape
    blocks = codes.reshape(n // block_n, block_n, k).transpose(0, 2, 1)  # (nb, K, block_n)
    half = block_n // 2
    packed = blocks[..., :half] | (blocks[..., half:] << 4)  # (nb, K, half)
    return torch.from_numpy(np.ascontiguousarray(packed, dtype=np.uint8).reshape(n, k // 2))


@functools.cache
def layout_ok(block_n: int) -> bool:
    """Whether `pack_codes`, `unpack_codes` and `unpack_rows` agree with the kernel's own packer on two
    blocks of random codes."""
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (2 * block_n, 64), generator=g, dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1).view(torch.uint8)
    ids = torch.tensor([0, block_n // 2 + 1, block_n + 3, 2 * block_n - 1])
    return (packed.shape == (2 * block_n, 32) and torch.equal(unpack_codes(packed, block_n), codes.to(torch.uint8))
            and torch.equal(unpack_rows(packed, block_n, ids), codes[ids].to(torch.uint8))
            and torch.equal(pack_codes(codes.numpy().astype(np.uint8), block_n), packed))


# --- weights ---------------------------------------------------------------------------------------


def _rows_2d(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]).to(KERNEL_DTYPE).contiguous()


FROM_AFFINE_ROWS = 4096  # rows `Int4Weight.from_affine` packs at once


def _pack_affine(codes: np.ndarray, scales: np.ndarray, biases: np.ndarray, rows: int, bits: int, planes: int,
                 block_n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`from_affine` on a slice of whole blocks (`rows`, the slice zero-padded to it): (packed bytes (rows,
    planes * in / 2), scales and zeros (planes * groups, rows, 2) bfloat16)."""
    n = codes.shape[0]
    c = np.asarray(codes, np.uint8)
    s = torch.from_numpy(np.asarray(scales, np.float32))
    b = torch.from_numpy(np.asarray(biases, np.float32))
    if rows != n:  # zero rows to a whole block (their output is sliced off)
        c = np.pad(c, ((0, rows - n), (0, 0)))
        s, b = F.pad(s, (0, 0, 0, rows - n)), F.pad(b, (0, 0, 0, rows - n))
    plane_codes = c if planes == 1 else np.concatenate([c & 15, c >> 4], axis=1)  # (rows, planes * in)
    # w = s q + b becomes S' q + b' with S' = s in bfloat16: plane p adds (c_p - 8) 16^p S' + Z_p, so the zeros
    # sum to 8 S' (16^P - 1) / 15 + b'. A symmetric group (b = -2^(bits-1) s: Q4_0, Q8_0, Q5_0) keeps its
    # signed codes, b' = -2^(bits-1) S': only its scale is rounded. Each group's b' joins the plane whose zero
    # then rounds least in bfloat16 (Q4_0's and Q8_0's: none)
    rounded = s.to(KERNEL_DTYPE).float()
    offset = 2.0 ** (bits - 1)
    bias = torch.where(b == -offset * s, -offset * rounded, b)
    plane_scales = [rounded * 16**p for p in range(planes)]
    zeros = [8 * ps for ps in plane_scales]
    cands = torch.stack([z + bias for z in zeros])  # (planes, rows, groups)
    best = (cands.to(KERNEL_DTYPE).float() - cands).abs().argmin(0)
    zeros = [torch.where(best == p, cands[p], zeros[p]) for p in range(planes)]
    sz = torch.stack([torch.cat(plane_scales, 1), torch.cat(zeros, 1)], dim=-1)  # (rows, planes * groups, 2)
    return pack_codes(plane_codes, block_n), sz.transpose(0, 1).to(KERNEL_DTYPE)


class Int4Weight:
    """An affine-quantized matrix (out, in) held as int4 planes in the kernel's layout (module docstring)."""

    def __init__(self, packed: torch.Tensor, scale_zeros: torch.Tensor, out_features: int, in_features: int,
                 planes: int, group_size: int, block_n: int, source_bytes: int):
        self.packed = packed  # (N padded to block_n, planes * in / 2) uint8
        self.scale_zeros = scale_zeros  # (planes * in / group, N padded, 2) bfloat16
        self.out_features, self.in_features = out_features, in_features
        self.planes, self.group_size, self.block_n = planes, group_size, block_n
        self.source_bytes = source_bytes  # the checkpoint's bytes for this matrix
        self.source = f"{planes * 4}-bit"  # the source format, for the load note (set by the loader)

    @classmethod
    def from_affine(cls, codes: np.ndarray, scales: np.ndarray, biases: np.ndarray, bits: int, group_size: int,
                    block_n: int) -> Int4Weight:
        """codes (out, in) integers in [0, 2**bits); scales, biases (out, in / group) float32:
        w = scales * codes + biases per group. Packed FROM_AFFINE_ROWS rows at a time into the result, so
        that the transients (plane codes, float32 scales) are a slice's, not a whole embedding's."""
        return cls.from_affine_rows(lambda lo, hi: codes[lo:hi], scales, biases, codes.shape, bits, group_size,
                                    block_n)

    @classmethod
    def from_affine_rows(cls, codes: Callable[[int, int], np.ndarray], scales: np.ndarray, biases: np.ndarray,
                         shape: tuple[int, int], bits: int, group_size: int, block_n: int) -> Int4Weight:
        """`from_affine` with the codes of rows [lo, hi) made by `codes(lo, hi)` as each slice is packed, so that
        a matrix's codes never exist whole (an embedding's: a byte a weight)."""
        n, k = shape
        planes = -(-bits // 4)
        padded = -(-n // block_n) * block_n
        packed = torch.empty((padded, planes * k // 2), dtype=torch.uint8)
        sz = torch.empty((planes * (k // group_size), padded, 2), dtype=KERNEL_DTYPE)
        step = max(block_n, FROM_AFFINE_ROWS // block_n * block_n)
        for lo in range(0, padded, step):
            hi = min(padded, lo + step)
            packed[lo:hi], sz[:, lo:hi] = _pack_affine(codes(lo, min(hi, n)), scales[lo:hi], biases[lo:hi], hi - lo,
                                                       bits, planes, block_n)
        return cls(packed, sz, n, k, planes, group_size, block_n, 0)

    def _input(self, x2: torch.Tensor) -> torch.Tensor:
        return x2 if self.planes == 1 else x2.repeat(1, self.planes)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., in) -> x @ W.T (..., out) in x's dtype."""
        x2 = _rows_2d(x)
        if x2.shape[0] >= DEQUANT_MIN_ROWS and cpu_features.bf16_gemm():
            y = cpu_gemm.int4_matmul(self, x2)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(self._input(x2), self.packed, self.group_size,
                                                            self.scale_zeros)
        if y.shape[1] != self.out_features:
            y = y[:, : self.out_features]
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def dequantized(self, lo: int = 0, hi: int | None = None, dtype: torch.dtype = KERNEL_DTYPE) -> torch.Tensor:
        """Output rows [lo, hi) (multiples of block_n) as a float matrix (hi - lo, in), in float32 math."""
        hi = self.packed.shape[0] if hi is None else hi
        codes = unpack_codes(self.packed[lo:hi], self.block_n)  # (rows, planes * in)
        sz = self.scale_zeros[:, lo:hi].float()  # (planes * groups, rows, 2)
        return self._apply(codes, sz).to(dtype)

    def _apply(self, codes: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
        """codes (rows, planes * in); sz (planes * groups, rows, 2) float32 -> (rows, in) float32."""
        rows, g = codes.shape[0], self.group_size
        w = codes.float().reshape(rows, -1, g) - 8  # (rows, planes * groups, g)
        w = w * sz[..., 0].T[..., None] + sz[..., 1].T[..., None]
        return w.reshape(rows, self.planes, self.in_features).sum(1)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Dequantized rows `ids` (an embedding lookup): ids (...) -> (..., in) float32."""
        flat = ids.reshape(-1)
        codes = unpack_rows(self.packed, self.block_n, flat)
        w = self._apply(codes, self.scale_zeros[:, flat].float())
        return w.reshape(*ids.shape, self.in_features)

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + self.scale_zeros.numel() * self.scale_zeros.element_size()

    @property
    def num_parameters(self) -> int:
        return self.out_features * self.in_features


# Elements of a float matrix `Int8Weight.from_rows` rounds at once (4 MB of float32: its transients, a few times
# that, stay beside a 1B model's ~800 MB instead of 100 MB over it)
INT8_ROWS_ELEMENTS = 1 << 20


def _round_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes (out, in) int8, scales (out,)): each row's scale max|w| / 127 in bfloat16, rounded up so that no code
    passes 127, then each weight to the nearest code of that scale."""
    w = weight.float()
    scale = (w.abs().amax(1) / 127 * (1 + 2**-7)).clamp_min(1e-30).to(KERNEL_DTYPE)
    return torch.round(w / scale.float()[:, None]).clamp(-127, 127).to(torch.int8), scale


class Int8Weight:
    """A matrix rounded to int8 per output row for `aten._weight_int8pack_mm`: its scale max|w| / 127 in
    bfloat16 (rounded up, so that no code passes 127), then each weight to the nearest code of that scale."""

    def __init__(self, weight: torch.Tensor, source_bytes: int = 0):
        self.q, self.scale = _round_int8(weight)
        self.out_features, self.in_features = self.q.shape
        self.source_bytes, self.source = source_bytes, "float"

    @classmethod
    def from_rows(cls, rows: Callable[[int, int], torch.Tensor], shape: tuple[int, int],
                  source_bytes: int = 0) -> Int8Weight:
        """rows(lo, hi): rows [lo, hi) of the float matrix, rounded a slice at a time (the same codes and scales:
        each row's are its own), so that a float copy of a large matrix (a k-quant head) never exists whole."""
        n, k = shape
        w = cls.__new__(cls)
        w.q, w.scale = torch.empty((n, k), dtype=torch.int8), torch.empty(n, dtype=KERNEL_DTYPE)
        step = max(1, INT8_ROWS_ELEMENTS // k)
        for lo in range(0, n, step):
            hi = min(n, lo + step)
            w.q[lo:hi], w.scale[lo:hi] = _round_int8(rows(lo, hi))
        w.out_features, w.in_features = n, k
        w.source_bytes, w.source = source_bytes, "float"
        return w

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        x2 = _rows_2d(x)
        if x2.shape[0] >= DEQUANT_MIN_ROWS and cpu_features.bf16_gemm():
            y = cpu_gemm.int8_matmul(self, x2)
        else:
            y = torch.ops.aten._weight_int8pack_mm(x2, self.q, self.scale)
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def dequantized(self, dtype: torch.dtype = KERNEL_DTYPE) -> torch.Tensor:
        return (self.q.float() * self.scale.float()[:, None]).to(dtype)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.q[ids].float() * self.scale[ids].float()[..., None]

    @property
    def nbytes(self) -> int:
        return self.q.numel() + self.scale.numel() * self.scale.element_size()

    @property
    def num_parameters(self) -> int:
        return self.q.numel()


CPUWeight = Int4Weight | Int8Weight | NativeWeight


def affine_weight(codes: Callable[[int, int], np.ndarray], scales: np.ndarray, biases: np.ndarray,
                  shape: tuple[int, int], bits: int, group_size: int, support: CPUSupport) -> Int4Weight | NativeWeight:
    """An affine-quantized matrix (`Int4Weight.from_affine_rows`'s arguments) as this CPU reads it fastest:
    for Roofline's own kernel where `support.native` and its groups are whole blocks of 32, else as int4 planes."""
    if support.native and group_size % QK == 0 and bits <= 8:
        return NativeWeight.from_affine_rows(codes, scales, biases, shape, bits, group_size)
    return Int4Weight.from_affine_rows(codes, scales, biases, shape, bits, group_size, support.block_n)


def kquant_weight(codes: Callable[[int, int], np.ndarray], d: np.ndarray, dmin: np.ndarray, sc: np.ndarray,
                  mn: np.ndarray, shape: tuple[int, int], bits: int, support: CPUSupport) -> Int4Weight | NativeWeight:
    """A Q4_K or Q5_K matrix (`quant.kquant.kquant_scales`' scales, codes(lo, hi) its rows' codes): for
    Roofline's own kernel with its scales in two levels as the file has them (`NativeWeight.from_kquant`), else
    as affine groups of 32 (`affine_weight`, the scales multiplied out)."""
    if support.native:
        return NativeWeight.from_kquant(codes, d, dmin, sc, mn, shape, bits)
    rep = lambda a: np.repeat(a, 8, axis=1)  # noqa: E731 - a super-block's scale for each of its 8 blocks
    return affine_weight(codes, rep(d) * sc, -(rep(dmin) * mn), shape, bits, 32, support)


def q6k_weight(codes: Callable[[int, int], np.ndarray], sc: np.ndarray, d: np.ndarray, shape: tuple[int, int],
               rows: Callable[[int, int], torch.Tensor], support: CPUSupport) -> Int8Weight | NativeWeight:
    """A Q6_K matrix (codes(lo, hi) its rows' integers in [0, 64), sc and d its scales): for Roofline's own kernel
    as 6-bit codes with the file's scales (`NativeWeight.from_q6k`, exact), else its float rows (rows(lo, hi))
    rounded to int8 rows (`int8_weight`)."""
    if support.native:
        return NativeWeight.from_q6k(codes, sc, d, shape)
    return int8_weight(rows, shape, support)


def int8_weight(rows: Callable[[int, int], torch.Tensor], shape: tuple[int, int], support: CPUSupport,
                source_bytes: int = 0) -> Int8Weight | NativeWeight:
    """A float matrix, its rows [lo, hi) given by rows(lo, hi), rounded to int8 per output row
    (`Int8Weight.from_rows`), read by Roofline's own kernel where `support.native` (the same codes and scales)."""
    w = Int8Weight.from_rows(rows, shape, source_bytes)
    if support.native and w.in_features % QK == 0:
        return NativeWeight.from_int8_rows(w.q, w.scale, source_bytes)
    return w

# Logits a head recomputes per row in float32 (`head_matmul`). The kernels round their output to bfloat16: at
# SmolLM2's top logits (16-32) that is a step of 0.125, where neighbours tie and greedy decoding would take the
# lower token id among them. The true argmax is far inside the kernel's top 64.
HEAD_EXACT_TOP = 64


def head_matmul(w: CPUWeight, x: torch.Tensor, top: int = HEAD_EXACT_TOP) -> torch.Tensor:
    """The output head: x (..., in) -> logits (..., vocab) float32 through the kernel, each row's `top`
    largest recomputed in float32 from their dequantized rows and x unrounded (so that greedy decoding and
    the top log-probabilities are those of the packed weights, not of the kernel's bfloat16 output). Roofline's
    kernel's weights, at a decode step's rows: the same ops in one call of its library (`head_logits`)."""
    if isinstance(w, NativeWeight) and x.numel() < DEQUANT_MIN_ROWS * x.shape[-1]:
        x2 = x.reshape(-1, x.shape[-1]).float()
        y = torch.ops.roofline_cpu.head_logits(x2, w.codes, w.d, w.m, w.bits, w.zero, top)
        return y.view(*x.shape[:-1], -1)
    return head_ops(w, x, top)


def head_ops(w: CPUWeight, x: torch.Tensor, top: int = HEAD_EXACT_TOP) -> torch.Tensor:
    """`head_matmul` as torch ops."""
    y = w.matmul(x).float()
    x2, y2 = x.reshape(-1, x.shape[-1]).float(), y.view(-1, y.shape[-1])
    idx = y2.topk(min(top, y2.shape[-1]), dim=-1).indices  # (R, top)
    rows = w.rows(idx.reshape(-1)).view(*idx.shape, -1)  # (R, top, in)
    y2.scatter_(1, idx, torch.matmul(rows, x2[:, :, None])[..., 0])
    return y


def fuse(weights: list[CPUWeight]) -> tuple[CPUWeight, list[int]] | None:
    """Projections of one input (q/k/v, gate/up) as one matrix whose outputs are theirs side by side (one
    kernel call instead of three or two), when they share a format: (the matrix, each part's width in its
    output, padding to a whole block included); else None."""
    first = weights[0]
    if isinstance(first, NativeWeight):
        fused = fuse_native(weights)
        return None if fused is None else (fused, [w.out_features for w in weights])
    if isinstance(first, Int4Weight):
        if not all(isinstance(w, Int4Weight) and (w.planes, w.group_size, w.in_features) ==
                   (first.planes, first.group_size, first.in_features) for w in weights):
            return None
        widths = [w.packed.shape[0] for w in weights]
        fused = Int4Weight(torch.cat([w.packed for w in weights]), torch.cat([w.scale_zeros for w in weights], 1),
                           sum(widths), first.in_features, first.planes, first.group_size, first.block_n,
                           sum(w.source_bytes for w in weights))
        fused.source = first.source
        return fused, widths
    if all(isinstance(w, Int8Weight) and w.in_features == first.in_features for w in weights):
        fused = Int8Weight.__new__(Int8Weight)
        fused.q, fused.scale = torch.cat([w.q for w in weights]), torch.cat([w.scale for w in weights])
        fused.out_features, fused.in_features = fused.q.shape
        fused.source_bytes, fused.source = sum(w.source_bytes for w in weights), first.source
        return fused, [w.out_features for w in weights]
    return None


def kind(w: CPUWeight) -> str:
    if isinstance(w, NativeWeight):
        return f"native{w.bits}" + ("r" if w.rounded else "")
    return "int8" if isinstance(w, Int8Weight) else "int4" if w.planes == 1 else "int4x2"


def describe(kind: str) -> str:
    """What the packed form keeps exactly and what it rounds, per source format (for ModelInfo.notes)."""
    return {
        "int4": "int4 groups (codes exact, scales and zeros rounded to bfloat16)",
        "int4x2": "two int4 planes (codes exact, scales and zeros rounded to bfloat16)",
        "int8": "int8 per output row (rounded: groups under 32 are not the int4 kernel's)",
        "native4": "Roofline's CPU kernel, 4-bit codes (codes, scales and offsets exact; activations rounded to "
                   "int8 per 32)",
        "native5": "Roofline's CPU kernel, 5-bit codes (codes, scales and offsets exact; activations rounded to "
                   "int8 per 32)",
        "native6": "Roofline's CPU kernel, 6-bit codes (codes and their int8 scales per 16 exact; activations "
                   "rounded to int8 per 32)",
        "native8": "Roofline's CPU kernel, 8-bit codes (codes and scales exact; activations rounded to int8 per 32)",
        "native8r": "Roofline's CPU kernel, int8 per output row (rounded: groups under 32; activations rounded "
                    "to int8 per 32)",
    }[kind]
