"""The memory fit before a load: a model whose header claims more than this machine can give is refused with one
line naming both figures and what to try, on every front end (CLI, server, app); under `ulimit -v` (where the
engine used to die with SIGSEGV building its float32 weight copies) a model loads within the limit or is refused."""

from __future__ import annotations

import json
import os
import re
import resource
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from mlx_engine.api import ModelLoadError
from mlx_engine.catalog import describe_model
from mlx_engine.memory import FIT_CONTEXT, WeightsHeader, available_memory, estimate_fit, held_weight_bytes
from tests.support.cli import one_line_error
from tests.support.tiny_models import random_llama_folder

ROOT = Path(__file__).resolve().parent.parent
CLAIM = 2**40  # bytes of weights the header claims: 1.1 TB, more than any machine this runs on


def oversized_folder(dst: Path) -> Path:
    """A tiny llama whose safetensors header adds a 1 TiB float32 tensor: a sparse file, no disk spent."""
    folder = random_llama_folder(dst)
    f = folder / "model.safetensors"
    data = f.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    end = max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__")
    header["model.extra.weight"] = {"dtype": "F32", "shape": [CLAIM // 4], "data_offsets": [end, end + CLAIM]}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(f, "wb") as out:
        out.write(struct.pack("<Q", len(raw)) + raw + data[8 + n:])
        out.truncate(8 + len(raw) + end + CLAIM)
    return folder


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return oversized_folder(tmp_path_factory.mktemp("big") / "big")


REFUSAL = re.compile(r"big does not fit: it needs (\d+\.\d\d) GB \((\d+\.\d\d) GB of weights, [^)]*\) but this machine "
                     r"can give (\d+\.\d\d) GB \(available RAM[^)]*\); try a smaller quantization")


def test_engine_load_refuses_before_reading_a_weight(big: Path) -> None:
    from mlx_engine import Engine

    with pytest.raises(ModelLoadError) as e:
        Engine.load(str(big))
    m = REFUSAL.search(str(e.value))
    assert m, str(e.value)
    need, weights, can = map(float, m.groups())
    assert weights >= CLAIM * 4 / 4 / 1e9 - 0.01  # the claimed tensor, held as float32 on this CPU
    assert need > can and abs(can - available_memory().bytes / 1e9) < 2.0
    summary = describe_model(str(big))
    assert summary.fits is False and summary.need_bytes >= CLAIM


@pytest.mark.parametrize("command", [["generate", "-p", "hi"], ["serve", "--port", "0"], ["kv", "-c", "16"]])
def test_every_front_end_says_it_in_one_line(big: Path, command: list[str]) -> None:
    r = subprocess.run([sys.executable, "-m", "app.cli", command[0], "-m", str(big), *command[1:]], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    if command[0] == "kv":  # sizing KV reads the header only and loads nothing: no refusal
        assert r.returncode == 0, r.stderr
        return
    assert REFUSAL.search(one_line_error(r))


async def test_the_app_shows_it_and_keeps_running(big: Path, tmp_path: Path) -> None:
    from app.tui.app import RooflineApp
    from app.tui.backend import EngineBackend
    from tests.support.tui_helpers import wait_for

    app = RooflineApp(backend=EngineBackend(), model=str(big), home=tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: any("does not fit" in str(n.message) for n in app._notifications),
                       what="the refusal", timeout=60)
        assert app.engine is None and app.is_running


def test_kv_for_the_asked_context_counts_and_the_hint_names_one_that_fits(tmp_path: Path) -> None:
    from mlx_engine import Engine

    folder = random_llama_folder(tmp_path / "long", context=2**30)
    per_token = 2 * 2 * 2 * 16 * 4  # K and V, 2 layers, 2 KV heads, head dim 16, float32 on this CPU
    with pytest.raises(ModelLoadError) as e:
        Engine.load(str(folder), max_context=2**30)
    line = str(e.value)
    assert f"{per_token * 2**30 / 1e9:.2f} GB of KV for {2**30:,} tokens" in line
    tokens = int(re.search(r"--max-context (\d+)", line).group(1))
    assert "--kv-bits 8" in line
    assert tokens * per_token <= available_memory().bytes < (tokens + 2 * 256) * per_token + 10**8
    with Engine.load(str(folder), max_context=4096) as engine:  # the default context needs no room for 2**30
        assert engine.info.context_length == 4096


def test_held_weights_follow_the_loader() -> None:
    # 1000 float params, 32 Q4_0 groups (1024 values: 512 bytes), a k-quant of 2048 values in 1152 bytes
    w = WeightsHeader(float_params=1000, float_bytes=2000, packed_bytes=512, packed_groups=32, kquant_params=2048,
                      kquant_bytes=1152, checkpoint_itemsize=2)
    assert held_weight_bytes(w, "mlx", metal=True) == (1000 * 2 + 512 + 32 * 4 + 1152, "as stored")
    assert held_weight_bytes(w, "mlx", metal=False)[0] == (1000 + 2048) * 4 + 512 + 32 * 8
    assert held_weight_bytes(w, "torch")[0] == w.stored_bytes
    fit = estimate_fit(w, kv_per_token=100, model_context=100_000, metal=True)
    assert fit.context == FIT_CONTEXT and fit.kv_bytes == 100 * FIT_CONTEXT
    assert estimate_fit(w, kv_per_token=100, model_context=512, metal=True).context == 512


def _limited(limit_bytes: int, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "app.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env=env,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (limit_bytes, limit_bytes)))


def test_under_ulimit_v_it_loads_within_the_limit_or_says_why() -> None:
    """The issue's reproduction, `ulimit -v 1000000`: it was rc 139 (SIGSEGV) in the float32 weight copies."""
    r = _limited(1_000_000 * 1024, "generate", "-p", "hi", "-n", "2", "--json")
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert json.loads(r.stdout)["usage"]["completion_tokens"] == 2
    r = _limited(450_000 * 1024, "generate", "-p", "hi", "-n", "2")
    line = one_line_error(r)
    assert "does not fit" in line and "(the address-space limit, ulimit -v)" in line


def test_available_memory_reads_the_address_space_limit() -> None:
    code = ("import resource\nfrom mlx_engine.memory import available_memory, _proc_status_kb\n"
            "vm = _proc_status_kb('VmSize')\nresource.setrlimit(resource.RLIMIT_AS, (vm + 300 * 2**20, "
            "resource.RLIM_INFINITY))\nm = available_memory()\nprint(m.source, round(m.bytes / 2**20))\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    source, mib = r.stdout.rsplit(" ", 1)
    assert source == "the address-space limit, ulimit -v" and 290 <= int(mib) <= 300
