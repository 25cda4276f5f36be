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

KQUANT_TYPES = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
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
    if in_features % reference.QK_K:
        raise ValueError(
            f"in_features: expected a multiple of {reference.QK_K} (a super-block), got {in_features}"
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
    bpb = reference.KQUANT_BLOCK_BYTES[ggml_type]
    want = (out_features, in_features // reference.QK_K * bpb)
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
    if which == "reference":
        return reference.dequant_matmul_kquant(x, w_blocks, ggml_type, out_features, in_features)
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
