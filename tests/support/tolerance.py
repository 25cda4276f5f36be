"""Float tolerances from the float32 floor: max |got - want| <= units x eps32 x max |want|.

Two float32 computations of the same math (two engines, a kernel and its reference, paged and contiguous KV,
two chunkings of a prefill) differ by rounding only: each sum is taken in another order (SIMD width, GEMM
blocking, threads, the BLAS: AVX2, AVX-512 and AMX machines all pick other kernels), so the difference scales
with eps32 and with the size of the values compared, not with a fixed constant. A tolerance is therefore stated
in units of eps32 x max |want| (`units`): the measured floor of that comparison, times HEADROOM.

The floors were measured on an AMD EPYC (Zen 5, AVX-512) with `ROOFLINE_TOL_LOG=FILE uv run pytest ...`, which
records every comparison made through `assert_f32_close` as "test what measured-units allowed-units"; rerun it on
a new CPU when a tolerance fails there. For reference, `tests/golden/measure_float_floor.py` measures each float32
engine against a float64 run of the same weights: SmolLM2's logits are 15-19 units from float64 (torch and MLX),
the tiny golden models' 6-14, transformers' own float32 13.5 (smollm2_gguf_logits.npz); the two engines differ
on an Intel Xeon (AVX-512, AMX) by 1.27x what they differ here (1.04e-4 against 8.2e-5).

HEADROOM 4 covers that spread several times over while staying far below the next precision: a bfloat16 or
TF32 matmul slipping in (a float32 matmul precision other than "highest", AMX's bf16 path) costs 2**-8 or
2**-10 relative, thousands of units, and fails loudly.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

EPS32 = float(np.finfo(np.float32).eps)  # 2**-23
HEADROOM = 4


def f32_units(got: Any, want: Any) -> tuple[float, float, float]:
    """(maxdiff, scale, maxdiff in units of eps32 x scale), scale = max |want| (1 where want is all zeros)."""
    g, w = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    assert g.shape == w.shape, (g.shape, w.shape)
    scale = float(np.abs(w).max()) if w.size else 1.0
    scale = scale or 1.0
    diff = float(np.abs(g - w).max()) if w.size else 0.0
    return diff, scale, diff / (EPS32 * scale)


def assert_f32_close(got: Any, want: Any, units: float, what: str = "") -> None:
    """max |got - want| <= units x eps32 x max |want|; `units` = the measured floor x HEADROOM, said at the call."""
    diff, scale, measured = f32_units(got, want)
    log = os.environ.get("ROOFLINE_TOL_LOG")
    if log:
        test = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]
        with open(log, "a") as f:
            f.write(f"{test}\t{what}\t{measured:.1f}\t{units}\n")
    assert diff <= units * EPS32 * scale, (
        f"{what + ': ' if what else ''}maxdiff {diff:.3e} = {measured:.1f} x eps32 x max|want| ({scale:.3g}), "
        f"over the {units} allowed")
