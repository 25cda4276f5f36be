"""The engine's Mac code paths, run here on a simulated Mac.

On a Mac `mx.metal.is_available()` turns on branches that never run on the Linux build machines: activations in
the checkpoint's dtype, no host BLAS, token-major KV pools read by the paged-attention Metal kernel, k-quant
weights kept as blocks for the k-quant Metal kernel, the KV budget from Metal's working set. These tests patch
`mx.metal` to say a GPU is there and set ROOFLINE_METAL_INTERPRET=1, so every kernel launch runs the kernels' own
Metal source through the interpreter (`kernels_metal.interpret`), and compare the whole engine's tokens and
log-probabilities with the same requests on the CPU path. MLX's own ops still run on its CPU backend: what is
checked is our Mac wiring and our kernel sources, not Apple's compiler.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from kernels_metal import _backend
from mlx_engine import Engine, GenerationRequest, RooflineError, SamplingParams
from tests.support.mac import PROMPTS, assert_same, together
from tests.support.tiny_models import folder_with_weights, gguf_to_hf_names, kquant_llama_gguf, random_llama_folder

WORKING_SET = 6 * 2**30

pytestmark = [pytest.mark.skipif(not _backend.interpret_available(), reason="the Metal interpreter is not importable"),
              pytest.mark.skipif(mx.metal.is_available(), reason="a real Mac: its kernels run for real elsewhere")]


class Launches:
    """Counts kernel builds for the interpreter: each kernel call fetches its kernels once."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        import kernels_metal.kquant as kq
        import kernels_metal.paged_attention as pa

        self.attention = self.kquant = 0
        self.wired: list[int] = []  # mx.set_wired_limit calls (recorded, not made)
        attention, kquant = pa._interpret_kernels, kq._interpret_kernel

        def count_attention():
            self.attention += 1
            return attention()

        def count_kquant():
            self.kquant += 1
            return kquant()

        monkeypatch.setattr(pa, "_interpret_kernels", count_attention)
        monkeypatch.setattr(kq, "_interpret_kernel", count_kquant)


@pytest.fixture
def mac(monkeypatch: pytest.MonkeyPatch) -> Iterator[Launches]:
    """A Mac as the engine sees one: Metal available, its working set, kernels through the interpreter."""
    monkeypatch.setattr(mx.metal, "is_available", lambda: True)
    monkeypatch.setattr(mx.metal, "device_info", lambda: {"max_recommended_working_set_size": WORKING_SET,
                                                           "memory_size": 2 * WORKING_SET})
    monkeypatch.setenv(_backend.INTERPRET_ENV, "1")
    launches = Launches(monkeypatch)
    monkeypatch.setattr(mx, "set_wired_limit", lambda n: launches.wired.append(n) or 0)
    yield launches


GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5)


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return random_llama_folder(tmp_path_factory.mktemp("llama"), head_dim=64, hidden=128)


@pytest.mark.parametrize("kv", [{}, {"kv_bits": 8}, {"kv_bits": 4, "kv_group_size": 32, "kv_key_per_channel": True}],
                         ids=["float", "kv8", "kv4-channel"])
def test_batched_decode_on_a_mac_matches_the_cpu_path(llama: Path, kv: dict, request: pytest.FixtureRequest) -> None:
    """Two requests decoding together: the Mac's token-major pools and the paged-attention kernel source give the
    CPU path's tokens and log-probabilities."""
    with Engine.load(str(llama), block_size=16, **kv) as e:
        assert e.diagnostics().runner.info.device == "cpu" and e.diagnostics().cache.storage.head_major
        want = together(e, GREEDY)
    launches = request.getfixturevalue("mac")
    with Engine.load(str(llama), block_size=16, **kv) as e:
        assert e.diagnostics().runner.info.device == "metal" and not e.diagnostics().cache.storage.head_major
        got = together(e, GREEDY)
    assert launches.attention > 0
    # quantized KV: the two paths' projections (MLX's matmul here, numpy's BLAS on the CPU path) differ in the
    # last float bits, and now and then that moves a key across a rounding edge of its code (measured: 2e-3 at 8 bits)
    if kv:
        assert_same(got, want, atol=1e-2)
    else:
        # float32 floor: 28.6 units (tests/support/tolerance.py) on an AMD EPYC; x4 headroom
        assert_same(got, want, units=128)


def test_a_mac_budgets_kv_from_metals_working_set(mac: Launches, llama: Path) -> None:
    from mlx_engine.kv.config import available_memory_bytes

    assert available_memory_bytes(2**30) == WORKING_SET - 2**30
    with pytest.raises(RooflineError, match="device='cpu' with backend='mlx' on a Mac"):
        Engine.load(str(llama), device="cpu")


def test_a_mac_runs_in_the_checkpoints_dtype(tmp_path: Path, llama: Path, request: pytest.FixtureRequest) -> None:
    """float16 weights: the CPU path computes in float32 unless told otherwise, a Mac in the checkpoint's float16,
    with no host copies of the weights; and its float16 numbers are the CPU path's at dtype="float16"."""
    import json

    from safetensors.numpy import load_file, save_file

    half = tmp_path / "half"
    half.mkdir()
    (half / "config.json").write_text(json.dumps({**json.loads((llama / "config.json").read_text()),
                                                  "torch_dtype": "float16"}))
    save_file({k: v.astype(np.float16) for k, v in load_file(str(llama / "model.safetensors")).items()},
              str(half / "model.safetensors"))
    with Engine.load(str(half), block_size=16) as e:
        assert e.diagnostics().runner.info.dtype == "float32"
    with Engine.load(str(half), block_size=16, dtype="float16") as e:
        want = together(e, GREEDY)
    request.getfixturevalue("mac")
    with Engine.load(str(half), block_size=16) as e:
        assert e.diagnostics().runner.info.dtype == "float16" and e.diagnostics().runner._host_bytes == 0
        got = together(e, GREEDY)
    assert_same(got, want, atol=1e-2)


def test_kquant_blocks_on_a_mac_match_the_exact_weights(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """A GGUF of k-quants: a Mac keeps the blocks and multiplies them in the k-quant kernel's source (the CPU path
    rounds them to float16 at load instead). Its tokens and log-probabilities are those of the exactly dequantized
    weights, in float32, on the CPU path."""
    path, src, deq = kquant_llama_gguf(tmp_path)
    exact = folder_with_weights(src, tmp_path / "exact", gguf_to_hf_names(deq))
    with Engine.load(str(exact), block_size=16) as e:
        want = together(e, GREEDY)
    launches = request.getfixturevalue("mac")
    with Engine.load(str(path), block_size=16, dtype="float32") as e:
        got = together(e, GREEDY)
    assert launches.kquant > 0 and launches.attention > 0
    # float32 floor: 50.6 units (tests/support/tolerance.py) on an AMD EPYC; x4 headroom
    assert_same(got, want, units=208)


def test_speculation_on_a_mac_matches_the_cpu_path(llama: Path, request: pytest.FixtureRequest) -> None:
    """A draft model and prompt lookup on the Mac path: plain greedy tokens, the same drafts accepted as on the
    CPU path (the target drafting for itself: every draft), no blocks left behind by rollbacks."""
    runs = {}
    for where in ("cpu", "mac"):
        if where == "mac":
            launches = request.getfixturevalue("mac")
        with Engine.load(str(llama), block_size=16, draft_model=str(llama)) as e:
            runs[where] = {mode: together(e, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5,
                                                            speculative=mode, num_draft_tokens=3))
                           for mode in (None, "draft", "prompt-lookup")}
    assert launches.attention > 0
    plain = [r[0] for r in runs["mac"][None]]
    for mode in ("draft", "prompt-lookup"):
        assert [r[0] for r in runs["mac"][mode]] == plain, mode
        assert [r[2] for r in runs["mac"][mode]] == [r[2] for r in runs["cpu"][mode]], mode
        # float32 floor: 17.0 units (tests/support/tolerance.py) on an AMD EPYC; x4 headroom
        assert_same(runs["mac"][mode], runs["cpu"][mode], units=72)
    # 8 tokens: the prefill's, then verifications of 3 drafts (+ the bonus token) until the budget cuts one short
    assert [r[2] for r in runs["mac"]["draft"]] == [5, 5]


def test_a_mac_keeps_the_recommended_working_set_wired(mac: Launches, llama: Path, monkeypatch) -> None:
    """As mlx-lm does: the wired limit is Metal's recommended working set, so weights and KV stay resident between
    requests; weights near that size get a note. Never on the CPU path."""
    from mlx_engine.backends.mlx.load import wire_memory

    with Engine.load(str(llama)) as e:
        assert mac.wired == [WORKING_SET]
        assert e.info.warnings == ()
    assert wire_memory(int(0.95 * WORKING_SET)).startswith("the weights take 5.7 GiB of the 6.0 GiB Metal keeps")
    assert wire_memory(WORKING_SET // 2) == "" and mac.wired == [WORKING_SET] * 3
    monkeypatch.setattr(mx.metal, "is_available", lambda: False)
    assert wire_memory(WORKING_SET) == "" and len(mac.wired) == 3


def test_prompt_scores_on_a_mac_match_the_cpu_path(llama: Path, request: pytest.FixtureRequest) -> None:
    """`prompt_logprobs` on the Mac path (its prefill attention, packed beside the other prompt): the CPU path's
    scores and top tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=3)

    def scores(engine: Engine) -> list[list[tuple]]:
        streams = [engine.generate(GenerationRequest(prompt_token_ids=p, sampling=params)) for p in PROMPTS]
        return [[(lp.token_id, lp.logprob, [i for i, _ in lp.top]) for lp in next(iter(s)).prompt_logprobs]
                for s in streams]

    with Engine.load(str(llama), block_size=16, prefill_chunk_size=16) as e:
        want = scores(e)
    request.getfixturevalue("mac")
    with Engine.load(str(llama), block_size=16, prefill_chunk_size=16) as e:
        got = scores(e)
    for g, w in zip(got, want, strict=True):
        assert len(g) == len(w) > 0 and [(x[0], x[2]) for x in g] == [(x[0], x[2]) for x in w]
        assert max(abs(a[1] - b[1]) for a, b in zip(g, w)) <= 1e-4
