"""The runner contract (`mlx_engine.backends.base`): every runner implements `ModelRunner` on its own (the torch
runner does not inherit the MLX one), declares `RunnerCapabilities`, and what it declares is what it does."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from mlx_engine import Engine, GenerationRequest, RequestError, RooflineError, SamplingParams
from mlx_engine.backends.base import ModelRunner, PhaseForwards, RunnerCapabilities, SequenceWork
from tests.torch_support import require

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = Path(__file__).resolve().parent / "data" / "golden"
PROMPT = [(7 * i + 3) % 120 + 5 for i in range(40)]



def members(proto: type) -> tuple[set[str], set[str]]:
    """(attributes, methods) the protocol declares."""
    attrs = set(proto.__dict__.get("__annotations__", {}))
    methods = {n for n, v in proto.__dict__.items() if callable(v) and not n.startswith("_")}
    return attrs, methods


def runner_class(name: str) -> type:
    if name == "TorchRunner":
        require("torch")
        from mlx_engine.backends.torch.runner import TorchRunner

        return TorchRunner
    if name == "DistributedRunner":
        from mlx_engine.distributed.runner import DistributedRunner

        return DistributedRunner
    from mlx_engine.backends.mlx.runner import Runner

    return Runner


def test_the_protocol_lists_forwards_by_phase() -> None:
    attrs, methods = members(PhaseForwards)
    assert {"prefill", "prefill_logits", "decode_logits", "decode_sample", "packed_logits", "packed_sample",
            "verify_logits", "draft_logits"} <= methods
    assert "forward" not in methods  # a backend's own: its output is the backend's tensor


def test_the_engine_sees_a_runner_of_at_most_fifteen_members() -> None:
    """The engine and the scheduler see a step's plan go in and its result come out; the phase forwards and the
    whole-sequence work are reached through typed accessors, each its own protocol."""
    attrs, methods = members(ModelRunner)
    assert {"capabilities", "cache", "tokenizer", "info", "draft"} <= attrs
    assert {"execute", "forwards", "sequences", "release"} <= methods
    assert len(attrs | methods) <= 15, sorted(attrs | methods)
    phase_attrs, phase_methods = members(PhaseForwards)
    assert not phase_methods & methods and not members(SequenceWork)[1] & (methods | phase_methods)


@pytest.mark.parametrize("name", ["Runner", "TorchRunner", "DistributedRunner"])
def test_every_runner_class_has_every_method(name: str) -> None:
    cls = runner_class(name)
    methods = set().union(*(members(p)[1] for p in (ModelRunner, PhaseForwards, SequenceWork)))
    missing = sorted(m for m in methods if not callable(getattr(cls, m, None)))
    assert not missing, f"{cls.__name__} lacks {missing}"


def test_the_torch_runner_does_not_inherit_the_mlx_runner() -> None:
    """What they share is backend-free (`backends.common`): nothing of MLX's runner is in the torch one's bases."""
    from mlx_engine.backends.common import CacheRunner

    cls = runner_class("TorchRunner")
    assert cls.__mro__ == (cls, CacheRunner, object)
    assert runner_class("Runner").__mro__[1:] == (CacheRunner, object)


def check_instance(runner: object) -> None:
    attrs, methods = members(ModelRunner)
    missing = sorted(a for a in attrs | methods if not hasattr(runner, a))  # the test's probe, not the engine's
    assert not missing, f"{type(runner).__name__} lacks {missing}"
    assert isinstance(runner, ModelRunner) and isinstance(runner.capabilities, RunnerCapabilities)
    assert isinstance(runner.forwards(), PhaseForwards) and isinstance(runner.sequences(), SequenceWork)


def generate(e: Engine, **sampling) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, **sampling)
    return [t for ev in e.generate(GenerationRequest(prompt_token_ids=PROMPT, sampling=params)) for t in ev.token_ids]


def test_mlx_paged_runner_does_what_it_declares(tmp_path: Path) -> None:
    with Engine.load(str(GOLDEN / "llama"), prefix_caching=True, block_size=16) as e:
        runner = e.diagnostics().runner
        check_instance(runner)
        caps = runner.capabilities
        assert caps == RunnerCapabilities(rollback=True, kv_files=True, self_draft=True, hidden_states=True,
                                          max_batch=None)
        assert e.info.kv_files and e.diagnostics().scheduler.max_seqs == 16
        plain = generate(e)
        assert generate(e, speculative="self") == plain  # self draft and rollback, as declared
        assert len(e.hidden_states(PROMPT[:5])) == len(runner.model.layers) + 1
        assert e.save_kv(str(tmp_path / "kv.safetensors"), PROMPT) == 32  # two full blocks of the prompt


def test_mlx_contiguous_runner_holds_one_sequence_and_no_kv_files(tmp_path: Path) -> None:
    with Engine.load(str(GOLDEN / "llama"), paged_kv=False) as e:
        caps = e.diagnostics().runner.capabilities
        assert (caps.kv_files, caps.max_batch, caps.rollback) == (False, 1, True)
        assert e.diagnostics().scheduler.max_seqs == 1 and not e.info.kv_files
        generate(e)
        with pytest.raises(RooflineError, match="saving KV needs the paged KV cache"):
            e.save_kv(str(tmp_path / "kv.safetensors"), PROMPT)


def test_an_mlx_lm_class_declares_no_self_draft_and_no_hidden_states(tmp_path: Path) -> None:
    dst = tmp_path / "m"
    shutil.copytree(GOLDEN / "llama", dst)
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, "model_type": "xverse"}))  # an mlx-lm class
    with Engine.load(str(dst)) as e:
        check_instance(e.diagnostics().runner)
        caps = e.diagnostics().runner.capabilities
        assert not e.info.native and caps.rollback and not caps.self_draft and not caps.hidden_states
        with pytest.raises(RequestError, match=r"^speculative='self' needs a natively implemented model; .* runs on "
                                               r"an mlx-lm class$"):
            generate(e, speculative="self")
        with pytest.raises(RooflineError, match=r"^hidden states need a natively implemented model"):
            e.hidden_states(PROMPT[:5])
        assert generate(e, speculative="prompt-lookup") == generate(e)  # rollback: declared and done


def test_torch_runner_does_what_it_declares(tmp_path: Path) -> None:
    require("torch")
    with Engine.load(str(GOLDEN / "llama"), backend="torch", device="cpu") as e:
        runner = e.diagnostics().runner
        check_instance(runner)
        caps = runner.capabilities
        assert (caps.rollback, caps.kv_files, caps.self_draft, caps.hidden_states, caps.max_batch) == \
            (True, False, True, True, None)
        assert not e.info.kv_files
        plain = generate(e)
        assert generate(e, speculative="self") == plain
        with pytest.raises(RooflineError, match="^saving KV is not supported on the torch backend$"):
            e.save_kv(str(tmp_path / "kv.safetensors"), PROMPT)
        with pytest.raises(RooflineError, match="^restoring KV is not supported on the torch backend$"):
            e.restore_kv(str(tmp_path / "kv.safetensors"))


def test_no_runner_proposer_or_view_is_probed() -> None:
    probe = re.compile(r"(hasattr|getattr)\((runner|r|p|proposer|self\.proposer|self\.proposers\[\w+\]|view|"
                       r"layers\[0\]|seq|s|self\.runner|self\._runner|self\.local|local|draft|target)\b")
    not_ours = {"mlx_engine/backends/mlx/host_blas.py": "hasattr(p",  # p: an mlx.nn module (QuantizedLinear)
                "mlx_engine/distributed/mirror.py": "getattr(self.local"}  # the mirror's delegation to its cache
    found = [f"{path}: {m.group(0)}" for f in sorted((ROOT / "mlx_engine").rglob("*.py"))
             for m in probe.finditer(f.read_text()) if not_ours.get(path := str(f.relative_to(ROOT))) != m.group(0)]
    assert not found, found
