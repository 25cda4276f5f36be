"""A Metal kernel that fails on the user's machine: the engine runs its reference and says so once.

On a simulated Mac (`mx.metal` patched to say a GPU is there, kernels run by the interpreter, as in
tests/test_engine_mac_path.py), the interpreter is made to fail to compile, or a kernel to return wrong numbers. The
engine loads, `ModelInfo.warnings` carries exactly one line about that kernel, and the tokens and log-probabilities are
the CPU path's (the kernel's reference computes what the kernel would have).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx
import pytest

import kernels_metal.kquant as kq
import kernels_metal.paged_attention as pa
from kernels_metal import _backend
from mlx_engine import Engine, SamplingParams
from tests.support.mac import assert_same
from tests.support.mac import together as together_with
from tests.support.tiny_models import folder_with_weights, gguf_to_hf_names, kquant_llama_gguf, random_llama_folder

pytestmark = [pytest.mark.skipif(not _backend.interpret_available(), reason="the Metal interpreter is not importable"),
              pytest.mark.skipif(mx.metal.is_available(), reason="a real Mac: its kernels run for real elsewhere")]

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=5)


def together(engine: Engine) -> list:
    """tests/test_engine_mac_path.py's two prompts at once (their decode steps batch), greedy."""
    return together_with(engine, GREEDY)


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return random_llama_folder(tmp_path_factory.mktemp("llama"), head_dim=64, hidden=128)


BUILT = (pa._interpret_kernels, kq._interpret_kernel)  # the cached builders (a test may patch the names)


def fresh_kernels() -> None:
    _backend.forget_checks()
    for builder in BUILT:
        builder.cache_clear()


@pytest.fixture
def mac(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A Mac as the engine sees one, with no kernel checked or built yet (before and after)."""
    fresh_kernels()
    monkeypatch.setattr(mx.metal, "is_available", lambda: True)
    monkeypatch.setattr(mx.metal, "device_info", lambda: {"max_recommended_working_set_size": 6 * 2**30,
                                                           "memory_size": 12 * 2**30})
    monkeypatch.setattr(mx, "set_wired_limit", lambda n: 0)
    monkeypatch.setenv(_backend.INTERPRET_ENV, "1")
    yield
    fresh_kernels()


def no_compiler(monkeypatch: pytest.MonkeyPatch) -> None:
    from kernels_metal.interpret import MetalCompileError, compiler

    def fail(*args, **kwargs):
        raise MetalCompileError("simulated: error: no matching function for call to 'simd_shuffle_down'")

    monkeypatch.setattr(compiler, "build_kernel", fail)


class WrongKernel:
    """A kernel whose every output is off by one (a miscompiled kernel that runs)."""

    def __init__(self, kernel):
        self.kernel, self.calls = kernel, 0

    def __call__(self, **kwargs):
        self.calls += 1
        return [o + 1 for o in self.kernel(**kwargs)]


@pytest.mark.parametrize("failure", ["compile", "numbers"])
def test_paged_attention_that_fails_gives_the_reference_path_and_one_warning(
        failure: str, llama: Path, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    with Engine.load(str(llama), block_size=16, kv_bits=8) as e:
        want = together(e)  # the CPU path
    request.getfixturevalue("mac")
    if failure == "compile":
        no_compiler(monkeypatch)
    else:
        kernels = {key: WrongKernel(k) for key, k in pa._interpret_kernels().items()}
        monkeypatch.setattr(pa, "_interpret_kernels", lambda: kernels)
    with Engine.load(str(llama), block_size=16, kv_bits=8) as e:
        assert e.info.device == "metal"
        warnings = [w for w in e.info.warnings if "kernel" in w]
        assert len(warnings) == 1, e.info.warnings
        assert warnings[0].startswith("the Metal paged-attention kernel failed its check on this machine")
        assert ("MetalCompileError: simulated" if failure == "compile" else "differs from the reference") in warnings[0]
        assert "its MLX-ops reference instead" in warnings[0]
        if failure == "numbers":
            launched = sum(k.calls for k in kernels.values())  # the check's own launches
        got = together(e)
    if failure == "numbers":
        assert sum(k.calls for k in kernels.values()) == launched > 0  # none after the check
    # 8-bit KV: the paths' projections differ in the last float bits (MLX's matmul here, numpy's on the CPU path)
    assert_same(got, want, atol=1e-2)


def test_sound_kernels_give_no_warning(llama: Path, mac: None) -> None:
    with Engine.load(str(llama), block_size=16) as e:
        assert e.info.warnings == ()
        assert len(together(e)) == 2
    assert _backend.failures() == {}


def test_kquant_kernel_that_computes_wrongly_gives_the_reference_path_and_one_warning(
        tmp_path: Path, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A GGUF of k-quants kept as blocks on the Mac: its k-quant matmul kernel returns wrong numbers, so those
    layers multiply through the reference (the exactly dequantized weights' tokens), with one warning."""
    path, src, deq = kquant_llama_gguf(tmp_path)
    exact = folder_with_weights(src, tmp_path / "exact", gguf_to_hf_names(deq))
    with Engine.load(str(exact), block_size=16) as e:
        want = together(e)
    request.getfixturevalue("mac")
    wrong = WrongKernel(kq._interpret_kernel())
    monkeypatch.setattr(kq, "_interpret_kernel", lambda: wrong)
    with Engine.load(str(path), block_size=16, dtype="float32") as e:
        warnings = [w for w in e.info.warnings if "kernel" in w]
        assert len(warnings) == 1 and warnings[0].startswith("the Metal k-quant matmul kernel failed its check"), \
            e.info.warnings
        checked = wrong.calls
        got = together(e)
    assert wrong.calls == checked > 0
    # MLX's matmul over the dequantized blocks against numpy's over the exact weights (measured 1.4e-4 on
    # log-probabilities down to -12)
    assert_same(got, want, atol=1e-3)
