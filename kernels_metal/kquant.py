"""y = x @ W.T for small M with W in GGUF k-quant blocks, dequantized inside the kernel.

Metal: `kquant_matmul.metal`. Reference: `reference.dequant_matmul_kquant` (dequantize, then
matmul in float32).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import mlx.core as mx

from kernels_metal import _backend, reference
from quant.formats import KQUANT_TYPES, QK_K, block_format

MAX_M = 8  # rows of x the kernel handles; the engine's prefill dequantizes and uses a GEMM
X_DTYPES = (mx.float16, mx.bfloat16, mx.float32)
NUM_SIMDGROUPS = 4
ROWS_PER_SIMDGROUP = 2

_SOURCE = _backend.load_source("kquant_matmul.metal")


def _build(factory: Callable[..., Any]) -> Any:
    return factory(
        name="dequant_matmul_kquant",
        input_names=["x", "w", "params"],
        output_names=["y"],
        source=_SOURCE,
    )


_METAL_KERNEL = _backend.build_metal(_build)


@functools.cache
def _interpret_kernel() -> Any:
    return _build(_backend.interpret_factory())


def _validate(x: Any, w_blocks: Any, ggml_type: Any, out_features: Any, in_features: Any) -> None:
    if not isinstance(ggml_type, str):
        raise TypeError(f"ggml_type: expected a type name such as 'Q4_K', got {type(ggml_type).__name__}")
    if ggml_type not in KQUANT_TYPES:
        raise ValueError(f"ggml_type: expected one of {KQUANT_TYPES}, got {ggml_type!r}")
    for name, v in (("out_features", out_features), ("in_features", in_features)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name}: expected a positive int, got {v!r}")
    if in_features % QK_K:
        raise ValueError(
            f"in_features: expected a multiple of {QK_K} (a super-block), got {in_features}"
        )
    if not isinstance(x, mx.array):
        raise TypeError(f"x: expected an mx.array, got {type(x).__name__}")
    if x.dtype not in X_DTYPES:
        raise TypeError(f"x: expected dtype in {[str(d) for d in X_DTYPES]}, got {x.dtype}")
    if x.ndim != 2 or x.shape[1] != in_features or not 1 <= x.shape[0] <= MAX_M:
        raise ValueError(f"x: expected shape (M, {in_features}) with 1 <= M <= {MAX_M}, got {tuple(x.shape)}")
    if not isinstance(w_blocks, mx.array):
        raise TypeError(f"w_blocks: expected an mx.array, got {type(w_blocks).__name__}")
    if w_blocks.dtype != mx.uint8:
        raise TypeError(f"w_blocks: expected dtype uint8 (the GGUF bytes), got {w_blocks.dtype}")
    bpb = block_format(ggml_type).block_bytes
    want = (out_features, in_features // QK_K * bpb)
    if tuple(w_blocks.shape) != want:
        raise ValueError(
            f"w_blocks: expected shape {want} ({ggml_type}: {bpb} bytes per 256 weights), "
            f"got {tuple(w_blocks.shape)}"
        )


def dequant_matmul_kquant(
    x: mx.array,
    w_blocks: mx.array,
    ggml_type: str,
    out_features: int,
    in_features: int,
    *,
    backend: _backend.Backend = "auto",
) -> mx.array:
    """y = x @ W.T, W (out_features, in_features) stored as GGUF k-quant super-blocks.

    x (M, in_features), 1 <= M <= 8, float16/bfloat16/float32; w_blocks uint8 (out_features,
    in_features // 256 * bytes per super-block), the tensor's bytes exactly as in the GGUF file;
    ggml_type one of "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K". Returns (M, out_features) in x's
    dtype for half-precision x, else float32; accumulation is float32. `backend` as in
    `paged_decode_attention`.
    """
    _validate(x, w_blocks, ggml_type, out_features, in_features)
    which = _backend.resolve(backend)
    if backend == "auto" and which != "reference" and self_check(which, x.dtype, ggml_type) is not None:
        which = "reference"  # the kernel failed on this machine: its twin computes the same product
    if which == "reference":
        return reference.dequant_matmul_kquant(x, w_blocks, ggml_type, out_features, in_features)
    return _launch(which, x, w_blocks, ggml_type, out_features, in_features)


def _launch(which: str, x: mx.array, w_blocks: mx.array, ggml_type: str, out_features: int,
            in_features: int) -> mx.array:
    """The kernel on `which` ("metal" or "interpret"), arguments validated."""
    if which == "interpret":
        kernel = _interpret_kernel()
    elif isinstance(_METAL_KERNEL, Exception):
        raise RuntimeError(f"mx.fast.metal_kernel could not build the kernel: {_METAL_KERNEL}")
    else:
        kernel = _METAL_KERNEL
    M = x.shape[0]
    out_dtype = x.dtype if x.dtype in (mx.float16, mx.bfloat16) else mx.float32
    rows_per_group = NUM_SIMDGROUPS * ROWS_PER_SIMDGROUP
    num_groups = -(-out_features // rows_per_group)
    (y,) = kernel(
        inputs=[x, w_blocks, mx.array([M, out_features, in_features], dtype=mx.int32)],
        template=[
            ("T", x.dtype),
            ("OutT", out_dtype),
            ("QTYPE", int(ggml_type[1])),
            ("NSG", NUM_SIMDGROUPS),
            ("R", ROWS_PER_SIMDGROUP),
        ],
        grid=(num_groups * NUM_SIMDGROUPS * 32, 1, 1),
        threadgroup=(NUM_SIMDGROUPS * 32, 1, 1),
        output_shapes=[(M, out_features)],
        output_dtypes=[out_dtype],
    )
    return y


# The self-check's tolerance, as the tests' (tests/test_kernels_kquant.py) with 8x headroom for a GPU's fast math:
# float32 accumulation in another order (1e-5 of the terms' scale) and half an ulp of a half-precision output.
# A broken kernel is off by the scale itself.
CHECK_HEADROOM = 8
CHECK_OUT_REL = {mx.float32: 0.0, mx.float16: 2.0**-11, mx.bfloat16: 2.0**-8}
CHECK_ROWS = 2  # one decode row would not exercise the kernel's loop over rows
CHECK_OUT = 2 * NUM_SIMDGROUPS * ROWS_PER_SIMDGROUP + 3  # two full threadgroups and a partial one


def self_check(backend: str, dtype: mx.Dtype, ggml_type: str) -> str | None:
    """Whether the kernel for this input dtype and k-quant type works on `backend` ("metal" or "interpret"): it
    compiles and matches the reference on a small case. Once per process and variant; None when it passed, else
    why not."""
    return _backend.self_check("dequant_matmul_kquant", backend, (str(dtype), ggml_type),
                               lambda: _probe(backend, dtype, ggml_type))


def _probe(backend: str, dtype: mx.Dtype, ggml_type: str) -> str | None:
    import numpy as np

    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (CHECK_OUT, block_format(ggml_type).block_bytes), dtype=np.uint8)
    for off in block_format(ggml_type).fp16_offsets():  # random bytes there could be inf or NaN
        d = (rng.standard_normal(CHECK_OUT) * 0.02).astype(np.float16)
        blocks[:, off:off + 2] = d.view(np.uint8).reshape(-1, 2)
    w = mx.array(blocks)
    x = mx.array(rng.standard_normal((CHECK_ROWS, QK_K)).astype(np.float32)).astype(dtype)
    got = _launch(backend, x, w, ggml_type, CHECK_OUT, QK_K).astype(mx.float32)
    want = reference.dequant_matmul_kquant(x, w, ggml_type, CHECK_OUT, QK_K).astype(mx.float32)
    weights = reference.dequantize_kquant(w, ggml_type, CHECK_OUT, QK_K)
    terms = mx.abs(x.astype(mx.float32)) @ mx.abs(weights).T  # the scale of the summed terms
    allowed = CHECK_HEADROOM * (1e-5 * terms.max() + CHECK_OUT_REL[dtype] * mx.abs(want))
    excess = mx.abs(got - want) - allowed
    mx.eval(got, want, excess)  # compiled and run now, not inside a later step
    if not float(excess.max()) <= 0:  # NaN fails too
        err = float(mx.abs(got - want).max())
        return f"its result differs from the reference by up to {err:.3g}, past the allowed rounding"
    return None
