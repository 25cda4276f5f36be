"""The packed CPU weights' prefill path (`cpu_packed`: `DEQUANT_MIN_ROWS` rows or more, on a CPU with bfloat16
dot products): each matmul dequantizes its weight to bfloat16 a slice of output rows at a time and multiplies the
slice by oneDNN's bfloat16 GEMM; the slice is dropped after (no float copy of a whole matrix outlives the call).

The dequantization of a slice is one C++ loop built by inductor (`torch.compile`, one graph per slice shape, its
own dynamo cache each): the codes read from the int4 kernel's packed bytes, times the group's scale plus its bias,
rounded to bfloat16 once. An int4 slice comes out transposed, (in, out): for each input, a block's 32 packed
bytes give its 64 outputs side by side (low nibbles, then high), so the loop is vector loads, shifts and FMAs
with no gather, and `x @ W.T` is a plain (rows, in) x (in, out) GEMM, as fast in oneDNN as the other layout.
Where torch.compile cannot build (no C++ compiler), the same function runs eagerly, a few times slower. A
`NativeWeight`'s slice is dequantized by Roofline's kernel library instead (`roofline_cpu::dequant`, bit for bit
`native_float` rounded to bfloat16): inductor's loop for its 4- and 5-bit codes took 7-10x the 8-bit one's time.

Numerics: the weight is the float32 dequantization (`Int4Weight.dequantized`) rounded to bfloat16 once; the two
planes of a 5-8 bit code are one integer here, q = c0 + 16 c1, so w = S q + B with S the first plane's scale and
B its zeros' sum less 8 scales a plane: the same value in float32 up to its last bit (FMA), so at most a rare bfloat16 tie
falls the other way. The GEMM then rounds the activations to bfloat16 and its float32 sums to bfloat16.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from mlx_engine.backends.torch.inductor import compile_errors, own_code, use_app_cache

if TYPE_CHECKING:
    from mlx_engine.backends.torch.cpu_native import NativeWeight
    from mlx_engine.backends.torch.cpu_packed import Int4Weight, Int8Weight

log = logging.getLogger(__name__)

SLICE_ELEMENTS = 2**21  # weights dequantized at once: 4 MiB of bfloat16
# Slices under this many weights dequantize eagerly: their loop is no faster compiled, and a compile (about a
# second each) would be paid for every small shape of a tiny model
COMPILE_MIN_ELEMENTS = 2**16
_eager_only = False  # set when torch.compile failed once here
_built: set[tuple] = set()  # the keys whose compiled function has run: an error after that is not a build's


# --- the prefill GEMM ------------------------------------------------------------------------------------


def int4_matmul(w: Int4Weight, x2: torch.Tensor) -> torch.Tensor:
    """x2 (rows, in) bfloat16 -> x2 @ W.T (rows, N padded to whole blocks) bfloat16."""
    n, k = w.packed.shape[0], w.in_features
    step = max(w.block_n, SLICE_ELEMENTS // k // w.block_n * w.block_n)  # bfloat16 out, whatever its planes
    outs = [torch.matmul(x2, _int4_slice(w, lo, min(n, lo + step))) for lo in range(0, n, step)]
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


def int8_matmul(w: Int8Weight, x2: torch.Tensor) -> torch.Tensor:
    """x2 (rows, in) bfloat16 -> x2 @ W.T (rows, out) bfloat16."""
    n, k = w.q.shape
    step = max(1, SLICE_ELEMENTS // k)
    outs = [F.linear(x2, _run(_int8_dequant, (hi - lo) * k, ("int8", hi - lo, k), w.q[lo:hi], w.scale[lo:hi]))
            for lo, hi in ((lo, min(n, lo + step)) for lo in range(0, n, step))]
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


def native_matmul(w: NativeWeight, x2: torch.Tensor) -> torch.Tensor:
    """x2 (rows, in) bfloat16 -> x2 @ W.T (rows, out) bfloat16."""
    n, k = w.out_features, w.in_features
    step = max(1, SLICE_ELEMENTS // k)
    outs = [F.linear(x2, native_slice(w, lo, min(n, lo + step))) for lo in range(0, n, step)]
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


def native_slice(w: NativeWeight, lo: int, hi: int) -> torch.Tensor:
    """Output rows [lo, hi) of `w` dequantized to bfloat16 by the kernel's library: (hi - lo, in)."""
    return torch.ops.roofline_cpu.dequant(w.codes[lo:hi], w.d[lo:hi], w.m[lo:hi] if w.m.numel() else w.m, w.bits,
                                          w.zero)


def _int4_slice(w: Int4Weight, lo: int, hi: int) -> torch.Tensor:
    """Output rows [lo, hi) of `w` dequantized to bfloat16, transposed: (in, hi - lo)."""
    key = ("int4", hi - lo, w.in_features, w.planes, w.group_size, w.block_n)
    return _run(_int4_dequant_t, (hi - lo) * w.in_features, key, w.packed[lo:hi], w.scale_zeros[:, lo:hi],
                w.planes, w.block_n)[0]


def _int4_dequant_t(packed: torch.Tensor, sz: torch.Tensor, planes: int, block_n: int):
    """packed (n, planes * in / 2) uint8 in the kernel's layout (whole blocks); sz (planes * groups, n, 2)
    bfloat16 -> (W.T (in, n) bfloat16, S, B). S and B (groups, n) float32 are outputs so that inductor writes
    them once rather than reloading a scale and a zero (stride 2) for every weight; S is a copy, not a view:
    returned as a view of the converted scales and zeros, it was read through a scalar stride-2 gather for each
    vector of weights (the slice's loop took 1.5x as long)."""
    n, k = packed.shape[0], packed.shape[1] * 2 // planes
    groups = sz.shape[0] // planes
    f = sz.float().view(planes, groups, n, 2)
    s = f[0, :, :, 0].clone()  # plane p's scale is 16^p of the first's
    b = (f[..., 1] - 8 * f[..., 0]).sum(0)  # (c_p - 8) S_p + Z_p summed: S q + B
    half = block_n // 2
    p = packed.view(n // block_n, planes, k, 1, half).permute(1, 2, 0, 3, 4)  # (planes, in, blocks, 1, half)
    shifts = torch.tensor([0, 4], dtype=torch.uint8, device=packed.device).view(1, 1, 2, 1)
    c = (p >> shifts) & 15  # (planes, in, blocks, 2, half): row j low nibble, row j + half high
    q = c[0] | (c[1] << 4) if planes == 2 else c[0]
    wt = q.reshape(groups, k // groups, n).float() * s[:, None] + b[:, None]
    return wt.to(torch.bfloat16).view(k, n), s, b


def _int8_dequant(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (q.float() * scale.float()[:, None]).to(torch.bfloat16)


def _run(fn: Callable, elements: int, key: tuple, *args):
    """fn(*args), compiled for this shape (`key`) where that pays and torch.compile builds here."""
    global _eager_only
    if torch.compiler.is_compiling() or _eager_only or elements < COMPILE_MIN_ELEMENTS:
        return fn(*args)  # inside a compiled prefill graph (`paths.compiled.CompiledHalves`) its loop is that graph's
    key = (*key, torch.get_num_threads())  # inductor's C++ loops are built for the thread count of their compile
    if key in _built:
        return _compiled(fn, key)(*args)
    try:  # the first call traces and builds: what fails there (no compiler, a failed build) is torch.compile's
        out = _compiled(fn, key)(*args)
    except compile_errors() as e:
        _eager_only = True
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        log.warning("torch.compile failed for the prefill's dequantization, which now runs eagerly (slower): %s",
                    first[:200])
        return fn(*args)
    _built.add(key)
    return out


@functools.cache
def _compiled(fn: Callable, key: tuple) -> Callable:
    """`fn` under torch.compile as a copy with its own code object, so that each shape keeps its one graph
    (dynamo caches graphs per code object, a few per object before it gives up on compiling)."""
    use_app_cache()
    return torch.compile(own_code(fn, "_".join(map(str, key))), dynamic=False, fullgraph=True)
