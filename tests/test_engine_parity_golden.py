"""Parity with Hugging Face transformers, through the engine's public API.

The golden files under tests/data/golden/ come from `tests/golden/make_golden.py` (torch 2.13.0,
transformers 5.24.0, run by hand). Tiny random models: logits within 1e-4 in float32 and the same 32
greedy tokens; for every family, whether it runs on our class or mlx-lm's (mlx_engine.models.mlx_lm_classes
fixes the ones that depart from transformers). The embedded SmolLM2 Q4_1 GGUF: chat-template ids, last-position logits and greedy
replies against transformers' own GGUF loader.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

if importlib.util.find_spec("mlx_engine.engine") is None:  # the engine is still being written
    pytest.skip("mlx_engine.engine does not exist yet", allow_module_level=True)

from mlx_engine import Engine, GenerationRequest, SamplingParams  # noqa: E402
from tests.support.tiny_models import FAMILIES_2026, parity_goldens  # noqa: E402

GOLDEN = Path(__file__).parent / "data" / "golden"
TINY = sorted(p.name for p in parity_goldens() if p.name not in FAMILIES_2026)
LOGITS_TOL = 1e-4  # float32 engine vs float32 torch on the tiny models; observed noise is ~1e-6

# SmolLM2, last prompt position, engine vs transformers in float64. Measured with transformers itself
# (smollm2_gguf_logits.npz): float32 3.9e-5, float16 0.040, bfloat16 1.03 (max |logit| 25.3). The
# tolerance is ~25x the float32 floor, 3x the half-precision ones.
SMOLLM2_TOL = {"float32": 1e-3, "float16": 0.12, "bfloat16": 3.1}
SMOLLM2_MIN_MATCH = 8  # leading greedy tokens that must match (fewer only where the reply is shorter)
SMOLLM2_MAX_TOKENS = 12  # ~7 tokens/s on the CPU backend: enough to see 8 match and "Paris"


def activation_dtype(engine) -> str:
    info = getattr(engine, "info", None)
    dtype = getattr(info, "dtype", None) or "float32"
    return str(dtype).rsplit(".", 1)[-1]  # "mlx.core.float32" -> "float32"


def greedy(engine, ids: list[int], max_tokens: int, ignore_eos: bool) -> tuple[list[int], str, list]:
    sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    events = list(engine.generate(GenerationRequest(prompt_token_ids=list(ids), sampling=sampling)))
    tokens = [t for e in events for t in e.token_ids]
    return tokens, "".join(e.text for e in events), events


# --- tiny random models -------------------------------------------------------------------------


@pytest.fixture(scope="module", params=TINY)
def tiny(request):
    folder = GOLDEN / request.param
    engine = Engine.load(str(folder))
    yield folder.name, engine, dict(np.load(folder / "golden.npz"))
    engine.close()


def test_golden_folders_present():
    assert {"llama", "llama3_rope", "llama3_legacy_config", "mistral", "qwen2", "qwen3",
            "llama_sharded", "llama_bf16"} <= set(TINY)
    # issue 23's families (sliding windows of 8, MoE with 4 experts and top-2, a multimodal Gemma 3)
    assert {"phi3", "gemma2", "gemma3_text", "gemma3_vlm", "olmo2", "granite", "qwen3_moe", "mixtral", "starcoder2",
            "gpt_oss"} <= set(TINY)


def test_tiny_logits(tiny):
    name, engine, gold = tiny
    ids = gold["input_ids"].tolist()
    logits = np.asarray(engine.forward_logits(ids))
    assert logits.shape == gold["logits"].shape and logits.dtype == np.float32, (logits.shape, logits.dtype)
    maxdiff = float(np.abs(logits - gold["logits"]).max())
    assert maxdiff <= LOGITS_TOL, f"{name}: maxdiff {maxdiff:.3e} > {LOGITS_TOL} (activations {activation_dtype(engine)})"


def test_tiny_greedy(tiny):
    name, engine, gold = tiny
    expected = gold["greedy_tokens"].tolist()
    tokens, _, events = greedy(engine, gold["input_ids"].tolist(), len(expected), ignore_eos=True)
    # every golden step is >= 0.02 from a tie (greedy_margins), far above float32 noise
    first_diff = next((i for i, (a, b) in enumerate(zip(tokens, expected)) if a != b), None)
    assert tokens == expected, f"{name}: first differing step {first_diff}\n got  {tokens}\n want {expected}"
    assert events[-1].finish_reason == "length"


# --- embedded SmolLM2 (Q4_1 GGUF) ---------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2():
    engine = Engine.load(None, backend="mlx")  # the goldens are MLX's
    yield engine, json.loads((GOLDEN / "smollm2_gguf.json").read_text())
    engine.close()


def test_smollm2_chat_template_ids(smollm2):
    engine, gold = smollm2
    for p in gold["prompts"]:
        ids = list(engine.tokenizer.encode_chat(p["messages"], add_generation_prompt=True))
        assert ids == p["prompt_ids"], f"{p['messages'][0]['content']!r}:\n got  {ids}\n want {p['prompt_ids']}"


def test_smollm2_last_logits(smollm2):
    engine, _ = smollm2
    gold = np.load(GOLDEN / "smollm2_gguf_logits.npz")
    dtype = activation_dtype(engine)
    tol = SMOLLM2_TOL[dtype]
    last = np.asarray(engine.forward_logits(gold["prompt_ids"].tolist()))[-1].astype(np.float64)  # (vocab,)
    assert last.shape == gold["logits_f16"].shape
    top = gold["top_ids"]
    top_diff = float(np.abs(last[top] - gold["top_logits_f64"]).max())
    assert top_diff <= tol, f"top-{len(top)} logits: maxdiff {top_diff:.3e} > {tol} ({dtype} activations)"
    # the whole vocabulary against the float16 copy: its own rounding is half an ulp, <= |x| * 2**-11
    ref = gold["logits_f16"].astype(np.float64)
    excess = np.abs(last - ref) - np.abs(ref) * 2.0**-11
    assert float(excess.max()) <= tol, f"full logits: maxdiff beyond float16 rounding {excess.max():.3e} > {tol}"
    assert int(last.argmax()) == int(top[0])


def test_smollm2_greedy_replies(smollm2):
    engine, gold = smollm2
    eos = gold["eos_token_id"]
    tol = SMOLLM2_TOL[activation_dtype(engine)]
    report = []
    for p in gold["prompts"]:
        want = [t for t in p["reply_ids"] if t != eos]
        tokens, text, _ = greedy(engine, p["prompt_ids"], SMOLLM2_MAX_TOKENS, ignore_eos=False)
        got = [t for t in tokens if t != eos]
        matched = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        # a step closer to a tie than the logits tolerance may legitimately flip
        near_tie = next((i for i, m in enumerate(p["greedy_margins"]) if m < 2 * tol), len(want))
        need = min(SMOLLM2_MIN_MATCH, len(want), near_tie)
        report.append(f"{p['messages'][0]['content']!r}: {matched}/{min(len(want), SMOLLM2_MAX_TOKENS)} match, {text!r}")
        assert matched >= need, f"{report[-1]}\n got  {got}\n want {want[:SMOLLM2_MAX_TOKENS]} (need {need})"
        if "France" in p["messages"][0]["content"]:
            assert "Paris" in text, text
    print("\n".join(report))
