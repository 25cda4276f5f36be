"""backend="auto" (issue 48): which backend `backends.choice.choose` picks on each kind of machine (`Platform`, the
seam: no monkeypatching), what an explicit option implies, and what Engine.load does here: with torch, the embedded
quantized model on torch and gemma2 on MLX with a warning saying why; without torch (a fresh clone's venv), MLX
with a warning saying how to install it."""

from __future__ import annotations

import argparse
import platform
from pathlib import Path

import pytest

from mlx_engine import Engine, RooflineError
from mlx_engine.backends.choice import Choice, Platform, choose
from tests.support.torch_support import available, require

GOLDEN = Path(__file__).parent / "data" / "golden"
GEMMA2, LLAMA = str(GOLDEN / "gemma2"), str(GOLDEN / "llama")  # float32 safetensors
EMBEDDED = None  # SmolLM2, Q4_1 GGUF
MAC = Platform("Darwin", "arm64", metal=True, torch=False)
LINUX = Platform("Linux", "x86_64", metal=False, torch=True, torch_cpu_packed=True)
LINUX_NO_TORCH = Platform("Linux", "x86_64", metal=False, torch=False)
LINUX_NO_AVX2 = Platform("Linux", "x86_64", metal=False, torch=True, torch_cpu_packed=False)
CUDA = Platform("Linux", "x86_64", metal=False, torch=True, cuda=True, torch_cpu_packed=True)
ARM_LINUX = Platform("Linux", "aarch64", metal=False, torch=True)
FAST_CPU_LINUX = ("Linux", "x86_64")


@pytest.mark.parametrize("here, model, want", [
    (MAC, EMBEDDED, Choice("mlx", "auto")),
    (MAC, GEMMA2, Choice("mlx", "auto")),
    (LINUX, EMBEDDED, Choice("torch", "auto")),  # packed weights for Roofline's CPU kernel
    (LINUX, LLAMA, Choice("mlx", "auto")),  # a float checkpoint: nothing packed, no measured gain
    (LINUX_NO_AVX2, EMBEDDED, Choice("mlx", "auto")),
    (CUDA, LLAMA, Choice("torch", "auto")),
    (CUDA, EMBEDDED, Choice("torch", "auto")),
    (ARM_LINUX, EMBEDDED, Choice("mlx", "auto")),
])
def test_the_choice_on_each_machine(here: Platform, model: str | None, want: Choice) -> None:
    assert choose(model, "auto", {}, here) == want


@pytest.mark.parametrize("here", [LINUX, CUDA])
def test_a_family_torch_does_not_run_falls_back_to_mlx_saying_why(here: Platform) -> None:
    got = choose(GEMMA2, "auto", {}, here)
    assert (got.backend, got.device) == ("mlx", "auto")
    assert "torch backend runs llama, mistral, qwen2 and qwen3 models, not gemma2" in got.warning


def test_without_torch_the_warning_says_how_to_install_it() -> None:
    got = choose(EMBEDDED, "auto", {}, LINUX_NO_TORCH)
    assert got.backend == "mlx" and "uv sync --extra torch" in got.warning
    assert "--index-url https://download.pytorch.org/whl/cpu" in got.warning and "\n" not in got.warning
    assert choose(LLAMA, "auto", {}, LINUX_NO_TORCH).warning is None  # torch would not be faster for it


@pytest.mark.parametrize("device, options, want", [
    ("cuda", {}, "torch"),
    ("auto", {"threads": 1}, "torch"),
    ("auto", {"compile": False}, "torch"),
    ("auto", {"kv_bits": 8}, "mlx"),
    ("auto", {"paged_kv": False}, "mlx"),
    ("auto", {"draft_bits": 4}, "mlx"),
    ("auto", {"distributed": "pipeline"}, "mlx"),
])
def test_an_option_only_one_backend_has_picks_it(device: str, options: dict, want: str) -> None:
    assert choose(EMBEDDED, device, options, LINUX).backend == want
    assert choose(EMBEDDED, device, options, LINUX_NO_TORCH).backend == want  # torch's own error says to install


def test_options_of_both_backends_are_one_clear_line() -> None:
    with pytest.raises(RooflineError, match="threads is the torch backend's and kv_bits the MLX backend's"):
        choose(EMBEDDED, "auto", {"threads": 1, "kv_bits": 8}, LINUX)


def test_the_commands_default_to_auto() -> None:
    from app.options import runner_args, runner_options

    p = argparse.ArgumentParser()
    runner_args(p)
    assert p.parse_args([]).backend == "auto" and runner_options(p.parse_args([])) == {}
    assert runner_options(p.parse_args(["--device", "cuda"])) == {"device": "cuda"}
    assert runner_options(p.parse_args(["--backend", "mlx"])) == {"backend": "mlx"}
    with pytest.raises(RooflineError, match="--device cuda needs --backend torch or auto"):
        runner_options(p.parse_args(["--backend", "mlx", "--device", "cuda"]))


fast_cpu = pytest.mark.skipif((platform.system(), platform.machine().lower()) != FAST_CPU_LINUX,
                              reason="the torch backend is the default on Linux x86-64 only")


@fast_cpu
@pytest.mark.skipif(available("torch"), reason="a venv without torch (a fresh clone's)")
def test_a_fresh_clone_loads_mlx_and_says_how_to_get_torch() -> None:
    with Engine.load() as e:
        assert (e.info.backend, e.info.device) == ("mlx", "cpu")
        assert any("uv sync --extra torch" in w for w in e.info.warnings), e.info.warnings


@fast_cpu
def test_with_torch_the_embedded_model_loads_on_torch_and_gemma2_on_mlx() -> None:
    require("torch")
    from mlx_engine.backends.torch.cpu_features import cpu_support

    if not cpu_support().packed:
        pytest.skip("no AVX2: the torch backend would not be faster here")
    with Engine.load() as e:
        assert (e.info.backend, e.info.device) == ("torch", "cpu") and not e.info.warnings, e.info
    with Engine.load(GEMMA2) as e:
        assert (e.info.backend, e.info.device) == ("mlx", "cpu")
        assert any("not gemma2" in w for w in e.info.warnings), e.info.warnings
    with Engine.load(backend="mlx") as e:  # an explicit backend: as asked, and nothing said
        assert e.info.backend == "mlx" and not e.info.warnings


def test_a_header_that_cannot_be_read_leaves_the_error_to_the_mlx_loader(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    assert choose(str(tmp_path), "auto", {}, LINUX) == Choice("mlx", "auto")
