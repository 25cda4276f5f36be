"""Reasoning through the engine on a tiny thinking model whose greedy reply is known (tests/support/think_models.py):
the split on token ids, thinking on and off through the template, the budget's forced closer after exactly N tokens (in
batches, speculating, with a grammar), stop strings on the answer only, and a model without reasoning refusing a
budget."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from mlx_engine import Engine, GenerationRequest, RequestError, ResponseFormat, SamplingParams
from mlx_engine.reasoning import reasoning_family

from tests.support.think_models import ANSWER, REASONING, TEXT_ANSWER, TEXT_REASONING, THINK_CLOSE, think_model_folder

HI = [{"role": "user", "content": "Hi?"}]
REPLY_IDS = [*REASONING.encode(), THINK_CLOSE, *ANSWER.encode()]  # then <|im_end|>
TEXT_CLOSE_IDS = list(b"</think>")


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory):
    e = Engine.load(str(think_model_folder(tmp_path_factory.mktemp("think") / "tags")))
    yield e
    e.close()


@pytest.fixture(scope="module")
def text_engine(tmp_path_factory: pytest.TempPathFactory):
    e = Engine.load(str(think_model_folder(tmp_path_factory.mktemp("think") / "text", tags_as_tokens=False)))
    yield e
    e.close()


def run(engine: Engine, **kw) -> tuple[str, str, list[int], object]:
    sampling = SamplingParams(temperature=0, max_tokens=kw.pop("max_tokens", 40), **kw.pop("sampling", {}))
    events = list(engine.generate(GenerationRequest(messages=kw.pop("messages", HI), sampling=sampling, **kw)))
    return ("".join(e.reasoning for e in events), "".join(e.text for e in events),
            [t for e in events for t in e.token_ids], events[-1])


def test_the_family_is_read_at_load(engine, text_engine) -> None:
    assert engine.info.reasoning == "think" and text_engine.info.reasoning == "think"


def test_reasoning_and_answer_split_on_the_closer_token(engine) -> None:
    reasoning, answer, ids, final = run(engine)
    assert (reasoning, answer, ids) == (REASONING, ANSWER, REPLY_IDS)
    assert final.finish_reason == "stop"
    assert (final.usage.completion_tokens, final.usage.reasoning_tokens) == (14, 9)  # "Why not?" and </think>
    events = list(engine.generate(GenerationRequest(messages=HI, sampling=SamplingParams(temperature=0))))
    assert [(e.reasoning, e.text) for e in events[:3]] == [("W", ""), ("h", ""), ("y", "")]
    assert all("think" not in e.text + e.reasoning for e in events)


def test_text_tags_split_the_same_way(text_engine) -> None:
    reasoning, answer, ids, final = run(text_engine)
    assert (reasoning, answer) == (TEXT_REASONING, TEXT_ANSWER)
    assert ids == [*TEXT_REASONING.encode(), *TEXT_CLOSE_IDS, *TEXT_ANSWER.encode()]
    assert final.usage.reasoning_tokens == len(TEXT_REASONING) + len(TEXT_CLOSE_IDS)


@pytest.mark.parametrize("kw", [{"chat_template_kwargs": {"enable_thinking": False}}, {"reasoning_effort": "none"},
                                {"reasoning_effort": "minimal"}])
def test_thinking_off_through_the_template(engine, kw) -> None:
    reasoning, answer, ids, final = run(engine, **kw)
    assert (reasoning, answer, ids, final.usage.reasoning_tokens) == ("", ANSWER, list(ANSWER.encode()), 0)
    prompt = engine.prompt_ids(GenerationRequest(messages=HI, **kw))
    assert engine.tokenizer.decode(prompt).endswith("<think>\n\n</think>\n\n")


def test_the_request_overrides_reasoning_effort(engine) -> None:
    reasoning, answer, _, _ = run(engine, reasoning_effort="none", chat_template_kwargs={"enable_thinking": True})
    assert (reasoning, answer) == (REASONING, ANSWER)
    assert run(engine, reasoning_effort="high")[:2] == (REASONING, ANSWER)


@pytest.mark.parametrize("budget", [0, 1, 3, 8, 20])
def test_the_budget_forces_the_closer_after_exactly_n_tokens(engine, budget) -> None:
    reasoning, answer, ids, final = run(engine, sampling={"reasoning_budget": budget})
    n = min(budget, len(REASONING))
    assert ids == [*REASONING.encode()[:n], THINK_CLOSE, *ANSWER.encode()]
    assert (reasoning, answer, final.usage.reasoning_tokens) == (REASONING[:n], ANSWER, n + 1)


def test_the_budget_writes_a_text_closer_whole(text_engine) -> None:
    reasoning, answer, ids, final = run(text_engine, sampling={"reasoning_budget": 2})
    assert ids == [*TEXT_REASONING.encode()[:2], *TEXT_CLOSE_IDS, *TEXT_ANSWER.encode()]
    assert (reasoning, answer, final.usage.reasoning_tokens) == (TEXT_REASONING[:2], TEXT_ANSWER, 2 + 8)


def test_budgets_hold_in_one_batch(engine) -> None:
    results: dict[int, list[int]] = {}

    def one(budget: int) -> None:
        results[budget] = run(engine, sampling={"reasoning_budget": budget})[2]

    threads = [threading.Thread(target=one, args=(b,)) for b in (1, 2, 4, 6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {b: [*REASONING.encode()[:b], THINK_CLOSE, *ANSWER.encode()] for b in (1, 2, 4, 6)}


@pytest.mark.parametrize("budget", [None, 2, 5])
def test_speculating_keeps_the_split_and_the_budget(engine, budget) -> None:
    # the prompt holds the whole reply, so prompt lookup drafts it, closer included
    messages = [{"role": "user", "content": "Why not?</think>Sure!"}]
    plain = run(engine, messages=messages, sampling={"reasoning_budget": budget})
    spec = run(engine, messages=messages, sampling={"reasoning_budget": budget, "speculative": "prompt-lookup"})
    assert spec[:3] == plain[:3] and spec[3].usage.reasoning_tokens == plain[3].usage.reasoning_tokens
    assert spec[3].stats.acceptance_rate is not None


def test_a_response_format_holds_the_answer_not_the_reasoning(engine) -> None:
    fmt = ResponseFormat("regex", pattern="ok")
    reasoning, answer, ids, final = run(engine, sampling={"response_format": fmt})
    assert (reasoning, answer, final.finish_reason) == (REASONING, "ok", "stop")
    assert ids == [*REASONING.encode(), THINK_CLOSE, *b"ok"]
    reasoning, answer, ids, _ = run(engine, sampling={"response_format": fmt, "reasoning_budget": 2})
    assert (reasoning, answer, ids) == ("Wh", "ok", [*b"Wh", THINK_CLOSE, *b"ok"])


def test_stop_strings_apply_to_the_answer(engine) -> None:
    reasoning, answer, _, final = run(engine, sampling={"stop": ("y",)})  # "y" is in the reasoning only
    assert (reasoning, answer, final.finish_reason) == (REASONING, ANSWER, "stop")
    reasoning, answer, _, final = run(engine, sampling={"stop": ("r",)})
    assert (reasoning, answer, final.finish_reason) == (REASONING, "Su", "stop")


def test_length_cuts_inside_the_reasoning(engine) -> None:
    reasoning, answer, _, final = run(engine, max_tokens=4)
    assert (reasoning, answer, final.finish_reason, final.usage.reasoning_tokens) == ("Why", "", "length", 4)


def test_a_model_without_reasoning_refuses_a_budget_and_ignores_thinking_switches(tmp_path: Path) -> None:
    from mlx_engine.loading import embedded_model_path
    from mlx_engine.loading.gguf_file import read_gguf
    from mlx_engine.tokenizer import Tokenizer

    assert reasoning_family(Tokenizer.from_gguf(read_gguf(embedded_model_path()).metadata)) is None
    folder = think_model_folder(tmp_path / "plain")
    plain_template = "{% for m in messages %}{{ m.role + ': ' + m.content + '\\n' }}{% endfor %}assistant:"
    with Engine.load(str(folder), chat_template=plain_template) as e:
        assert e.info.reasoning is None
        with pytest.raises(RequestError, match=r"^invalid sampling parameter reasoning_budget=4: .* does not reason"):
            e.generate(GenerationRequest(messages=HI, sampling=SamplingParams(reasoning_budget=4)))
        off = GenerationRequest(messages=HI, reasoning_effort="none", chat_template_kwargs={"enable_thinking": False})
        assert e.prompt_ids(off) == e.prompt_ids(GenerationRequest(messages=HI))
        events = list(e.generate(GenerationRequest(prompt_token_ids=[*b"Hi", 126], sampling=SamplingParams(
            temperature=0, max_tokens=5))))
        assert all(not ev.reasoning for ev in events) and events[-1].usage.reasoning_tokens == 0
        assert "".join(ev.text for ev in events) == "Why n"
