"""Measure the float32 floor the logits tolerances are built on (tests/support/tolerance.py), run by hand:

    uv run python tests/golden/measure_float_floor.py

The reference is the torch backend in float64 (unfused ops) on the same weights; each float32 engine's
max |logit - reference| is printed in units of eps32 * max |reference logit|, the unit of
`tests.support.tolerance.F32_LOGITS_K`. Run it on a new CPU (AVX2, AVX-512, AMX) when a tolerance fails there, and
record what it prints beside F32_LOGITS_K.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

import mlx_engine.backends.torch.model as torch_model  # noqa: E402
import mlx_engine.backends.torch.load as torch_load  # noqa: E402
from mlx_engine import Engine  # noqa: E402
from tests.support.tiny_models import GOLDEN, parity_goldens  # noqa: E402

EPS32 = float(np.finfo(np.float32).eps)


def float64_logits(model: str | None, ids: list[int]) -> np.ndarray:
    torch_load._DTYPES["float64"] = torch.float64  # a measuring dtype, not one users get
    fused, torch_model.FUSED = torch_model.FUSED, False  # the fused kernels take float32 and halves only
    try:
        with Engine.load(model, backend="torch", device="cpu", dtype="float64") as engine:
            return engine.forward_logits(ids).astype(np.float64)
    finally:
        torch_model.FUSED = fused
        del torch_load._DTYPES["float64"]


def float32_runs(model: str | None, ids: list[int]) -> dict[str, np.ndarray]:
    runs = {}
    with Engine.load(model, backend="torch", device="cpu") as engine:
        runs["torch"] = engine.forward_logits(ids)
    for weights in ("on", "off"):  # MLX's CPU matmuls: float32 copies of the weights, or its quantized ones
        os.environ["ROOFLINE_CPU_FP32_WEIGHTS"] = weights
        with Engine.load(model) as engine:
            runs[f"mlx fp32-weights={weights}"] = engine.forward_logits(ids)
    os.environ.pop("ROOFLINE_CPU_FP32_WEIGHTS")
    return runs


def report(name: str, model: str | None, ids: list[int]) -> None:
    ref = float64_logits(model, ids)
    unit = EPS32 * float(np.abs(ref).max())
    runs = float32_runs(model, ids)
    print(f"{name}: {len(ids)} tokens, max |logit| {np.abs(ref).max():.2f}")
    for run, logits in runs.items():
        d = float(np.abs(logits - ref).max())
        print(f"  {run:24s} vs float64  {d:.3e}  = {d / unit:5.1f} eps32*max|logit|")
    names = list(runs)
    for a in names[1:]:
        d = float(np.abs(runs[names[0]].astype(np.float64) - runs[a]).max())
        print(f"  {names[0]} vs {a:15s}  {d:.3e}  = {d / unit:5.1f}")


def main() -> None:
    print(f"torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}, "
          f"float32 matmul precision {torch.get_float32_matmul_precision()!r}")
    gold = json.loads((GOLDEN / "smollm2_gguf.json").read_text())
    report("SmolLM2 (test_torch_runner's prompt)", None, gold["prompts"][0]["prompt_ids"][-20:])
    for folder in parity_goldens():
        report(folder.name, str(folder), np.load(folder / "golden.npz")["input_ids"].tolist())


if __name__ == "__main__":
    main()
