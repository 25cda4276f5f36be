"""Roofline's own CPU matmul for quantized weights (`cpu_kernel/`), on any x86-64 CPU with AVX2.

torch's int4 kernel widens each weight to float32 before its FMA: on an AVX2 CPU without AVX-512 it reads 2.7-3 GB/s
of packed weights a core (docs/benchmarks/torch-cpu.md, "Issue 27 on an AVX2 CPU"), a third of the core's bandwidth,
and on an AVX-512 one it still takes 1.6x this kernel's time (8-bit codes, as two int4 planes: 3.3x; "Issue 27 on an
AVX-512 CPU with VNNI"). `NativeWeight` holds a matrix as its codes and, per block of 32 inputs, a scale and an
offset (w = d * c + m), and multiplies it the way llama.cpp does on such CPUs: the activations rounded to int8 per
block of 32 (max|x| / 127), integer products summed per block (VNNI's vpdpbusd where the CPU has it), scaled in
float32. A prefill's rows, on a CPU with bfloat16 dot products, dequantize to oneDNN's bfloat16 GEMM instead
(`cpu_features.DEQUANT_MIN_ROWS`, `cpu_gemm.native_matmul`), as torch's int4 weights do.

Codes are held 4 bits a weight (Q4_0, Q4_1, Q4_K, MLX 2-4 bit), 5 (Q5_0, Q5_1, Q5_K, MLX 5-bit: as GGML stores
Q5_0, the low 4 bits and a word of fifth bits a block, 37% fewer bytes a token than as int8), 6 (Q6_K, with its
int8 scale per 16 and a float16 one per super-block: 6.56 bits a weight where int8 rows took 8.5) or 8 (the rest).

Numerics: codes, scales and offsets are exact (float16 where every value of the matrix is, else float32); the
activations' int8 rounding is the one rounded step, as in llama.cpp's q8_0 dot products. The output head's top
logits are recomputed in float32 from exact rows (`cpu_packed.head_matmul`).

The same library holds `forward_layers`: a forward's layers (norms, rope, the paged pools' K/V written
and attended, the MLP) in one call around these matmuls, which `native_step` lays the model out for.

The library is built at the first load with the system's C++ compiler against the installed torch (about 30 s),
into the app's cache under a hash of the source, the flags (this CPU's VNNI among them) and torch's version, and
loaded from there after; where it cannot be built, torch's kernel is used and the load says why (`build_error`).
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from mlx_engine.backends.torch import cpu_features, cpu_gemm, switches

KERNEL_DIR = Path(__file__).with_name("cpu_kernel")
SOURCE = KERNEL_DIR / "cpu_native.cpp"  # the translation unit: it includes every part (cpu_kernel/*.h)
_BITS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)  # a byte's bits, low first
QK = 32  # inputs a block
# -ffp-contract=off: a product and a sum stay two roundings where written so (`dequant`: torch's order, bit for bit)
FLAGS = ("-O3", "-std=c++20", "-ffp-contract=off", "-shared", "-fPIC", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-w")
# The integer dot product in one instruction (vpdpbusd) where the CPU has it, 256 bits wide; with AVX-512 (BW for
# its byte ops) 4-bit codes also four blocks a 512-bit register
VNNI_FLAGS = {"avx512_vnni": ("-mavx512f", "-mavx512vl", "-mavx512bw", "-mavx512vnni"), "avx_vnni": ("-mavxvnni",)}


@functools.cache
def flags() -> tuple[str, ...]:
    """FLAGS and this CPU's VNNI flags (AVX512-VNNI with AVX512VL and BW, else AVX-VNNI), if any."""
    have = cpu_features.cpu_flags()
    if {"avx512_vnni", "avx512vl", "avx512bw"} <= have:
        return FLAGS + VNNI_FLAGS["avx512_vnni"]
    return FLAGS + VNNI_FLAGS["avx_vnni"] if "avx_vnni" in have else FLAGS


def _command(cxx: str, out: Path) -> list[str]:
    root = Path(torch.__file__).parent
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [cxx, *flags(), f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-I{root / 'include'}",
            f"-I{root / 'include' / 'torch' / 'csrc' / 'api' / 'include'}", str(SOURCE), "-o", str(out),
            f"-L{root / 'lib'}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{root / 'lib'}"]


def sources() -> list[Path]:
    """The library's sources: the translation unit and every part it includes, by name (the build's cache key)."""
    return sorted(p for p in KERNEL_DIR.iterdir() if p.suffix in (".cpp", ".h"))


def library_path() -> Path:
    from mlx_engine.paths import cache_dir

    key = hashlib.sha256(b"".join(p.name.encode() + p.read_bytes() for p in sources()) + " ".join(flags()).encode()
                         + torch.__version__.encode()).hexdigest()
    return cache_dir() / "torch-native" / key[:16] / "roofline_cpu.so"


@functools.cache
def build_error() -> str:
    """'' once the library is loaded (built first if its cache has none); else why it is not, in a line."""
    path = library_path()
    if not path.exists():
        cxx = switches.cxx() or shutil.which("c++") or shutil.which("g++")
        if cxx is None:
            return "no C++ compiler (c++, g++ or $CXX) to build Roofline's CPU kernel"
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:  # built apart, then renamed: never half a file
            out = Path(tmp) / path.name
            try:
                done = subprocess.run(_command(cxx, out), capture_output=True, text=True, timeout=600)
            except (OSError, subprocess.TimeoutExpired) as e:
                return f"building Roofline's CPU kernel failed: {e}"
            if done.returncode != 0:
                last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
                return f"building Roofline's CPU kernel with {cxx} failed: {last}"
            os.replace(out, path)
    try:
        torch.ops.load_library(str(path))
    except (OSError, RuntimeError) as e:
        return f"loading Roofline's CPU kernel ({path}) failed: {str(e).splitlines()[0]}"
    torch.library.register_fake("roofline_cpu::qmatmul")(_fake_qmatmul)
    torch.library.register_fake("roofline_cpu::dequant")(_fake_dequant)
    torch.library.register_fake("roofline_cpu::head_logits")(_fake_head_logits)
    return ""


def _fake_qmatmul(x: torch.Tensor, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bits: int,
                  zero: int = 0) -> torch.Tensor:
    return x.new_empty((x.shape[0], codes.shape[0]), dtype=torch.float32)


def _fake_head_logits(x: torch.Tensor, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bits: int, zero: int,
                      top: int) -> torch.Tensor:
    return x.new_empty((x.shape[0], codes.shape[0]), dtype=torch.float32)


def _fake_dequant(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bits: int, zero: int = 0) -> torch.Tensor:
    return d.new_empty((codes.shape[0], scale_blocks(d) * QK), dtype=torch.bfloat16)


def _with_supers(low: np.ndarray, supers: np.ndarray) -> torch.Tensor:
    """A row's scales `low` (n, s) then its supers' float16 bytes, in low's dtype."""
    high = np.ascontiguousarray(supers.astype(np.float16)).view(low.dtype).reshape(low.shape[0], -1)
    return torch.from_numpy(np.concatenate([low, high], axis=1))


def two_level(scales: np.ndarray, supers: np.ndarray) -> torch.Tensor:
    """A k-quant's scales as the kernel holds them (cpu_kernel/formats.h): scales (n, nb) integers in
    [0, 256), supers (n, nb / 8) float16 values -> (n, nb + nb / 4) uint8, a row's scales then its supers' bytes."""
    return _with_supers(np.ascontiguousarray(scales, dtype=np.uint8), supers)


def halves(sc: np.ndarray, supers: np.ndarray) -> torch.Tensor:
    """Q6_K's scales as the kernel holds them: sc (n, in / 16) int8, supers (n, in / 256) float16 values ->
    (n, in / 16 + in / 128) int8, a row's scales then its supers' bytes."""
    return _with_supers(np.ascontiguousarray(sc, dtype=np.int8), supers)


def scale_blocks(d: torch.Tensor) -> int:
    """Blocks of 32 a row of scales `d` covers (two-level uint8 rows hold nb + nb / 4 bytes, Q6_K's int8 ones
    2 nb + nb / 4)."""
    if d.dtype == torch.int8:
        return d.shape[1] * 4 // 9
    return d.shape[1] * 4 // 5 if d.dtype == torch.uint8 else d.shape[1]


def scales_f32(d: torch.Tensor) -> torch.Tensor:
    """Scales or offsets (n, nb) float32: two-level uint8 rows multiplied out (exact), others widened; Q6_K's
    int8 rows (n, 2 nb), a scale a half block."""
    if d.dtype == torch.int8:
        nb = scale_blocks(d)
        supers = d[:, 2 * nb:].contiguous().view(torch.float16).float()
        return d[:, : 2 * nb].float() * supers.repeat_interleave(16, dim=1)
    if d.dtype != torch.uint8:
        return d.float()
    nb = scale_blocks(d)
    supers = d[:, nb:].contiguous().view(torch.float16).float()
    return d[:, :nb].float() * supers.repeat_interleave(8, dim=1)


def native_float(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, bits: int,
                 zero: int = 0) -> torch.Tensor:
    """A `NativeWeight`'s rows: codes (r, in / 2) uint8 (two 4-bit codes a byte: code j low, j + 16 high), that
    and a 32-bit word of fifth bits a block (5-bit codes, (r, in / 2 + in / 8)), or 8 bytes a block of top bits
    (6-bit codes, (r, in / 2 + in / 4)), or (r, in) int8; d, m (r, in / 32) float, or two-level uint8 rows, or
    Q6_K's int8 rows (a scale per 16) -> (r, in) float32, d (c - zero) + m (6-bit: d (c - 32))."""
    r = codes.shape[0]
    d, m = scales_f32(d), None if m is None else scales_f32(m)
    if bits == 6:
        nb = d.shape[1] // 2
        b = codes[:, : nb * 16].reshape(r, nb, 16)
        top = codes[:, nb * 16:].reshape(r, nb, 1, 8) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8)[:, None]
        c = (torch.cat([b & 15, b >> 4], dim=-1) | ((top & 3) << 4).reshape(r, nb, 32)).float() - 32
        return (c.view(r, nb, 2, 16) * d.view(r, nb, 2, 1)).reshape(r, -1)
    if bits in (4, 5):
        nb = d.shape[1]
        b = codes[:, : nb * 16].reshape(r, nb, 16)
        c = torch.cat([b & 15, b >> 4], dim=-1)  # (r, blocks, 32)
        if bits == 5:
            h = codes[:, nb * 16:].reshape(r, nb, 4, 1)
            c = c | ((h & _BITS.to(codes.device)) != 0).to(torch.uint8).reshape(r, nb, 32) << 4
        c = c.float()
    else:
        c = codes.view(r, -1, 32).float()
    if zero:
        c = c - zero
    w = c * d.float()[..., None]
    if m is not None:
        w = w + m.float()[..., None]
    return w.reshape(r, -1)


ROW_BYTES = {4: lambda k: k // 2, 5: lambda k: k // 2 + k // 8, 6: lambda k: k // 2 + k // 4, 8: lambda k: k}
# Codes converted at once (a few MB of uint8: the transients, several times that, are a slice's, not a matrix's)
FROM_AFFINE_ELEMENTS = 1 << 21


def _pack_codes(codes: Callable[[int, int], np.ndarray], n: int, k: int, held: int, shift: int) -> torch.Tensor:
    """Rows' integer codes (codes(lo, hi), FROM_AFFINE_ELEMENTS at a time) in the kernel's layout for `held` bits:
    4-bit nibbles, 5-bit nibbles and words of fifth bits, 6-bit nibbles and 8 bytes a block of top bits, or int8
    (the codes less `shift`)."""
    out = torch.empty((n, ROW_BYTES[held](k)), dtype=torch.int8 if held == 8 else torch.uint8)
    step = max(1, FROM_AFFINE_ELEMENTS // k)
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        c = np.asarray(codes(lo, hi))
        if held == 8:
            out[lo:hi] = torch.from_numpy((c.astype(np.int16) - shift).astype(np.int8))
            continue
        blocks = c.astype(np.uint8).reshape(hi - lo, k // QK, QK)
        nibbles = ((blocks[..., :16] & 15) | ((blocks[..., 16:] & 15) << 4)).reshape(hi - lo, k // 2)
        if held == 4:
            out[lo:hi] = torch.from_numpy(nibbles)
        elif held == 6:  # byte i of a block: the top 2 bits of codes i, i + 8, i + 16, i + 24, low first
            top = (blocks >> 4).reshape(hi - lo, k // QK, 4, 8)
            packed = top[:, :, 0] | (top[:, :, 1] << 2) | (top[:, :, 2] << 4) | (top[:, :, 3] << 6)
            out[lo:hi] = torch.from_numpy(np.concatenate([nibbles, packed.reshape(hi - lo, k // 4)], axis=1))
        else:
            words = np.packbits(blocks >> 4, axis=-1, bitorder="little").reshape(hi - lo, k // 8)
            out[lo:hi] = torch.from_numpy(np.concatenate([nibbles, words], axis=1))
    return out


class NativeWeight:
    """A quantized matrix (out, in) for `roofline_cpu::qmatmul`: codes (out, in / 2) uint8, two 4-bit codes a
    byte (byte j of a block: code j low, code j + 16 high); 5-bit codes (out, in / 2 + in / 8) uint8, their low 4
    bits so, then a little-endian 32-bit word a block of their fifth bits (bit j: code j's), as GGML's Q5_0 and
    Q5_1 store them; or (out, in) int8; d and m (out, in / 32) float16 or float32, m empty where every offset
    is 0 or -zero d (`zero`: symmetric 4- and 5-bit codes, w = d (c - zero), Q4_0's and Q5_0's), or both in two
    levels (`from_kquant`: uint8 rows, `two_level`)."""

    def __init__(self, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bits: int, out_features: int,
                 in_features: int, source_bytes: int = 0, zero: int = 0):
        self.codes, self.d, self.m, self.bits, self.zero = codes, d, m, bits, zero
        self.out_features, self.in_features = out_features, in_features
        self.source_bytes, self.source = source_bytes, f"{bits}-bit"
        self.rounded = False  # its codes are a float matrix rounded to int8 rows (`from_int8_rows`)

    @classmethod
    def from_affine_rows(cls, codes: Callable[[int, int], np.ndarray], scales: np.ndarray, biases: np.ndarray,
                         shape: tuple[int, int], bits: int, group_size: int) -> NativeWeight:
        """codes(lo, hi): rows [lo, hi)'s integers in [0, 2**bits); scales, biases (out, in / group) float32:
        w = scales * codes + biases per group (a multiple of 32). Codes of up to 4 bits are held as 4-bit
        codes and 5-bit ones (Q5_0, Q5_1, Q5_K) as 5-bit codes, offsets the biases, or a zero point where the
        biases are -2**(bits-1) scales (Q4_0, Q5_0: no offsets' bytes, 10% fewer a block); wider ones as int8:
        a symmetric matrix (Q8_0) as its signed codes without offsets, others as their codes (6 or 7 bits) with
        the biases, or (8-bit affine) codes less 128 with biases + 128 scales, which rounds an offset in
        float32's last bit."""
        n, k = shape
        s = np.asarray(scales, np.float32)
        b = np.asarray(biases, np.float32)
        rep = group_size // QK
        off = 2.0 ** (bits - 1)
        shift = zero = 0
        symmetric = np.array_equal(b, np.float32(-off) * s)
        if symmetric and bits <= 5:  # a zero point: unsigned codes, no offsets' bytes
            zero, b = int(off), None
        elif symmetric:  # signed int8 codes
            shift, b = int(off), None
        elif bits == 8:
            shift, b = 128, b + np.float32(128) * s
        d, m = np.repeat(s, rep, axis=1), None if b is None else np.repeat(b, rep, axis=1)
        exact16 = all(a is None or np.array_equal(a.astype(np.float16).astype(np.float32), a) for a in (d, m))
        dtype = np.float16 if exact16 else np.float32
        held = 8 if bits > 5 else 5 if bits == 5 else 4
        out = _pack_codes(codes, n, k, held, shift)
        mt = torch.empty(0, dtype=torch.float16 if exact16 else torch.float32)
        if m is not None and np.any(m):
            mt = torch.from_numpy(np.ascontiguousarray(m.astype(dtype)))
        return cls(out, torch.from_numpy(np.ascontiguousarray(d.astype(dtype))), mt, held, n, k, zero=zero)

    @classmethod
    def from_kquant(cls, codes: Callable[[int, int], np.ndarray], d: np.ndarray, dmin: np.ndarray, sc: np.ndarray,
                    mn: np.ndarray, shape: tuple[int, int], bits: int) -> NativeWeight:
        """A Q4_K or Q5_K matrix (`quant.kquant.kquant_scales`' d, dmin, sc, mn; codes(lo, hi) its
        rows' integers) with its scales in two levels, as the file holds them: a block's 6-bit scale and offset
        a byte each, a super-block's d and -dmin a float16 each (148 bytes a Q4_K super-block of 144, where
        float32 scales and offsets a block took 192). The products are exact in float32: the same weights."""
        n, k = shape
        return cls(_pack_codes(codes, n, k, bits, 0), two_level(sc, d), two_level(mn, -dmin), bits, n, k)

    @classmethod
    def from_q6k(cls, codes: Callable[[int, int], np.ndarray], sc: np.ndarray, d: np.ndarray,
                 shape: tuple[int, int]) -> NativeWeight:
        """A Q6_K matrix as the file holds it: codes(lo, hi) its rows' integers in [0, 64), sc (out, in / 16) its
        int8 scales, d (out, in / 256) its float16 super-block scales; w = d sc (c - 32), each product exact in
        float32 (`kernels_metal.reference.dequantize_kquant`'s values bit for bit)."""
        n, k = shape
        return cls(_pack_codes(codes, n, k, 6, 0), halves(sc, d), torch.empty(0, dtype=torch.float32), 6, n, k)

    @classmethod
    def from_int8_rows(cls, q: torch.Tensor, scale: torch.Tensor, source_bytes: int = 0) -> NativeWeight:
        """An int8 matrix with one scale per output row (`cpu_packed.Int8Weight`'s rounding), its scale
        repeated per block: in float16 where every row's (bfloat16) is exactly a float16, half the bytes."""
        n, k = q.shape
        wide = scale.float()
        exact16 = bool(torch.equal(wide.half().float(), wide))
        d = (wide.half() if exact16 else wide)[:, None].expand(n, k // QK).contiguous()
        w = cls(q.contiguous(), d, torch.empty(0, dtype=torch.float32), 8, n, k, source_bytes)
        w.rounded = True
        return w

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., in) -> x @ W.T (..., out) in x's dtype."""
        x2 = x.reshape(-1, x.shape[-1])
        if x2.shape[0] >= cpu_features.DEQUANT_MIN_ROWS and cpu_features.bf16_gemm():
            y = cpu_gemm.native_matmul(self, x2.to(torch.bfloat16))
        else:
            y = torch.ops.roofline_cpu.qmatmul(x2, self.codes, self.d, self.m, self.bits, self.zero)
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def _float(self, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
        return native_float(codes, d, m, self.bits, self.zero)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Dequantized rows `ids` (an embedding lookup): ids (...) -> (..., in) float32."""
        flat = ids.reshape(-1)
        m = self.m[flat] if self.m.numel() else None
        return self._float(self.codes[flat], self.d[flat], m).reshape(*ids.shape, self.in_features)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self._float(self.codes, self.d, self.m if self.m.numel() else None).to(dtype)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.d, self.m))

    @property
    def num_parameters(self) -> int:
        return self.out_features * self.in_features


def fuse(weights: list[NativeWeight]) -> NativeWeight | None:
    """Matrices of one input side by side (q/k/v, gate/up), when their codes share a width: scales widened
    to float32 if their dtypes differ, zero offsets where a part has none, a zero point's offsets (-zero d)
    written out where the parts' zero points differ."""
    first = weights[0]
    if not all(isinstance(w, NativeWeight) and (w.bits, w.in_features, w.rounded) ==
               (first.bits, first.in_features, first.rounded)
               for w in weights):
        return None
    dtype = first.d.dtype if all(w.d.dtype == first.d.dtype for w in weights) else torch.float32

    def held(t: torch.Tensor) -> torch.Tensor:  # two-level rows kept where every part has them, else float32
        return t if t.dtype == dtype else scales_f32(t).to(dtype)

    d = torch.cat([held(w.d) for w in weights])
    zero = first.zero if all(w.zero == first.zero and not w.m.numel() for w in weights) else 0
    if any(w.m.numel() for w in weights) or any(w.zero != zero for w in weights):
        m = torch.cat([held(w.m) if w.m.numel() else held(-w.zero * scales_f32(w.d)) for w in weights])
    else:
        m = torch.empty(0, dtype=dtype)
    fused = NativeWeight(torch.cat([w.codes for w in weights]), d, m, first.bits, sum(w.out_features for w in weights),
                         first.in_features, sum(w.source_bytes for w in weights), zero=zero)
    fused.source, fused.rounded = first.source, first.rounded
    return fused
