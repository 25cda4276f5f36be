"""Engine behaviour on the tiny golden llama: prefix reuse across turns, cancellation, seeds, EOS, logprobs."""

from __future__ import annotations

import numpy as np
import pytest

from mlx_engine import Engine, GenerationRequest, SamplingParams
from mlx_engine.stop import StopStringMatcher
from tests.support.tiny_models import GOLDEN

PROMPT = [3, 17, 42, 99, 7, 64, 120, 5] * 5  # 40 tokens: two full blocks of 16


@pytest.fixture(scope="module", params=["paged", "contiguous"])
def engine(request) -> Engine:
    with Engine.load(str(GOLDEN / "llama"), paged_kv=request.param == "paged") as e:
        yield e


def reusable(engine: Engine, n: int) -> int:
    """Prompt tokens a cache can reuse out of n held: whole blocks (paged) or all of them (contiguous)."""
    stats = engine.kv_stats()
    return n - n % stats["block_size"] if stats["kind"] == "paged" else n


def run(engine: Engine, ids: list[int], **sampling) -> tuple[list[int], object]:
    sampling.setdefault("temperature", 0.0)
    sampling.setdefault("ignore_eos", True)
    events = list(engine.generate(GenerationRequest(prompt_token_ids=ids, sampling=SamplingParams(**sampling))))
    return [t for e in events for t in e.token_ids], events[-1]


def fresh(ids: list[int], **sampling) -> list[int]:
    with Engine.load(str(GOLDEN / "llama")) as e:
        return run(e, ids, **sampling)[0]


def test_next_turn_prefills_only_the_new_suffix(engine: Engine) -> None:
    first, final = run(engine, PROMPT, max_tokens=6)
    assert final.usage.cached_prompt_tokens == 0 and final.usage.completion_tokens == 6
    turn2 = PROMPT + first + [11, 12, 13]
    second, final2 = run(engine, turn2, max_tokens=6)
    # everything the cache holds is reused: the prompt and the reply tokens that were fed back
    assert final2.usage.cached_prompt_tokens == reusable(engine, len(PROMPT) + len(first) - 1)
    assert second == fresh(turn2, max_tokens=6)


def test_diverging_prompt_trims_to_common_prefix(engine: Engine) -> None:
    run(engine, PROMPT, max_tokens=4)
    other = PROMPT[:35] + [1, 2, 3]
    tokens, final = run(engine, other, max_tokens=5)
    assert final.usage.cached_prompt_tokens == reusable(engine, 35)
    assert tokens == fresh(other, max_tokens=5)


def test_cancel_mid_reply_then_next_request_is_exact(engine: Engine) -> None:
    stream = engine.generate(GenerationRequest(prompt_token_ids=PROMPT, sampling=SamplingParams(
        temperature=0.0, max_tokens=30, ignore_eos=True)))
    got = []
    for event in stream:
        got.extend(event.token_ids)
        if len(got) >= 3:
            stream.cancel()
        if event.done:
            assert event.finish_reason == "cancelled"
    assert 3 <= len(got) < 30
    tokens, _ = run(engine, PROMPT + [9, 9], max_tokens=5)
    assert tokens == fresh(PROMPT + [9, 9], max_tokens=5)


def test_seed_reproducible_and_seeds_differ(engine: Engine) -> None:
    a, _ = run(engine, PROMPT, temperature=1.0, seed=7, max_tokens=12)
    b, _ = run(engine, PROMPT, temperature=1.0, seed=7, max_tokens=12)
    c, _ = run(engine, PROMPT, temperature=1.0, seed=8, max_tokens=12)
    assert a == b
    assert a != c


def test_eos_stops_and_is_not_emitted(engine: Engine) -> None:
    tokens, final = run(engine, PROMPT, ignore_eos=False, logit_bias={2: 100.0}, max_tokens=5)
    assert tokens == [] and final.finish_reason == "stop" and final.usage.completion_tokens == 0


def test_max_tokens_and_context_end_give_length(engine: Engine) -> None:
    tokens, final = run(engine, PROMPT, max_tokens=3)
    assert len(tokens) == 3 and final.finish_reason == "length"
    long = [5] * 250  # context 256: only 6 tokens fit
    tokens, final = run(engine, long, max_tokens=50)
    assert len(tokens) == 6 and final.finish_reason == "length"


def test_logprobs_match_forward_logits(engine: Engine) -> None:
    events = list(engine.generate(GenerationRequest(prompt_token_ids=PROMPT, sampling=SamplingParams(
        temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=3))))
    steps = [lp for e in events for lp in e.logprobs]
    tokens = [t for e in events for t in e.token_ids]
    logits = engine.forward_logits(PROMPT + tokens[:-1])
    for i, lp in enumerate(steps):
        row = logits[len(PROMPT) - 1 + i].astype(np.float64)
        ref = row - np.log(np.exp(row - row.max()).sum()) - row.max()
        assert lp.token_id == tokens[i] == int(np.argmax(row))
        assert abs(lp.logprob - ref[tokens[i]]) < 1e-4
        assert [t for t, _ in lp.top] == list(np.argsort(-row)[:3])


def test_forward_logits_leaves_chat_cache_alone(engine: Engine) -> None:
    run(engine, PROMPT, max_tokens=2)
    engine.forward_logits([1, 2, 3])
    _, final = run(engine, PROMPT + [4], max_tokens=1)
    assert final.usage.cached_prompt_tokens == reusable(engine, len(PROMPT))


def test_stats_are_filled(engine: Engine) -> None:
    _, final = run(engine, [8, 9, 10, 11], max_tokens=8)
    s = final.stats
    assert s.ttft_s > 0 and s.prefill_tps > 0 and s.decode_tps > 0 and s.peak_memory_bytes > 0


@pytest.mark.parametrize(
    "chunks, stops, expected, hit",
    [
        (["Hello wor", "ld. Bye"], ("world",), ["Hello ", ""], True),
        (["a<", "/s", "> tail"], ("</s>",), ["a", "", ""], True),
        (["ab", "c"], ("abd",), ["", "abc"], False),  # held while it may still match, then released
        (["x", "y"], (), ["x", "y"], False),
    ],
)
def test_stop_strings_never_emitted(chunks, stops, expected, hit) -> None:
    m = StopStringMatcher(stops)
    outs, reached = [], False
    for c in chunks:
        out, reached = m.feed(c)
        outs.append(out)
        if reached:
            break
    assert outs == expected[: len(outs)] and reached == hit
    if not hit:
        assert "".join(outs) + m.flush() == "".join(chunks)


@pytest.mark.parametrize("bad", [0, -1, 2.0, True, "4"])
def test_max_seqs_must_be_a_positive_integer_before_anything_loads(bad) -> None:
    from mlx_engine.api import RooflineError

    with pytest.raises(RooflineError, match=r"max_seqs=.*expected an integer >= 1"):
        Engine.load("/no/such/model", max_seqs=bad)  # refused before the path is looked at


def test_max_seqs_caps_the_running_batch_and_keeps_the_tokens() -> None:
    with Engine.load(str(GOLDEN / "llama"), max_seqs=2) as e:
        diag = e.diagnostics()
        assert diag.scheduler.max_seqs == 2
        diag.call(lambda: setattr(diag.scheduler, "trace", []))  # (decoding rows, prefill tokens) per step
        params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=6)
        prompts = [PROMPT[i:] for i in range(3)]
        streams = [e.generate(GenerationRequest(prompt_token_ids=p, sampling=params)) for p in prompts]
        got = [[t for ev in s for t in ev.token_ids] for s in streams]
        assert max(rows for rows, _ in diag.scheduler.trace) == 2  # never the third beside the two
    assert got == [fresh(p, max_tokens=6) for p in prompts]
