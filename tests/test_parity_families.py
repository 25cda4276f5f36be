"""Issue 47's families against transformers 5.25 (tests/golden/make_golden_2026.py, run by hand): tiny random
checkpoints as transformers writes them — hybrids with both kinds of layer (Gated DeltaNet, Mamba 2, short
convolutions beside attention), MLA, MoE, sliding windows of 8, per-layer head sizes, a multimodal Qwen3.5 — loaded
by the engine with no edit: float32 logits within the float32 floor, the same 32 greedy tokens."""

from __future__ import annotations

import numpy as np
import pytest

from mlx_engine import Engine, GenerationRequest, SamplingParams
from tests.tiny_models import FAMILIES_2026, GOLDEN
from tests.tolerance import HEADROOM, assert_f32_close

# engine vs transformers, both float32, prompt logits: measured 3.9 (olmo3) to 13.2 (falcon_h1) units of
# eps32 x max |logit| on an AMD EPYC (Zen 5); the recurrent layers' scans add no more than the attention's sums
FLOOR_UNITS = 14
# what each runs as: the multimodal Qwen3.5 as its text model
MODEL_TYPE = {"qwen3_5_vlm": "qwen3_5_text"}


@pytest.fixture(scope="module", params=FAMILIES_2026)
def family(request):
    folder = GOLDEN / request.param
    engine = Engine.load(str(folder), backend="mlx")
    yield request.param, engine, dict(np.load(folder / "golden.npz"))
    engine.close()


def test_every_family_has_its_golden() -> None:
    assert all((GOLDEN / name / "golden.npz").exists() for name in FAMILIES_2026)


def test_logits_within_the_float32_floor(family) -> None:
    name, engine, gold = family
    assert engine.info.model_type == MODEL_TYPE.get(name, name)
    logits = np.asarray(engine.forward_logits(gold["input_ids"].tolist()))
    assert logits.shape == gold["logits"].shape and logits.dtype == np.float32
    assert_f32_close(logits, gold["logits"], FLOOR_UNITS * HEADROOM, name)


def test_greedy_tokens_identical(family) -> None:
    name, engine, gold = family
    want = gold["greedy_tokens"].tolist()
    sampling = SamplingParams(temperature=0.0, max_tokens=len(want), ignore_eos=True)
    events = list(engine.generate(GenerationRequest(prompt_token_ids=gold["input_ids"].tolist(), sampling=sampling)))
    got = [t for e in events for t in e.token_ids]
    first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    assert got == want, f"{name}: first differing step {first}\n got  {got}\n want {want}"
    assert events[-1].finish_reason == "length"


# --- what runs them, and what refuses them (issue 47 item 8) ----------------------------------------------------

# the reason each refusal names, in the family's words (models.config_families.family_reason)
REASONS = {"qwen3_next": "its linear_attention layers keep a recurrent state per sequence, not K and V",
           "lfm2": "its conv layers keep a recurrent state per sequence",
           "falcon_h1": "its mamba layers keep a recurrent state per sequence",
           "deepseek_v3": "its multi-head latent attention (MLA) keeps one latent per token for all heads",
           "gemma4_text": "its full-attention layers have heads of 32 and its sliding ones of 16"}


@pytest.mark.parametrize("name", sorted(REASONS))
def test_distributed_refuses_in_one_line_naming_family_and_reason(name: str) -> None:
    import mlx.core as mx

    from mlx_engine.api import ModelLoadError
    from mlx_engine.distributed.shard import check_shardable
    from mlx_engine.loading import load_checkpoint
    from mlx_engine.models import build_model

    ckpt = load_checkpoint(str(GOLDEN / name))
    built = build_model(ckpt.config, ckpt.weights, mx.float32, None, name)
    with pytest.raises(ModelLoadError) as e:
        check_shardable(built, "pipeline", name)
    line = str(e.value)
    assert "\n" not in line and f"{name} ({MODEL_TYPE.get(name, name)})" in line and REASONS[name] in line, line


@pytest.mark.parametrize("name", ["qwen3_next", "deepseek_v3", "nemotron_h"])
def test_torch_backend_refuses_in_one_line_naming_family_and_reason(name: str) -> None:
    from tests.torch_support import require

    require("torch")
    from mlx_engine.api import RooflineError

    with pytest.raises(RooflineError) as e:
        Engine.load(str(GOLDEN / name), backend="torch", device="cpu")
    line = str(e.value)
    assert "\n" not in line and f"model type {name!r} is not supported on the torch backend" in line, line
    assert REASONS.get(name, "keep a recurrent state per sequence") in line, line
