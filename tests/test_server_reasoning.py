"""Reasoning on the OpenAI surfaces, through the official `openai` client: a live server over the tiny thinking model
(tests/support/think_models.py: its greedy reply is REASONING, `</think>`, ANSWER) for chat's `reasoning_content`, its
deltas, `reasoning_tokens`, the Responses reasoning item and its events, thinking switched off, and the 400s; the
scripted engine for what the server sends the template and for a model without reasoning."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from mlx_engine import Engine
from mlx_engine.api import GenerationEvent, Usage
from openai.types.responses import (ResponseReasoningItem, ResponseReasoningSummaryPartAddedEvent,
                                    ResponseReasoningSummaryPartDoneEvent, ResponseReasoningSummaryTextDeltaEvent,
                                    ResponseReasoningSummaryTextDoneEvent)

from app.server import create_app
from app.server.responses_api import ResponsesFormatter, parse_responses, response_events
from tests.support.server_fakes import REPLY, THOUGHT, FakeEngine, LiveServer
from tests.support.think_models import ANSWER, REASONING, think_model_folder

HI = [{"role": "user", "content": "Hi?"}]
OFF = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory):
    engine = Engine.load(str(think_model_folder(tmp_path_factory.mktemp("think") / "tags")))
    with LiveServer(create_app(engine), drain_s=5) as s:
        yield openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    engine.close()


def test_chat_message_carries_the_reasoning_apart(client) -> None:
    r = client.chat.completions.create(model="default", messages=HI, max_tokens=30, temperature=0)
    m = r.choices[0].message
    assert (m.content, m.reasoning_content, m.reasoning) == (ANSWER, REASONING, REASONING)
    assert r.choices[0].finish_reason == "stop"
    assert (r.usage.completion_tokens, r.usage.completion_tokens_details.reasoning_tokens) == (14, 9)


def test_chat_streams_reasoning_deltas_then_content(client) -> None:
    chunks = list(client.chat.completions.create(model="default", messages=HI, max_tokens=30, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    kinds = ["r" if getattr(d, "reasoning_content", None) else "c" if d.content else "-" for d in deltas]
    # one delta a token, but for the space in "Why not?", held until the text after it shows it is not trailing
    assert "".join(kinds).strip("-") == "r" * (len(REASONING) - 1) + "c" * len(ANSWER)
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == REASONING
    assert "".join(getattr(d, "reasoning", None) or "" for d in deltas) == REASONING
    assert "".join(d.content or "" for d in deltas) == ANSWER
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == 9


@pytest.mark.parametrize("kw", [{"extra_body": OFF}, {"reasoning_effort": "none"}])
def test_thinking_switched_off_gives_no_reasoning(client, kw) -> None:
    r = client.chat.completions.create(model="default", messages=HI, max_tokens=30, temperature=0, **kw)
    m = r.choices[0].message
    assert (m.content, m.reasoning_content, r.usage.completion_tokens_details.reasoning_tokens) == (ANSWER, None, 0)


def test_a_completion_prompt_that_opens_the_reasoning(client) -> None:
    r = client.completions.create(model="default", prompt="Hi<think>", max_tokens=30, temperature=0)
    c = r.choices[0]
    assert (c.text, c.reasoning_content, r.usage.completion_tokens_details.reasoning_tokens) == (ANSWER, REASONING, 9)
    chunks = list(client.completions.create(model="default", prompt="Hi<think>", max_tokens=30, temperature=0,
                                            stream=True))
    assert "".join(getattr(c.choices[0], "reasoning_content", None) or "" for c in chunks) == REASONING
    assert "".join(c.choices[0].text for c in chunks) == ANSWER


def test_responses_reasoning_item_before_the_message(client) -> None:
    r = client.responses.create(model="default", input="Hi?", max_output_tokens=30, temperature=0)
    assert [o.type for o in r.output] == ["reasoning", "message"]
    item = r.output[0]
    assert isinstance(item, ResponseReasoningItem) and item.id.startswith("rs_")
    assert [(s.type, s.text) for s in item.summary] == [("summary_text", REASONING)]
    assert r.output_text == ANSWER and r.usage.output_tokens_details.reasoning_tokens == 9
    off = client.responses.create(model="default", input="Hi?", max_output_tokens=30, temperature=0,
                                  reasoning={"effort": "none"})
    assert [o.type for o in off.output] == ["message"] and off.output_text == ANSWER
    assert off.reasoning.effort == "none" and off.usage.output_tokens_details.reasoning_tokens == 0


def test_responses_stream_reasoning_events(client) -> None:
    events = list(client.responses.create(model="default", input="Hi?", max_output_tokens=30, temperature=0,
                                          stream=True))
    kinds = [e.type for e in events]
    n_r, n_a = len(REASONING) - 1, len(ANSWER)  # the space in "Why not?" comes with the "n" after it
    assert kinds == ["response.created", "response.in_progress",
                     "response.output_item.added", "response.reasoning_summary_part.added",
                     *["response.reasoning_summary_text.delta"] * n_r, "response.reasoning_summary_text.done",
                     "response.reasoning_summary_part.done", "response.output_item.done",
                     "response.output_item.added", "response.content_part.added", *["response.output_text.delta"] * n_a,
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    by_kind = {e.type: e for e in events}
    for kind, typed in (("text.delta", ResponseReasoningSummaryTextDeltaEvent),
                        ("text.done", ResponseReasoningSummaryTextDoneEvent),
                        ("part.added", ResponseReasoningSummaryPartAddedEvent),
                        ("part.done", ResponseReasoningSummaryPartDoneEvent)):
        assert isinstance(by_kind[f"response.reasoning_summary_{kind}"], typed)  # the SDK's own models
    assert "".join(e.delta for e in events if e.type == "response.reasoning_summary_text.delta") == REASONING
    assert by_kind["response.reasoning_summary_text.done"].text == REASONING
    assert by_kind["response.reasoning_summary_part.done"].part.text == REASONING
    added = [e for e in events if e.type == "response.output_item.added"]
    assert [(e.output_index, e.item.type) for e in added] == [(0, "reasoning"), (1, "message")]
    assert {e.output_index for e in events if e.type == "response.output_text.delta"} == {1}
    final = events[-1].response
    assert [o.type for o in final.output] == ["reasoning", "message"] and final.output_text == ANSWER
    assert final.output[0].summary[0].text == REASONING


@pytest.mark.parametrize("call, param", [
    (lambda c: c.chat.completions.create(model="default", messages=HI, reasoning_effort="extreme"),
     "reasoning_effort"),
    (lambda c: c.chat.completions.create(model="default", messages=HI, extra_body={"chat_template_kwargs": "off"}),
     "chat_template_kwargs"),
    (lambda c: c.chat.completions.create(model="default", messages=HI,
                                         extra_body={"chat_template_kwargs": {"add_generation_prompt": False}}),
     "chat_template_kwargs"),
    (lambda c: c.completions.create(model="default", prompt="Hi", extra_body={"reasoning_effort": "low"}),
     "reasoning_effort"),
    (lambda c: c.responses.create(model="default", input="Hi?", reasoning={"effort": "max"}), "reasoning.effort"),
    (lambda c: c.responses.create(model="default", input="Hi?", extra_body={"reasoning": "high"}), "reasoning"),
])
def test_bad_reasoning_fields_are_400s_naming_the_field(client, call, param) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        call(client)
    assert e.value.param == param and param.split(".")[-1] in e.value.message and "\n" not in e.value.message


@pytest.fixture(scope="module")
def fakes():
    thinking, plain = FakeEngine(reasoning="think"), FakeEngine()
    with LiveServer(create_app(thinking)) as a, LiveServer(create_app(plain)) as b:
        yield (a.url, thinking), (b.url, plain)


def test_the_template_gets_the_reasoning_variables(fakes) -> None:
    (url, thinking), (plain_url, plain) = fakes
    body = {"model": "default", "messages": HI, "max_tokens": 30}
    for effort, want in (("low", {"reasoning_effort": "low"}),
                         ("none", {"reasoning_effort": "none", "enable_thinking": False})):
        r = httpx.post(url + "/v1/chat/completions", json={**body, "reasoning_effort": effort}, timeout=10).json()
        assert thinking.tokenizer.template_kwargs[-1] == want
        thought = None if effort == "none" else THOUGHT
        assert (r["choices"][0]["message"]["reasoning_content"], r["choices"][0]["message"]["content"]) == (thought,
                                                                                                           REPLY)
    r = httpx.post(plain_url + "/v1/chat/completions", json={**body, "reasoning_effort": "none", **OFF},
                   timeout=10).json()
    assert plain.tokenizer.template_kwargs[-1] == {"enable_thinking": False, "reasoning_effort": "none"}
    assert "reasoning_content" not in r["choices"][0]["message"]  # a model without reasoning: the reply as ever
    assert "completion_tokens_details" not in r["usage"]


def test_n_choices_each_stream_their_reasoning(fakes) -> None:
    (url, _), _ = fakes
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=10, json={
            "model": "default", "messages": HI, "n": 2, "stream": True, "max_tokens": 30}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    for i in (0, 1):
        deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"] and c["choices"][0]["index"] == i]
        assert "".join(d.get("reasoning_content", "") for d in deltas) == THOUGHT
        assert "".join(d.get("content") or "" for d in deltas) == REPLY


async def test_a_tool_call_after_the_reasoning_is_the_next_output_item() -> None:
    body = {"model": "fake", "input": "Weather?", "stream": True,
            "tools": [{"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}]}
    job = parse_responses(body, {"fake"}, "fake", context_length=4096, vocab_size=1000)
    call = '{"tool_calls": [{"name": "f", "arguments": {}}]}'

    async def events():
        for r in ("Call ", "f."):
            yield GenerationEvent(reasoning=r, token_ids=(5,))
        for i in range(0, len(call), 7):
            yield GenerationEvent(text=call[i:i + 7], token_ids=(6,))
        yield GenerationEvent(finish_reason="stop", usage=Usage(3, 12, reasoning_tokens=3))

    fmt = ResponsesFormatter(job, "fake", body)
    out = [json.loads(b.split(b"data: ", 1)[1]) async for b in response_events(events(), fmt, True, lambda: "")]
    added = [(e["output_index"], e["item"]["type"]) for e in out if e["type"] == "response.output_item.added"]
    assert added == [(0, "reasoning"), (1, "function_call")]
    final = out[-1]["response"]
    assert [o["type"] for o in final["output"]] == ["reasoning", "function_call"]
    assert final["output"][0]["summary"][0]["text"] == "Call f." and final["output"][1]["name"] == "f"
    assert final["usage"]["output_tokens_details"]["reasoning_tokens"] == 3
