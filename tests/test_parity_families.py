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

# engine vs transformers, both float32, prompt logits: measured 3.9 (olmo3) to 11.4 (nemotron_h) units of
# eps32 x max |logit| on an AMD EPYC (Zen 5); the recurrent layers' scans add no more than the attention's sums
FLOOR_UNITS = 12
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
