"""Hybrid models (recurrent layers beside attention) on the engine's paged KV with their state in a slot pool
(mlx_engine.kv.state, mlx_engine.models.hybrid), on issue 47's golden checkpoints of transformers 5.25: greedy
tokens identical to transformers' through the paged cache, three concurrent requests (decode rows batched over
their slots, prefill chunks between them) identical to each alone, slots given back, and the budget's refusals."""

from __future__ import annotations

import numpy as np
import pytest

from mlx_engine import Engine, GenerationRequest, SamplingParams
from mlx_engine.api import RooflineError
from tests.support.tiny_models import GOLDEN

HYBRIDS = ["falcon_h1", "granitemoehybrid", "lfm2", "nemotron_h", "qwen3_5_moe_text", "qwen3_5_text",
           "qwen3_next"]
# three prompts of different lengths: with chunks of 5 the longer ones prefill while the others decode
PROMPTS = [[3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43], [7, 1, 8, 2, 8], [50, 40, 30, 20, 10, 11, 12, 13, 14,
                                                                                 15, 16, 17, 18, 19, 21, 22, 23]]


def run(e: Engine, ids: list[int], max_tokens: int, **sampling) -> list[int]:
    return run_events(e, ids, max_tokens, **sampling)[0]


def run_events(e: Engine, ids: list[int], max_tokens: int, **sampling):
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens, **sampling)
    events = list(e.generate(GenerationRequest(prompt_token_ids=ids, sampling=params)))
    return [t for ev in events for t in ev.token_ids], events


@pytest.fixture(scope="module", params=HYBRIDS)
def family(request):
    with Engine.load(str(GOLDEN / request.param), backend="mlx", prefill_chunk_size=5) as e:
        yield request.param, e


def test_greedy_identical_to_transformers_on_the_paged_cache(family) -> None:
    name, e = family
    gold = dict(np.load(GOLDEN / name / "golden.npz"))
    want = gold["greedy_tokens"].tolist()
    got = run(e, gold["input_ids"].tolist(), len(want))
    assert got == want, f"{name}\n got  {got}\n want {want}"
    stats = e.kv_stats()
    assert stats["kind"] == "paged"
    assert stats["state_slots_used"] == 0 and stats["used"] == 0  # slot and blocks given back
    assert stats["bytes_state"] == stats["state_slots"] * stats["state_bytes_per_slot"] > 0


def test_three_concurrent_equal_each_alone(family, monkeypatch) -> None:
    """Prefill chunks of 5 packed with the others' decode rows in one forward (each recurrent mixer once per part),
    then decode rows batched: each request's tokens equal it alone. nemotron_h (no rope) is not packed."""
    from mlx_engine.kv.state import StateCache

    name, e = family
    alone = [run(e, p, 12) for p in PROMPTS]
    packed = []
    original = StateCache.packed_layers
    monkeypatch.setattr(StateCache, "packed_layers", lambda self, d, k, c: packed.append((len(d), len(c)))
                        or original(self, d, k, c))
    streams = [e.generate(GenerationRequest(prompt_token_ids=p, sampling=SamplingParams(
        temperature=0.0, ignore_eos=True, max_tokens=12))) for p in PROMPTS]
    together = [[t for ev in s for t in ev.token_ids] for s in streams]
    assert together == alone, name
    assert e.kv_stats()["state_slots_used"] == 0
    # mixed steps: decode rows beside prefill chunks in one forward
    assert (name == "nemotron_h") == (not any(d and c for d, c in packed)), (name, packed)


def test_each_plan_names_its_rows_state_slots(monkeypatch) -> None:
    """`StepPlan.state_slots`: a slot per decode row and prefill chunk, in plan order, distinct within a step."""
    from mlx_engine.backends.common import CacheRunner

    plans = []
    execute = CacheRunner.execute
    monkeypatch.setattr(CacheRunner, "execute", lambda self, plan: plans.append(plan) or execute(self, plan))
    with Engine.load(str(GOLDEN / "lfm2"), backend="mlx", prefill_chunk_size=5) as e:
        streams = [e.generate(GenerationRequest(prompt_token_ids=p, sampling=SamplingParams(
            temperature=0.0, ignore_eos=True, max_tokens=6))) for p in PROMPTS]
        [list(s) for s in streams]
    work = [p for p in plans if p.decode or p.prefill]
    assert work and all(len(p.state_slots) == len(p.decode) + len(p.prefill) for p in work)
    assert all(len(set(p.state_slots)) == len(p.state_slots) for p in work if not p.prefill)
    assert max(len(p.decode) for p in work) == 3 and {s for p in work for s in p.state_slots} == {0, 1, 2}


def test_prompt_lookup_rolls_the_state_back_to_plain_greedy(family) -> None:
    """Every token of the vocabulary once in the prompt: whatever the model says, prompt lookup drafts what
    followed it there, the model rejects most (the state goes back to before the verification and the kept tokens
    are read again), and the reply is the plain one, token for token."""
    name, e = family
    ids = list(range(1, 128))
    plain = run(e, ids, 16)
    spec, events = run_events(e, ids, 16, speculative="prompt-lookup")
    assert spec == plain, name
    rate = events[-1].stats.acceptance_rate
    assert rate is not None and rate < 1, (name, rate)  # drafts verified, some rejected


# an attention-only draft with the hybrid's vocabulary and end-of-sequence ids
@pytest.mark.parametrize("name, draft", [("qwen3_next", "qwen3"), ("qwen3_5_text", "qwen3"), ("nemotron_h", "llama"),
                                         ("falcon_h1", "llama"), ("lfm2", "llama")])
def test_draft_model_on_a_hybrid_equals_plain_greedy(name: str, draft: str) -> None:
    """A tiny random draft for a hybrid: most drafts rejected, each rollback exact."""
    ids = PROMPTS[0]
    with Engine.load(str(GOLDEN / name), backend="mlx") as e:
        plain = run(e, ids, 16)
    with Engine.load(str(GOLDEN / name), backend="mlx", draft_model=str(GOLDEN / draft)) as e:
        spec, events = run_events(e, ids, 16, speculative="draft")
        assert e.kv_stats()["state_slots_used"] == 0
    assert spec == plain, name
    rate = events[-1].stats.acceptance_rate
    assert rate is not None and rate < 1, (name, rate)


LONG = [(7 * i + 3) % 127 + 1 for i in range(45)]  # 45 tokens: the state is kept at 16 and 32 in its prefill


def test_prefix_hit_restores_the_state_and_equals_a_cold_run(family) -> None:
    """The same prompt twice, then a next turn (prompt, reply, more): each reuses the cached prefix up to the last
    state snapshot before its end (16 tokens a block, a snapshot every block) and gives the tokens of a cold run."""
    name, e = family
    first, ev1 = run_events(e, LONG, 8)
    again, ev2 = run_events(e, LONG, 8)
    assert ev1[-1].usage.cached_prompt_tokens == 0 and ev2[-1].usage.cached_prompt_tokens == 32, name
    turn = LONG + first + [5, 6, 7]  # 56 tokens: the first turn's state at 48 (a decode step) is kept
    follow, ev3 = run_events(e, turn, 8)
    assert ev3[-1].usage.cached_prompt_tokens == 48, name
    stats = e.kv_stats()
    assert stats["state_snapshots_restored"] >= 2 and stats["state_snapshots"] > 0
    with Engine.load(str(GOLDEN / name), backend="mlx", prefix_caching=False) as cold:
        assert run(cold, LONG, 8) == first == again, name
        assert run(cold, turn, 8) == follow, name


@pytest.mark.parametrize("name", ["qwen3_next", "falcon_h1", "lfm2"])
def test_kv_file_round_trip_carries_the_state(name: str, tmp_path) -> None:
    """save_kv writes the blocks of the longest cached prefix with a state snapshot at its end and that state; a
    fresh engine restores both, and the prompt then prefills only the rest, with a cold run's tokens."""
    path = str(tmp_path / "chat.kv")
    with Engine.load(str(GOLDEN / name), backend="mlx") as e:
        assert e.info.kv_files
        cold = run(e, LONG, 8)
        assert e.save_kv(path, LONG) == 32
    with Engine.load(str(GOLDEN / name), backend="mlx") as fresh:
        assert fresh.restore_kv(path) == 32
        got, events = run_events(fresh, LONG, 8)
        assert events[-1].usage.cached_prompt_tokens == 32 and got == cold, name


def test_kv_file_without_state_is_refused_in_one_line(tmp_path) -> None:
    """A file of an attention-only save (no state in it) is refused before anything is written."""
    import mlx.core as mx

    path = str(tmp_path / "chat.safetensors")
    with Engine.load(str(GOLDEN / "qwen3_next"), backend="mlx") as e:
        run(e, LONG, 2)
        e.save_kv(path, LONG)
        arrays, meta = mx.load(path, format="safetensors", return_metadata=True)
        mx.save_safetensors(path, {k: v for k, v in arrays.items() if not k.startswith("state.")},
                            metadata={k: v for k, v in meta.items() if not k.startswith("state_")})
    with Engine.load(str(GOLDEN / "qwen3_next"), backend="mlx") as fresh:
        with pytest.raises(RooflineError) as err:
            fresh.restore_kv(path)
        line = str(err.value)
        assert "\n" not in line and "holds no recurrent state" in line, line
        assert fresh.kv_stats()["cached"] == 0  # no block of it restored

def test_snapshots_that_do_not_fit_the_budget_turn_prefix_caching_off_with_a_note() -> None:
    with Engine.load(str(GOLDEN / "qwen3_next"), backend="mlx") as e:
        per_slot = e.kv_stats()["state_bytes_per_slot"]
    budget = 4 * 3 * per_slot + 5000  # a quarter holds the three slots and no snapshot
    with Engine.load(str(GOLDEN / "qwen3_next"), backend="mlx", kv_budget_bytes=budget) as e:
        (note,) = [n for n in e.info.notes if "prefix caching" in n]
        assert "\n" not in note and f"kv_budget_bytes={budget}" in note and "snapshot" in note, note
        run(e, LONG, 4)
        assert run_events(e, LONG, 4)[1][-1].usage.cached_prompt_tokens == 0
        assert e.kv_stats()["state_snapshot_capacity"] == 0


def test_prompt_logprobs_through_chunks_carry_the_state(family) -> None:
    """A scoring request prefills in chunks of 5 with its own slot (no prefix reused): each position's log-prob of
    the next prompt token equals one whole forward's (`forward_logits`, the state never leaving the forward)."""
    from tests.support.tolerance import HEADROOM, assert_f32_close

    name, e = family
    events = list(e.generate(GenerationRequest(prompt_token_ids=LONG, sampling=SamplingParams(
        temperature=0.0, max_tokens=1, ignore_eos=True, prompt_logprobs=1))))
    got = [p.logprob for ev in events for p in (ev.prompt_logprobs or [])]
    logits = np.asarray(e.forward_logits(LONG)).astype(np.float64)
    top = logits.max(-1, keepdims=True)
    lp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    want = [lp[i, LONG[i + 1]] for i in range(len(LONG) - 1)]
    # chunked against whole, float32: measured 2.5 (lfm2) to 11.9 (qwen3_5_moe_text) units on the EPYC
    assert_f32_close(got, want, 12 * HEADROOM, name)
    assert e.kv_stats()["state_slots_used"] == 0


def test_state_bytes_match_the_memory_estimate() -> None:
    """The pool's bytes per slot are what `memory` prices a sequence's recurrent state at (mlx-lm's caches)."""
    import json

    from mlx_engine.models.config import normalize_config
    from mlx_engine.models.config_families import state_sizes

    for name in ("qwen3_next", "lfm2", "falcon_h1", "nemotron_h"):
        with Engine.load(str(GOLDEN / name), backend="mlx") as e:
            per_slot = e.kv_stats()["state_bytes_per_slot"]
            assert e.info.dtype == "float32"
        config = normalize_config(json.loads((GOLDEN / name / "config.json").read_text()), name)
        assert per_slot == sum(state_sizes(config)) * 4, name


def test_slots_cap_the_batch_and_come_out_of_the_budget() -> None:
    with Engine.load(str(GOLDEN / "qwen3_next"), backend="mlx") as e:
        per_slot = e.kv_stats()["state_bytes_per_slot"]
    budget = 4 * 3 * per_slot + 5000  # a quarter of it holds three slots (5632 bytes each), the rest 13 blocks
    with Engine.load(str(GOLDEN / "qwen3_next"), backend="mlx", kv_budget_bytes=budget) as e:
        stats = e.kv_stats()
        assert stats["state_slots"] == 3
        assert stats["num_blocks"] == (budget - 3 * per_slot) // stats["bytes_per_block"] == 13
        alone = [run(e, p, 6) for p in PROMPTS + PROMPTS[:1]]
        streams = [e.generate(GenerationRequest(prompt_token_ids=p, sampling=SamplingParams(
            temperature=0.0, ignore_eos=True, max_tokens=6))) for p in PROMPTS + PROMPTS[:1]]
        assert [[t for ev in s for t in ev.token_ids] for s in streams] == alone  # the fourth waits for a slot


def test_budget_too_small_for_one_state_is_one_line() -> None:
    with pytest.raises(RooflineError) as err:
        Engine.load(str(GOLDEN / "qwen3_next"), backend="mlx", kv_budget_bytes=4096)
    line = str(err.value)
    assert "\n" not in line and "kv_budget_bytes=4096" in line and "recurrent state" in line, line


def test_paged_kv_off_keeps_mlx_lm_caches_and_says_what_is_unavailable() -> None:
    """paged_kv=False on a hybrid: mlx-lm's own caches, one sequence at a time, transformers' tokens still, and one
    line saying what that turns off."""
    gold = dict(np.load(GOLDEN / "lfm2" / "golden.npz"))
    want = gold["greedy_tokens"].tolist()
    with Engine.load(str(GOLDEN / "lfm2"), backend="mlx", paged_kv=False) as e:
        assert e.kv_stats()["kind"] == "contiguous"
        (line,) = e.info.warnings
        assert "\n" not in line and "paged_kv=False" in line and "batching" in line, line
        assert run(e, gold["input_ids"].tolist(), len(want)) == want
