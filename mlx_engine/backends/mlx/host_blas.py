"""Matmuls on the host's BLAS for MLX's CPU backend (Linux, or a Mac without Metal).

MLX's Linux CPU wheel links the reference (netlib) BLAS, several times slower than numpy's OpenBLAS, and its quantized
matmul is compute-bound, so a token's quantized matvecs cost several times numpy's float32 GEMVs (the readings:
docs/benchmarks/code-figures.md, "Measurements moved out of the code"). So on the CPU backend:

- resident weights (`use_host_weights`): when float32 copies of the model's projections fit the memory
  rule (`host_weights_fit`), every projection, at every row count, runs as one numpy GEMM on a float32
  weight kept transposed (in, out), dequantized once at load. q, k and v share one GEMM, gate and up
  another (fewer MLX evaluations: each host call first evaluates MLX's pending graph), and a tied
  head multiplies the embedding's float32 copy. This trades memory (float32 is 6-7x a 4-bit weight) for
  speed on a machine where decode is compute-bound, not bandwidth-bound;
- otherwise prefill-sized matmuls (HOST_GEMM_MIN_ROWS rows and more) dequantize each weight per call and
  multiply in numpy, and decode keeps MLX's quantized matvec, which reads 4-8x fewer bytes.

On a Mac with Metal none of this is used: MLX's own kernels are the fast path there.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlx_engine.switches import CPU_FP32_WEIGHTS

# Rows from which dequantize-per-call + numpy beats MLX's quantized matmul (no resident weights):
# dequantizing every weight costs about 9 one-token forwards of SmolLM2 while MLX's quantized matmul
# grows ~0.6x per row, so the host path pays from ~16 rows.
HOST_GEMM_MIN_ROWS = 16

# Resident float32 weights may take at most this share of the RAM free at load.
HOST_WEIGHTS_MEMORY_FRACTION = 0.5
HOST_WEIGHTS_ENV = CPU_FP32_WEIGHTS.name  # auto (default) | on | off


# --- one BLAS thread while the engine computes ---

_local = threading.local()
_blas_controller = None


@contextmanager
def one_blas_thread() -> Iterator[None]:
    """OpenBLAS's worker threads spin against MLX's CPU threads (and anything else on a small machine): a
    40-token SmolLM2 prefill took 6-10 s with numpy's default 2 threads on the loaded 2-core box and
    1.1-1.2 s with one. Setting the limit costs ~33 us, so the engine enters this once per scheduler step
    and the host GEMMs inside reuse it; a GEMM called outside sets it for itself."""
    global _blas_controller
    depth = getattr(_local, "depth", 0)
    if depth:
        _local.depth = depth + 1
        try:
            yield
        finally:
            _local.depth = depth
        return
    if _blas_controller is None:
        from threadpoolctl import ThreadpoolController

        _blas_controller = ThreadpoolController()
    with _blas_controller.limit(limits=1, user_api="blas"):
        _local.depth = 1
        try:
            yield
        finally:
            _local.depth = 0


# OpenBLAS's sgemm packs the whole weight for any row count, so a few rows cost several times one row's gemv. Up
# to GEMV_MAX_ROWS rows, one gemv per row over column slices that stay in cache reads each weight from memory once
# (the readings: docs/benchmarks/code-figures.md, "Measurements moved out of the code").
GEMV_MAX_ROWS = 8
GEMV_SLICE_BYTES = 4 * 2**20  # a column slice of the weight: well inside a server CPU's L3


def _host_gemm(x: mx.array, w_in_out: np.ndarray, bias: np.ndarray | None = None) -> mx.array:
    """x (..., in) float32 @ w (in, out) in numpy [+ bias] -> (..., out). Evaluates x."""
    rows = x.size // x.shape[-1]
    x2 = np.asarray(x.reshape(rows, x.shape[-1]))
    with one_blas_thread():
        y = _gemv_rows(x2, w_in_out) if 1 < rows <= GEMV_MAX_ROWS else x2 @ w_in_out
    if bias is not None:
        y += bias
    return mx.array(y).reshape(*x.shape[:-1], -1)


def _gemv_rows(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x (rows, in) @ w (in, out) as one gemv per row and column slice: each slice is read from memory once
    and from cache by the other rows."""
    out = np.empty((x.shape[0], w.shape[1]), np.float32)
    step = max(1, GEMV_SLICE_BYTES // (4 * w.shape[0]))
    for c in range(0, w.shape[1], step):
        ws = w[:, c:c + step]
        for i in range(x.shape[0]):
            np.matmul(x[i], ws, out=out[i, c:c + step])
    return out


def _float32_in_out(module: nn.Module) -> np.ndarray:
    """A Linear's or an Embedding's weight as a float32 (in, out) numpy matrix: a view of a float32
    weight, else a new dequantized or cast copy (made C-contiguous: rows of `in` read in order)."""
    if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
        w = mx.dequantize(module.weight, module.scales, module.get("biases"), module.group_size, module.bits,
                          mode=module.mode).astype(mx.float32)
        return np.ascontiguousarray(np.asarray(w).T)
    w = module.weight
    if w.dtype == mx.float32:
        return np.asarray(w).T  # a view: numpy hands BLAS the transposed flag
    return np.ascontiguousarray(np.asarray(w.astype(mx.float32)).T)


# --- per-call host GEMM for prefill-sized inputs (no resident weights) ---

class HostGemmLinear(nn.Linear):
    def __call__(self, x: mx.array) -> mx.array:
        if x.size // x.shape[-1] < HOST_GEMM_MIN_ROWS or x.dtype != mx.float32 or self.weight.dtype != mx.float32:
            return super().__call__(x)
        y = _host_gemm(x, np.asarray(self.weight).T)
        return y + self.bias if "bias" in self else y


class HostGemmQuantizedLinear(nn.QuantizedLinear):
    def __call__(self, x: mx.array) -> mx.array:
        if x.size // x.shape[-1] < HOST_GEMM_MIN_ROWS or x.dtype != mx.float32:
            return super().__call__(x)
        y = _host_gemm(x, _float32_in_out(self))
        return y + self.bias if "bias" in self else y


def use_host_gemm_for_prefill(model: nn.Module) -> int:
    """Prefill-sized matmuls go to numpy's BLAS. Returns how many layers switched."""
    n = 0
    for _, module in model.named_modules():
        if type(module) is nn.QuantizedLinear and getattr(module, "mode", "affine") == "affine":
            module.__class__ = HostGemmQuantizedLinear
            n += 1
        elif type(module) is nn.Linear:
            module.__class__ = HostGemmLinear
            n += 1
    return n


# --- resident float32 weights ---

class HostProjection:
    """One or more projections of the same input as a single numpy GEMM on a resident float32 (in, sum of
    outs) weight; returns one mx array per projection."""

    fallback: type | None = None  # a swapped module's own class, for inputs the host path does not take

    def __init__(self, modules: list[nn.Module]):
        mats = [_float32_in_out(m) for m in modules]
        self.weight = mats[0] if len(mats) == 1 else np.concatenate(mats, axis=1)
        self.splits = np.cumsum([m.shape[1] for m in mats])[:-1].tolist()
        biases = [np.asarray(m.bias.astype(mx.float32)) if "bias" in m else np.zeros(w.shape[1], np.float32)
                  for m, w in zip(modules, mats)]
        self.bias = None
        if any("bias" in m for m in modules):
            self.bias = biases[0] if len(biases) == 1 else np.concatenate(biases)

    @property
    def copied(self) -> bool:
        """Whether the weight is a new float32 copy (else a view of a float32 MLX weight)."""
        return self.weight.flags.owndata

    @property
    def nbytes(self) -> int:
        """Bytes this object allocated (views of float32 MLX arrays count 0)."""
        return sum(a.nbytes for a in (self.weight, self.bias) if a is not None and a.flags.owndata)

    def __call__(self, x: mx.array) -> tuple[mx.array, ...]:
        y = _host_gemm(x, self.weight, self.bias)
        return tuple(mx.split(y, self.splits, axis=-1)) if self.splits else (y,)


class ResidentLinear(nn.Linear):
    """A Linear (or QuantizedLinear, by class swap) whose calls use its resident `host` projection."""

    host: HostProjection

    def __call__(self, x: mx.array) -> mx.array:
        if x.dtype != mx.float32:
            return self.host.fallback.__call__(self, x)
        return self.host(x)[0]


class ResidentEmbedding(nn.Embedding):
    """An embedding whose `as_linear` (a tied head) multiplies a resident float32 (hidden, vocab) copy;
    lookups stay on MLX."""

    host: HostProjection

    def __call__(self, x: mx.array) -> mx.array:
        return self.host.fallback.__call__(self, x)

    def as_linear(self, x: mx.array) -> mx.array:
        if x.dtype != mx.float32:
            return self.host.fallback.as_linear(self, x)
        return self.host(x)[0]


def _resident_candidates(model: nn.Module) -> tuple[list[tuple[nn.Module, str, list[nn.Module]]], list[nn.Module]]:
    """(fused groups: (owner, attribute, modules)), lone projections) to make resident."""
    groups, grouped = [], set()
    for _, m in model.named_modules():
        names = None
        if all(hasattr(m, a) for a in ("q_proj", "k_proj", "v_proj")) and hasattr(type(m), "fused_qkv"):
            names, attr = ("q_proj", "k_proj", "v_proj"), "fused_qkv"
        elif all(hasattr(m, a) for a in ("gate_proj", "up_proj")) and hasattr(type(m), "fused_gate_up"):
            names, attr = ("gate_proj", "up_proj"), "fused_gate_up"
        if names is None:
            continue
        mods = [getattr(m, a) for a in names]
        if all(_quantized_affine(p) for p in mods):  # float32 weights fuse only by copying: keep them as views
            groups.append((m, attr, mods))
            grouped.update(id(p) for p in mods)
    lone = [m for _, m in model.named_modules()
            if id(m) not in grouped and (_quantized_affine(m) or type(m) in (nn.Linear, HostGemmLinear))]
    return groups, lone


def _quantized_affine(m: nn.Module) -> bool:
    return isinstance(m, nn.QuantizedLinear) and getattr(m, "mode", "affine") == "affine"


def _embedding_head(model: nn.Module) -> nn.Module | None:
    """The input embedding when the head is tied to it (its as_linear is the head)."""
    args = getattr(model, "args", None)
    if args is None or not getattr(args, "tie_word_embeddings", False):
        return None
    emb = getattr(getattr(model, "model", None), "embed_tokens", None)
    if isinstance(emb, nn.QuantizedEmbedding):
        return emb if getattr(emb, "mode", "affine") == "affine" else None
    return emb if type(emb) is nn.Embedding else None


def host_weights_bytes(model: nn.Module) -> int:
    """Bytes `use_host_weights` would allocate (float32 copies; float32 weights are used in place)."""
    groups, lone = _resident_candidates(model)
    mods = [p for _, _, ps in groups for p in ps] + lone
    head = _embedding_head(model)
    mods += [head] if head is not None else []
    return sum(4 * p.weight.shape[0] * (p.weight.shape[1] * 32 // p.bits if hasattr(p, "bits") else p.weight.shape[1])
               for p in mods if hasattr(p, "bits") or p.weight.dtype != mx.float32)


def host_weights_fit(nbytes: int, available: int) -> tuple[bool, str]:
    """Whether to keep float32 copies of `nbytes`, by ROOFLINE_CPU_FP32_WEIGHTS (auto, on, off) and, on
    auto, HOST_WEIGHTS_MEMORY_FRACTION of the `available` RAM. Returns (yes, why)."""
    setting = CPU_FP32_WEIGHTS.raw().lower() or "auto"
    if setting not in ("auto", "on", "off"):
        from mlx_engine.api import RooflineError

        raise RooflineError(f"{HOST_WEIGHTS_ENV}={setting!r}: expected auto, on or off")
    if setting != "auto":
        return setting == "on", f"{HOST_WEIGHTS_ENV}={setting}"
    limit = int(available * HOST_WEIGHTS_MEMORY_FRACTION)
    return nbytes <= limit, f"{nbytes / 2**20:.0f} MiB of float32 weights against {limit / 2**20:.0f} MiB allowed"


def use_host_weights(model: nn.Module) -> tuple[int, int]:
    """Makes every projection (and a tied head) of `model` run on resident float32 numpy weights. Returns
    (bytes allocated for them, bytes of MLX parameters no longer read when computing in float32)."""
    groups, lone = _resident_candidates(model)
    allocated = idle = 0
    for owner, attr, mods in groups:
        proj = HostProjection(mods)
        setattr(owner, attr, proj)  # a plain attribute: the model calls it instead of the separate projections
        allocated += proj.nbytes
        idle += sum(_mlx_bytes(p) for p in mods)
    for m in lone:
        proj = HostProjection([m])
        proj.fallback = nn.QuantizedLinear if isinstance(m, nn.QuantizedLinear) else nn.Linear
        cls = _RESIDENT_QUANTIZED if isinstance(m, nn.QuantizedLinear) else ResidentLinear
        m.__class__ = cls
        m.host = proj
        allocated += proj.nbytes
        idle += _mlx_bytes(m) if proj.copied else 0
    head = _embedding_head(model)
    if head is not None:
        proj = HostProjection([head])
        proj.fallback = type(head)
        head.__class__ = _RESIDENT_QUANTIZED_EMBEDDING if isinstance(head, nn.QuantizedEmbedding) else ResidentEmbedding
        head.host = proj
        allocated += proj.nbytes
        idle += _mlx_bytes(head) if proj.copied else 0
    return allocated, idle


def _mlx_bytes(m: nn.Module) -> int:
    return sum(v.nbytes for k, v in m.items() if isinstance(v, mx.array))


class _ResidentQuantizedLinear(nn.QuantizedLinear):
    host: HostProjection
    __call__ = ResidentLinear.__call__


class _ResidentQuantizedEmbedding(nn.QuantizedEmbedding):
    host: HostProjection
    __call__ = ResidentEmbedding.__call__
    as_linear = ResidentEmbedding.as_linear


_RESIDENT_QUANTIZED: type[Any] = _ResidentQuantizedLinear
_RESIDENT_QUANTIZED_EMBEDDING: type[Any] = _ResidentQuantizedEmbedding
