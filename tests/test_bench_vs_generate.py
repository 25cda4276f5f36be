"""`roofline bench`'s decode runs as `roofline generate`'s does (issue 48): the same forward entry and execution path,
the same CPU threads, and torch's work on the engine thread alone, read through `Engine.diagnostics().execution()`
from each command in a process of its own. Not a timing test: bench/bench_vs_generate.py times them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.tiny_models import random_llama_folder, write_gguf_from_folder
from tests.support.torch_support import available, require

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny llama as a Q4_0 GGUF with a byte-level tokenizer: held packed for Roofline's CPU kernel on torch."""
    tmp = tmp_path_factory.mktemp("tiny")
    out = tmp / "tiny-q4_0.gguf"
    write_gguf_from_folder(random_llama_folder(tmp / "hf", vocab=160), out, {}, default_type="Q4_0")
    return out


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A data dir with a cached peak bandwidth (the start-up check reads 3 copies, not 15); the bench still
    measures its peak FLOP/s each run, the matmul that issue 48 was about."""
    from mlx_engine.roofline import _cpu_name

    h = tmp_path_factory.mktemp("home")
    (h / "bandwidth.json").write_text(json.dumps({"label": _cpu_name(), "bytes_per_s": 1e12, "median": 1e12,
                                                  "low": 1e12, "runs": 15}))
    return h


def execution(home: Path, *args: str) -> list[dict]:
    """Each engine's `execution()` from `roofline ARGS` run in a fresh process."""
    env = {**os.environ, "ROOFLINE_HOME": str(home)}
    r = subprocess.run([sys.executable, "-m", "tests.support.execution_probe", *args], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["rc"] == 0, r.stderr
    return out["engines"]


def both(model: Path, home: Path, *backend: str) -> tuple[dict, dict]:
    (gen,) = execution(home, "generate", "-m", str(model), *backend, "--raw", "-p", "hello there", "--max-tokens",
                       "8")
    (bench,) = execution(home, "bench", "-m", str(model), *backend, "-p", "8", "-n", "8", "--batch", "1",
                         "--context", "0", "--repeats", "1")
    return gen, bench


def test_bench_decodes_as_generate_does_on_torch(model: Path, home: Path) -> None:
    require("torch")
    gen, bench = both(model, home, "--backend", "torch", "--device", "cpu")
    # e.g. {"decode_sample: native-step, 2 threads, roofline-engine"}: entry, path, threads and thread alike
    assert set(bench["forwards"]) == set(gen["forwards"]), (bench, gen)
    assert all(k.endswith(", roofline-engine") for k in gen["forwards"])
    # the bench's peak FLOP/s matmul ran on the engine thread too: no second OpenMP pool in the process
    assert bench["torch_threads"] == gen["torch_threads"] == ["roofline-engine"]


def test_bench_decodes_as_generate_does_on_mlx(model: Path, home: Path) -> None:
    gen, bench = both(model, home, "--backend", "mlx")
    assert set(bench["forwards"]) == set(gen["forwards"]), (bench, gen)
    assert all(k.startswith(("decode_sample: mlx ", "prefill")) for k in gen["forwards"]), gen
    if available("torch"):  # the bench's FLOP/s matmul, where torch is installed: on the engine thread
        assert bench["torch_threads"] == ["roofline-engine"]
