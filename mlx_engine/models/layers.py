"""Layer variants chosen per backend."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

# Rows (batch x tokens) from which a host GEMM beats MLX's CPU kernels: MLX's Linux CPU wheel links the
# reference (netlib) BLAS, whose sgemm ran at 1.8-2.5 GFLOP/s on the 2-core x86-64 box against 18 GFLOP/s
# for numpy's OpenBLAS, and its quantized matmul cost grows linearly with rows (1536x576 4-bit, 36 rows:
# 110 ms vs 9 ms dequantize + numpy). The host sync this needs costs nothing on the CPU backend; decode
# (few rows) keeps MLX's matvec, which for quantized layers reads 4-8x fewer bytes. Dequantizing every
# weight costs about 9 one-token forwards of SmolLM2 while MLX's quantized matmul grows ~0.6x per row, so
# the host path pays from ~16 rows (a speculative verify of 8-9 rows measured 9.6x one token with it).
HOST_GEMM_MIN_ROWS = 16


def _host_gemm(x: mx.array, w: mx.array) -> mx.array:
    """x (..., in) float32 @ w (out, in).T in numpy -> (..., out)."""
    rows = x.size // x.shape[-1]
    x2 = np.asarray(x.reshape(rows, x.shape[-1]))  # evaluates x
    with _one_blas_thread():
        y = x2 @ np.asarray(w).T
    return mx.array(y).reshape(*x.shape[:-1], -1)


_blas_limiter = None


def _one_blas_thread():
    """OpenBLAS's worker threads spin against MLX's CPU threads (and anything else on a small machine): a
    40-token SmolLM2 prefill took 6-10 s with numpy's default 2 threads on the loaded 2-core box and
    1.1-1.2 s with one."""
    global _blas_limiter
    if _blas_limiter is None:
        from threadpoolctl import ThreadpoolController

        _blas_limiter = ThreadpoolController()
    return _blas_limiter.limit(limits=1, user_api="blas")


class HostGemmLinear(nn.Linear):
    def __call__(self, x: mx.array) -> mx.array:
        if x.size // x.shape[-1] < HOST_GEMM_MIN_ROWS or x.dtype != mx.float32 or self.weight.dtype != mx.float32:
            return super().__call__(x)
        y = _host_gemm(x, self.weight)
        return y + self.bias if "bias" in self else y


class HostGemmQuantizedLinear(nn.QuantizedLinear):
    def __call__(self, x: mx.array) -> mx.array:
        if x.size // x.shape[-1] < HOST_GEMM_MIN_ROWS or x.dtype != mx.float32:
            return super().__call__(x)
        w = mx.dequantize(self.weight, self.scales, self.get("biases"), self.group_size, self.bits,
                          mode=self.mode).astype(mx.float32)  # (out, in)
        y = _host_gemm(x, w)
        return y + self.bias if "bias" in self else y


def use_host_gemm_for_prefill(model: nn.Module) -> int:
    """For MLX's CPU backend: prefill-sized matmuls go to numpy's BLAS. Returns how many layers switched."""
    n = 0
    for _, module in model.named_modules():
        if type(module) is nn.QuantizedLinear and getattr(module, "mode", "affine") == "affine":
            module.__class__ = HostGemmQuantizedLinear
            n += 1
        elif type(module) is nn.Linear:
            module.__class__ = HostGemmLinear
            n += 1
    return n
