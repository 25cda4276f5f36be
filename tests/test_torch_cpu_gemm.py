"""The packed CPU weights' prefill GEMM (`backends/torch/cpu_gemm.py`): per quantization type, as the loader holds
it, at the row counts that take the path, against the same weights dequantized in float32; each slice's bfloat16
weights against the float32 dequantization rounded once; slices, the eager twin.

Tolerances: the GEMM rounds its activations and weights to bfloat16 and its float32 sums to bfloat16, so the
outputs sit about half a bfloat16 step (2**-8 relative) of max |y| from the float32 ones: in tolerance.py's units
(eps32 x max |want|) a floor of 20,000-36,000 here (AMD EPYC, AVX-512; `ROOFLINE_TOL_LOG`), times HEADROOM. Another
CPU sums in another order and so rounds a few outputs the other way, one bfloat16 step of |y| at most: well inside.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tests.tolerance import HEADROOM, assert_f32_close
from tests.torch_support import require

torch = require("torch")

from mlx_engine.backends.torch import cpu_features, cpu_gemm, cpu_native, cpu_packed  # noqa: E402

pytestmark = pytest.mark.skipif(not cpu_features.cpu_support().bf16_gemm,
                                reason="this CPU has no bfloat16 dot products: prefills take the int4/int8 kernels")

N, K = 320, 512  # five blocks of 64 outputs; k-quants need whole 256-wide super-blocks
ROWS = (cpu_features.DEQUANT_MIN_ROWS, 128, 512)
# max |got - float32| / (eps32 max |float32|) measured per type at 48, 128 and 512 rows (the largest of the three)
FLOOR_UNITS = {"Q4_0": 27100, "Q4_1": 31900, "Q5_0": 30500, "Q5_1": 35700, "Q8_0": 29000, "Q4_K": 31600,
               "Q5_K": 29200, "Q6_K": 34000, "mlx4_g64": 28800, "mlx4_g128": 29100, "mlx8_g64": 29900,
               "mlx3_g32": 29600}
BF16_EPS = 2.0**-7


def _weight(kind: str, native: bool = False) -> cpu_packed.CPUWeight:
    """A random (N, K) matrix in format `kind`, converted by the loader's own functions: for torch's kernels, or
    with `native` for Roofline's (`cpu_native`)."""
    import mlx.core as mx

    from mlx_engine.backends.torch.weights import cpu_affine_weight, kquant_weight
    from quant.affine import affine_codes, affine_from_gguf

    support = dataclasses.replace(cpu_features.cpu_support(), native=native)
    rng = np.random.default_rng(sum(map(ord, kind)))
    if kind in ("Q4_K", "Q5_K", "Q6_K"):
        from tests.tiny_models import random_blocks

        blocks = random_blocks(rng, kind, N, K, std=0.02)
        return kquant_weight(mx.array(blocks), kind, torch.float32, torch.device("cpu"), True, support)
    w = (rng.standard_normal((N, K)) * 0.02).astype(np.float32)
    if kind.startswith("mlx"):
        bits, group = (int(x) for x in kind[3:].split("_g"))
        words, scales, biases = mx.quantize(mx.array(w), group_size=group, bits=bits)
        return cpu_affine_weight(words, scales, biases, bits, group, support)
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import quantize

    raw = quantize(w, GGMLQuantizationType[kind])
    if kind in ("Q5_0", "Q5_1"):
        q, scales, biases = affine_codes(raw, kind, (N, K))
        return cpu_packed.affine_weight(lambda lo, hi: q[lo:hi], scales, biases, q.shape, 5, 32, support)
    words, scales, biases, _ = affine_from_gguf(raw, kind, (N, K))
    return cpu_affine_weight(mx.array(words), mx.array(scales.astype(np.float16)),
                             mx.array(biases.astype(np.float16)), 8 if kind == "Q8_0" else 4, 32, support)


def _float32(w: cpu_packed.CPUWeight) -> torch.Tensor:
    if isinstance(w, cpu_packed.Int8Weight):
        return w.dequantized(torch.float32)
    return w.dequantized(dtype=torch.float32)[: w.out_features]


FOUR_BIT = ("Q4_0", "Q4_1", "Q4_K", "mlx4_g64", "mlx4_g128", "mlx3_g32")  # codes of 4 bits or fewer
FIVE_BIT = ("Q5_0", "Q5_1", "Q5_K")


@pytest.mark.parametrize("kind", list(FLOOR_UNITS))
def test_prefill_gemm_against_the_float32_weights(kind):
    w = _weight(kind)
    assert cpu_packed.kind(w) == ("int8" if kind == "Q6_K" else "int4" if kind in FOUR_BIT else "int4x2")
    _check_prefill(w, kind, torch.Generator().manual_seed(0))


@pytest.mark.parametrize("kind", list(FLOOR_UNITS))
def test_native_weights_prefill_through_the_same_gemm(kind):
    """Roofline's kernel's weights (`cpu_native`) take the same bfloat16 GEMM at a prefill's rows, their slices
    dequantized from their own codes: the same floors, and each output the float32 GEMM of the bfloat16 operands
    rounded once. Under the threshold they take the kernel (activations rounded to int8 per 32)."""
    assert cpu_native.build_error() == ""
    w = _weight(kind, native=True)
    assert cpu_packed.kind(w) == ("native6" if kind == "Q6_K" else "native4" if kind in FOUR_BIT
                                  else "native5" if kind in FIVE_BIT else "native8")
    g = torch.Generator().manual_seed(0)
    _check_prefill(w, kind, g)
    x = torch.randn(cpu_features.DEQUANT_MIN_ROWS - 1, K, generator=g)
    assert torch.equal(w.matmul(x), torch.ops.roofline_cpu.qmatmul(x, w.codes, w.d, w.m, w.bits, w.zero))


def _check_prefill(w: cpu_packed.CPUWeight, kind: str, g: torch.Generator) -> None:
    ref = _float32(w)
    for rows in ROWS:
        x = torch.randn(rows, K, generator=g)
        got = w.matmul(x)
        assert got.shape == (rows, N) and got.dtype == torch.float32
        assert_f32_close(got, x @ ref.T, FLOOR_UNITS[kind] * HEADROOM, f"{cpu_packed.kind(w)} {kind}, {rows} rows")
        # sharper: the float32 GEMM of the bfloat16 operands, rounded once to bfloat16
        exact = x.bfloat16().float() @ ref.bfloat16().float().T
        assert ((got - exact).abs() <= BF16_EPS / 2 * exact.abs() + 1e-6 * exact.abs().max()).all(), (kind, rows)


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0", "Q5_1", "mlx4_g128"])
def test_slices_are_the_float32_dequantization_rounded_once(kind):
    """Each slice's bfloat16 weights are the float32 dequantization rounded to bfloat16: every one equal
    (measured), a bfloat16 tie falling the other way (float32's last bit: an FMA) allowed one step in 10,000."""
    w = _weight(kind)
    want = w.dequantized()  # bfloat16 of the float32 values
    for lo, hi in ((0, N), (64, 192)):
        got = cpu_gemm._int4_slice(w, lo, hi).T
        assert got.shape == (hi - lo, K)
        differ = got != want[lo:hi]
        assert differ.float().mean() <= 1e-4, kind
        step = BF16_EPS * want[lo:hi].float().abs()
        assert ((got.float() - want[lo:hi].float()).abs() <= step).all(), kind


def test_many_slices_and_the_eager_twin(monkeypatch):
    """A matrix in several slices (the last partial, under the compiled size: eager) equals it in one slice, and
    the eager function (where torch.compile cannot build) gives the compiled one's weights."""
    w8 = _weight("Q8_0")
    w6 = _weight("Q6_K")
    x = torch.randn(64, K, generator=torch.Generator().manual_seed(1))
    whole = [w.matmul(x) for w in (w8, w6)]
    monkeypatch.setattr(cpu_gemm, "SLICE_ELEMENTS", 128 * K)  # 128 rows a slice: 128, 128, 64 (Q6_K's too)
    monkeypatch.setattr(cpu_gemm, "COMPILE_MIN_ELEMENTS", 100 * K)
    for w, y in zip((w8, w6), whole):  # the same weights and sums: at most a tie rounded the other way
        assert ((w.matmul(x) - y).abs() <= BF16_EPS * y.abs()).all()
    compiled = cpu_gemm._int4_slice(w8, 0, N)
    monkeypatch.setattr(cpu_gemm, "_eager_only", True)
    eager = cpu_gemm._int4_slice(w8, 0, N)
    assert (eager != compiled).float().mean() <= 1e-4
    assert ((eager.float() - compiled.float()).abs() <= BF16_EPS * compiled.float().abs()).all()


def test_a_build_failure_falls_back_once_and_a_later_error_is_raised(monkeypatch, caplog):
    """A compile that fails on a shape's first call makes the dequantization eager for good, with one warning; an
    error raised by a shape that has already run compiled is the call's own and propagates, leaving compiling on."""
    monkeypatch.setattr(cpu_gemm, "_built", set())
    monkeypatch.setattr(cpu_gemm, "_eager_only", False)
    calls = []

    def fn(x):
        calls.append("eager")
        return x + 1

    def failing_build(fn, key):
        raise RuntimeError("C++ compile error: no compiler\nmore lines")

    x = torch.zeros(4)
    monkeypatch.setattr(cpu_gemm, "_compiled", failing_build)
    with caplog.at_level("WARNING", logger=cpu_gemm.__name__):
        assert torch.equal(cpu_gemm._run(fn, 2**20, ("t", 1), x), x + 1)
    assert cpu_gemm._eager_only and calls == ["eager"]
    assert "torch.compile failed for the prefill's dequantization" in caplog.text and "no compiler" in caplog.text

    monkeypatch.setattr(cpu_gemm, "_eager_only", False)
    runs = []

    def built(fn, key):
        def run(x):
            runs.append(key)
            if len(runs) > 1:
                raise RuntimeError("DefaultCPUAllocator: not enough memory")
            return x + 2
        return run

    monkeypatch.setattr(cpu_gemm, "_compiled", built)
    assert torch.equal(cpu_gemm._run(fn, 2**20, ("t", 2), x), x + 2)
    with pytest.raises(RuntimeError, match="not enough memory"):
        cpu_gemm._run(fn, 2**20, ("t", 2), x)
    assert not cpu_gemm._eager_only and calls == ["eager"]
