"""k-quant matmul: the reference dequantizer bit for bit against `gguf.quants.dequantize`, the
reference matmul against a float64 numpy product, the Metal source run by the interpreter against
the reference, and the argument checks.

This gguf version implements no k-quant quantizer, so weights are random bytes with the fp16 d
(and dmin) fields overwritten by finite values: every bit pattern of the other fields is valid.
Tolerance for y (float32 accumulation over K terms, summed in a different order): max abs error
<= 1e-5 * max(|x| @ |W|.T), the scale of the terms; float16/bfloat16 y adds half an ulp of the
output dtype (rel 2^-11 / 2^-8).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kernels_metal import _backend, dequant_matmul_kquant
from kernels_metal.reference import dequantize_kquant
from quant import KQUANT_TYPES, QK_K, block_bytes, dequantize
from tests.tiny_models import random_blocks

OUT_REL = {mx.float32: 0.0, mx.float16: 2.0**-11, mx.bfloat16: 2.0**-8}
DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}

needs_interpreter = pytest.mark.skipif(
    not _backend.interpret_available(),
    reason="kernels_metal.interpret (the Metal interpreter) is not importable yet",
)


def gguf_weights(w: np.ndarray, ggml_type: str) -> np.ndarray:
    """llama.cpp's values (`quant.dequantize`: gguf-py's)."""
    return dequantize(w, ggml_type, (w.shape[0], w.shape[1] // block_bytes(ggml_type) * QK_K))


def check_matmul(y: mx.array, x: mx.array, w: np.ndarray) -> None:
    """y against x @ w.T in float64; w is the float32 weights (out_features, in_features)."""
    xf = np.array(x.astype(mx.float32), dtype=np.float64)
    want = xf @ w.T.astype(np.float64)
    scale = float(np.max(np.abs(xf) @ np.abs(w.T.astype(np.float64)))) or 1.0
    got = np.array(y.astype(mx.float32), dtype=np.float64)
    tol = 1e-5 * scale + OUT_REL[x.dtype] * np.abs(want)
    err = np.abs(got - want)
    assert np.all(err <= tol), f"maxdiff {err.max():.3g}, tolerance {tol.max():.3g} ({x.dtype})"


@st.composite
def matmul_cases(draw, max_out: int = 40, max_blocks: int = 3):
    ggml_type = draw(st.sampled_from(KQUANT_TYPES))
    out_features = draw(st.integers(1, max_out))
    in_features = QK_K * draw(st.integers(1, max_blocks))
    M = draw(st.integers(1, 8))
    dtype = DTYPES[draw(st.sampled_from(list(DTYPES)))]
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    w = random_blocks(rng, ggml_type, out_features, in_features)
    x = mx.array(rng.standard_normal((M, in_features)).astype(np.float32)).astype(dtype)
    return x, w, ggml_type, out_features, in_features


# ---------------------------------------------------------------- reference


@settings(max_examples=30, deadline=None)
@given(
    ggml_type=st.sampled_from(KQUANT_TYPES),
    out_features=st.integers(1, 9),
    num_blocks=st.integers(1, 4),
    seed=st.integers(0, 2**31 - 1),
)
def test_dequantize_is_bit_exact_with_gguf(ggml_type, out_features, num_blocks, seed):
    in_features = QK_K * num_blocks
    w = random_blocks(np.random.default_rng(seed), ggml_type, out_features, in_features)
    got = np.array(dequantize_kquant(mx.array(w), ggml_type, out_features, in_features))
    want = gguf_weights(w, ggml_type)
    assert got.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("ggml_type", KQUANT_TYPES)
def test_dequantize_is_bit_exact_on_a_large_tensor(ggml_type):
    w = random_blocks(np.random.default_rng(0), ggml_type, 64, 4096)
    got = np.array(dequantize_kquant(mx.array(w), ggml_type, 64, 4096))
    np.testing.assert_array_equal(got.view(np.uint32), gguf_weights(w, ggml_type).view(np.uint32))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=matmul_cases())
def test_reference_matmul_matches_numpy(case):
    x, w, ggml_type, out_features, in_features = case
    y = dequant_matmul_kquant(x, mx.array(w), ggml_type, out_features, in_features, backend="reference")
    assert y.shape == (x.shape[0], out_features)
    assert y.dtype == (mx.float32 if x.dtype == mx.float32 else x.dtype)
    check_matmul(y, x, gguf_weights(w, ggml_type))


# ---------------------------------------------------------------- interpreter vs reference


@needs_interpreter
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=matmul_cases(max_out=20, max_blocks=3))
def test_interpreter_matches_reference(case):
    x, w, ggml_type, out_features, in_features = case
    wa = mx.array(w)
    got = dequant_matmul_kquant(x, wa, ggml_type, out_features, in_features, backend="interpret")
    ref = dequant_matmul_kquant(x, wa, ggml_type, out_features, in_features, backend="reference")
    assert got.dtype == ref.dtype and got.shape == ref.shape
    check_matmul(got, x, gguf_weights(w, ggml_type))


# Every type at least once, M from 1 to 8, an odd number of super-blocks (idle half simdgroup)
# and out_features that leave the last threadgroup partly empty.
@needs_interpreter
@pytest.mark.parametrize(
    "ggml_type, M, out_features, num_blocks, dtype",
    [
        ("Q4_K", 1, 9, 1, mx.float32),
        ("Q5_K", 8, 16, 2, mx.float16),
        ("Q6_K", 3, 13, 3, mx.float32),
        ("Q2_K", 5, 8, 2, mx.bfloat16),
        ("Q3_K", 2, 11, 1, mx.float32),
        ("Q4_K", 7, 17, 4, mx.float16),
        ("Q6_K", 8, 5, 2, mx.bfloat16),
    ],
)
def test_interpreter_covers_types(ggml_type, M, out_features, num_blocks, dtype):
    rng = np.random.default_rng(M * 31 + out_features)
    in_features = QK_K * num_blocks
    w = random_blocks(rng, ggml_type, out_features, in_features)
    x = mx.array(rng.standard_normal((M, in_features)).astype(np.float32)).astype(dtype)
    y = dequant_matmul_kquant(x, mx.array(w), ggml_type, out_features, in_features, backend="interpret")
    assert y.shape == (M, out_features) and y.dtype == (mx.float32 if dtype == mx.float32 else dtype)
    check_matmul(y, x, gguf_weights(w, ggml_type))


# ---------------------------------------------------------------- bad input


def args(**overrides) -> dict:
    rng = np.random.default_rng(1)
    base = dict(
        x=mx.zeros((2, 512)),
        w_blocks=mx.array(random_blocks(rng, "Q4_K", 3, 512)),
        ggml_type="Q4_K",
        out_features=3,
        in_features=512,
    )
    return {"backend": "reference", **base, **overrides}


@pytest.mark.parametrize(
    "overrides, error, words",
    [
        (dict(ggml_type="Q8_0"), ValueError, ["ggml_type", "Q4_K", "'Q8_0'"]),
        (dict(ggml_type="q4_k"), ValueError, ["ggml_type", "'q4_k'"]),
        (dict(ggml_type=12), TypeError, ["ggml_type", "int"]),
        (dict(x=mx.zeros((9, 512))), ValueError, ["x", "M <= 8", "(9, 512)"]),
        (dict(x=mx.zeros((0, 512))), ValueError, ["x", "1 <= M", "(0, 512)"]),
        (dict(x=mx.zeros((2, 256))), ValueError, ["x", "(M, 512)", "(2, 256)"]),
        (dict(x=mx.zeros((512,))), ValueError, ["x", "(512,)"]),
        (dict(x=mx.zeros((2, 512), dtype=mx.int32)), TypeError, ["x", "dtype", "int32"]),
        (dict(x=np.zeros((2, 512))), TypeError, ["x", "ndarray"]),
        (dict(w_blocks=mx.zeros((3, 288), dtype=mx.int8)), TypeError, ["w_blocks", "uint8", "int8"]),
        (dict(w_blocks=mx.zeros((3, 290), dtype=mx.uint8)), ValueError, ["w_blocks", "(3, 288)", "(3, 290)"]),
        (dict(ggml_type="Q6_K"), ValueError, ["w_blocks", "(3, 420)", "210 bytes", "(3, 288)"]),
        (dict(in_features=500), ValueError, ["in_features", "256", "500"]),
        (dict(out_features=0), ValueError, ["out_features", "0"]),
        (dict(backend="vulkan"), ValueError, ["backend", "vulkan"]),
    ],
)
def test_bad_input_raises(overrides, error, words):
    with pytest.raises(error) as info:
        dequant_matmul_kquant(**args(**overrides))
    for w in words:
        assert w in str(info.value), f"{w!r} not in {str(info.value)!r}"


def test_metal_kernel_is_built_at_import():
    from kernels_metal import kquant

    assert not isinstance(kquant._METAL_KERNEL, Exception)  # construction needs no device
