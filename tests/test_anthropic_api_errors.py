"""The Messages API over a scripted engine (no model): a reasoning model's thinking blocks, failures mid-stream, bad
input, and the HTTP layer's refusals, all in Anthropic's shape, through the `anthropic` client where it can send
them."""

from __future__ import annotations

import json
import threading

import anthropic
import httpx
import pytest

from app.server import ServerConfig, create_app
from app.server.anthropic_api import parse_messages
from app.server.errors import APIError
from tests.support.server_fakes import REPLY, THOUGHT, FakeEngine, LiveServer, wait_until

HI = [{"role": "user", "content": "hi"}]
GOOD = {"model": "default", "max_tokens": 30, "messages": HI}
KEY = "sekret-key"


@pytest.fixture(scope="module")
def engine() -> FakeEngine:
    return FakeEngine(reasoning="think")


@pytest.fixture(scope="module")
def url(engine: FakeEngine):
    with LiveServer(create_app(engine, ServerConfig(max_body_bytes=4096))) as s:
        yield s.url


@pytest.fixture(scope="module")
def client(url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=10)


def events(url: str, body: dict) -> list[tuple[str, dict]]:
    with httpx.stream("POST", url + "/v1/messages", json={**body, "stream": True}, timeout=10) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    out = [(name[7:], json.loads(data[6:])) for name, data in zip(lines[::2], lines[1::2])]
    assert all(data["type"] == name for name, data in out)
    return out


def prompt_text(engine: FakeEngine) -> str:
    return engine.tokenizer.decode(engine.requests[-1].prompt_token_ids)


def test_a_reasoning_models_thinking_is_a_thinking_block(client, engine) -> None:
    r = client.messages.create(**GOOD)
    assert [b.type for b in r.content] == ["thinking", "text"]
    assert r.content[0].thinking == THOUGHT and len(r.content[0].signature) == 64 and r.content[1].text == REPLY
    assert r.stop_reason == "end_turn" and r.usage.output_tokens == len(THOUGHT) + 1 + len(REPLY)  # the closer is a token too

    with client.messages.stream(**GOOD) as stream:
        thought = [e.thinking for e in stream if e.type == "thinking"]
        final = stream.get_final_message()
    assert thought == list(THOUGHT) and final.content[0].signature == r.content[0].signature
    assert [(b.type, getattr(b, "thinking", None) or b.text) for b in final.content] == [("thinking", THOUGHT),
                                                                                         ("text", REPLY)]


def test_a_thinking_stream_in_anthropics_order(url: str) -> None:
    got = events(url, GOOD)
    names = [name for name, _ in got]
    assert names == ["message_start", "content_block_start", "ping", *["content_block_delta"] * (len(THOUGHT) + 1),
                     "content_block_stop", "content_block_start", *["content_block_delta"] * len(REPLY),
                     "content_block_stop", "message_delta", "message_stop"]
    data = [d for _, d in got]
    assert data[1]["content_block"] == {"type": "thinking", "thinking": "", "signature": ""}
    thinking = data[3:3 + len(THOUGHT) + 1]
    assert [d["delta"] for d in thinking[:-1]] == [{"type": "thinking_delta", "thinking": c} for c in THOUGHT]
    assert thinking[-1]["delta"]["type"] == "signature_delta" and len(thinking[-1]["delta"]["signature"]) == 64
    assert {d["index"] for d in thinking} == {0} and data[4 + len(THOUGHT)] == {"type": "content_block_stop",
                                                                                 "index": 0}
    text = data[6 + len(THOUGHT):6 + len(THOUGHT) + len(REPLY)]
    assert data[5 + len(THOUGHT)]["content_block"] == {"type": "text", "text": ""}
    assert "".join(d["delta"]["text"] for d in text) == REPLY and {d["index"] for d in text} == {1}
    assert data[-2]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert data[-2]["usage"]["output_tokens"] == len(THOUGHT) + 1 + len(REPLY)


def test_thinking_budget_and_disabled_reach_the_engine(client, engine) -> None:
    r = client.messages.create(**GOOD, thinking={"type": "enabled", "budget_tokens": 3})
    assert engine.requests[-1].sampling.reasoning_budget == 3
    assert [b.thinking if b.type == "thinking" else b.text for b in r.content] == [THOUGHT[:3], REPLY]
    r = client.messages.create(**GOOD, thinking={"type": "disabled"})
    assert engine.requests[-1].chat_template_kwargs == {"enable_thinking": False}
    assert [b.type for b in r.content] == ["text"] and r.usage.output_tokens == len(REPLY)
    r = client.messages.create(**GOOD, thinking={"type": "adaptive"})
    req = engine.requests[-1]
    assert (req.sampling.reasoning_budget, req.chat_template_kwargs) == (None, None)
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(**GOOD, thinking={"type": "enabled", "budget_tokens": 30})
    assert e.value.body["error"]["message"] == ("'thinking.budget_tokens' (30) must be less than 'max_tokens' (30), "
                                                "which counts the thinking too")


def test_earlier_thinking_and_tool_results_in_the_prompt(client, engine) -> None:
    """Thinking blocks of earlier turns are dropped; a tool_use goes back as the JSON the model writes; an error
    result says so; text after a result is a user turn of its own."""
    messages = [{"role": "user", "content": "a"},
                {"role": "assistant", "content": [{"type": "thinking", "thinking": "SECRET", "signature": "x"},
                                                  {"type": "redacted_thinking", "data": "xx"},
                                                  {"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "no",
                                              "is_error": True}, {"type": "text", "text": "b"}]}]
    job = parse_messages({"model": "default", "messages": messages}, {"default"}, "fake", 64, 1000, "think",
                         count_only=True)
    assert job.messages == [{"role": "user", "content": "a"},
                            {"role": "assistant", "content": '{"tool_calls": [{"name": "f", "arguments": {}}]}'},
                            {"role": "tool", "content": "Error: no"}, {"role": "user", "content": "b"}]
    counted = client.messages.count_tokens(model="default", messages=messages)  # (past the fake's context of 64)
    assert counted.input_tokens == len('<user>a<assistant>{"tool_calls": [{"name": "f", "arguments": {}}]}'
                                       "<tool>Error: no<user>b<assistant><think>")  # the template opens it
    client.messages.create(model="default", max_tokens=2, messages=[*messages[:1], {**messages[1], "content": [
        *messages[1]["content"][:2], {"type": "text", "text": "c"}]}, {"role": "user", "content": "d"}])
    assert prompt_text(engine) == "<user>a<assistant>c<user>d<assistant><think>"


def test_stop_sequences_are_named(client) -> None:
    r = client.messages.create(**GOOD, thinking={"type": "disabled"}, stop_sequences=["x", "wor"])
    assert (r.stop_reason, r.stop_sequence) == ("stop_sequence", "wor")
    r = client.messages.create(**{**GOOD, "max_tokens": 4}, thinking={"type": "disabled"}, stop_sequences=["wor"])
    assert (r.stop_reason, r.stop_sequence, r.content[0].text) == ("max_tokens", None, REPLY[:4])


def test_a_failure_mid_stream_is_an_error_event(url: str, client, engine) -> None:
    for prompt, message in (("[raise]", "the generation failed: RuntimeError: the fake engine broke down"),
                            ("[error]", "the generation failed: the fake engine failed this request")):
        body = {**GOOD, "messages": [{"role": "user", "content": prompt}], "thinking": {"type": "disabled"}}
        got = events(url, body)
        assert got[-1] == ("error", {"type": "error", "error": {"type": "api_error", "message": message}})
        assert "message_stop" not in [name for name, _ in got]
        with pytest.raises(anthropic.APIStatusError) as e:
            with client.messages.stream(**body) as stream:
                list(stream)
        assert message in str(e.value)
        with pytest.raises(anthropic.InternalServerError) as e:
            client.messages.create(**body)
        assert e.value.body == {"type": "error", "error": {"type": "api_error", "message": message}}
    assert wait_until(lambda: engine.active == 0)


def test_a_dropped_stream_cancels_its_generation(url: str, engine) -> None:
    before = len(engine.streams)
    body = {**GOOD, "max_tokens": 20, "messages": [{"role": "user", "content": "[slow][long]"}], "stream": True}
    with httpx.stream("POST", url + "/v1/messages", json=body, timeout=10) as r:
        assert next(r.iter_lines()) == "event: message_start"
    assert wait_until(lambda: engine.active == 0)
    assert engine.streams[before].cancelled.is_set()


BAD = [
    ({"max_tokens": 5, "messages": HI}, "you must provide a model"),
    ({**GOOD, "messages": []}, "'messages' must be a non-empty array"),
    ({**GOOD, "messages": [{"role": "system", "content": "x"}]}, "'messages[0].role' must be 'user' or 'assistant'"),
    ({**GOOD, "messages": [*HI, {"role": "assistant", "content": "The answer is"}]},
     "'messages[1]': the conversation ends with an assistant turn"),
    ({**GOOD, "messages": [{"role": "user", "content": 3}]}, "'messages[0].content' must be a string or an array"),
    ({**GOOD, "messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
     "'messages[0].content[0].type' is 'document': this model reads text only"),
    ({**GOOD, "messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": {}}]}]},
     "'messages[0].content[0].type' 'tool_use' is not supported in a user turn"),
    ({**GOOD, "messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "a", "content": "x"}]}]},
     "'messages[0].content[0].tool_use_id' \"a\" answers no tool_use block"),
    ({**GOOD, "messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
     "messages[0] contains an unpaired UTF-16 surrogate"),
    ({**GOOD, "system": [{"type": "image"}]}, "'system[0].type' \"image\" is not supported"),
    ({**GOOD, "temperature": 1.5}, "'temperature' must be in [0, 1], got 1.5"),
    ({**GOOD, "temperature": 3}, "'temperature' must be in [0, 1], got 3"),
    ({**GOOD, "temperature": "hot"}, "'temperature' must be a number"),
    ({**GOOD, "top_k": "5"}, "'top_k' must be an integer"),
    ({**GOOD, "stop_sequences": "x"}, "'stop_sequences' must be an array of non-empty strings"),
    ({**GOOD, "tools": [{"name": "f"}]}, "'tools[0].input_schema' is required"),
    ({**GOOD, "tools": [{"name": "bad name", "input_schema": {"type": "object"}}]}, "'tools[0].name' must be 1-64"),
    ({**GOOD, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
     "'tools[0].type' 'web_search_20250305' is not available"),
    ({**GOOD, "tool_choice": {"type": "any"}}, "'tool_choice' needs 'tools'"),
    ({**GOOD, "tool_choice": {"type": "tool"}}, "'tool_choice.name' is required"),
    ({**GOOD, "tool_choice": "auto"}, "'tool_choice' must be {'type': 'auto'}"),
    ({**GOOD, "thinking": {"type": "on"}}, "'thinking' must be {'type': 'enabled', 'budget_tokens': N}"),
    ({**GOOD, "thinking": {"type": "enabled"}}, "'thinking.budget_tokens' must be an integer >= 1, got null"),
    ({**GOOD, "output_config": {"format": {"type": "json_object"}}},
     "'output_config.format' must be {'type': 'json_schema', 'schema': {...}}"),
    ({**GOOD, "output_config": {"format": {"type": "json_schema", "schema": {}}},
      "tools": [{"name": "f", "input_schema": {"type": "object"}}]}, "'output_config.format' cannot be combined"),
    ({**GOOD, "messages": [{"role": "user", "content": "x" * 60}]}, "context length is 64 tokens"),
]


@pytest.mark.parametrize("body, words", BAD)
def test_bad_input_is_a_400_naming_the_field(url: str, body: dict, words: str) -> None:
    r = httpx.post(url + "/v1/messages", content=json.dumps(body), timeout=10)  # (a lone surrogate as \ud800)
    assert r.status_code == 400, r.text
    error = r.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert words in error["error"]["message"], error
    assert httpx.post(url + "/v1/messages", json=GOOD, timeout=10).status_code == 200


def test_http_refusals_in_anthropics_shape(url: str) -> None:
    def error(r: httpx.Response) -> tuple[int, str]:
        assert r.json()["type"] == "error"
        return r.status_code, r.json()["error"]["type"]

    assert error(httpx.post(url + "/v1/messages", content=b"{", timeout=10)) == (400, "invalid_request_error")
    assert error(httpx.post(url + "/v1/messages", json={**GOOD, "system": "x" * 5000})) == (413, "request_too_large")
    assert error(httpx.get(url + "/v1/messages")) == (405, "invalid_request_error")
    assert error(httpx.post(url + "/v1/messages/batches", json=GOOD)) == (404, "not_found_error")
    assert error(httpx.post(url + "/v1/messages", json={**GOOD, "model": "claude-3-haiku"})) == (404, "not_found_error")
    assert error(httpx.get(url + "/v1/models/nope", headers={"anthropic-version": "2023-06-01"})) == (
        404, "not_found_error")
    assert error(httpx.post(url + "/v1/messages", json=GOOD, headers={"Origin": "https://evil.example"})) == (
        403, "permission_error")
    assert "error" in httpx.get(url + "/v1/models/nope").json()  # OpenAI's shape, for OpenAI's clients
    draining = APIError(503, "the server is shutting down", None, "server_shutting_down").response(anthropic=True)
    assert draining.status_code == 529 and json.loads(draining.body)["error"]["type"] == "overloaded_error"


def test_beyond_concurrency_and_queue_a_rate_limit_error() -> None:
    engine = FakeEngine()
    with LiveServer(create_app(engine, ServerConfig(api_key=KEY, max_concurrency=1, max_queue=0))) as s:
        client = anthropic.Anthropic(base_url=s.url, api_key=KEY, max_retries=0, timeout=10)
        slow = {**GOOD, "messages": [{"role": "user", "content": "[slow][long]"}]}
        busy = threading.Thread(target=lambda: client.messages.create(**slow))
        busy.start()
        assert wait_until(lambda: engine.active == 1)
        with pytest.raises(anthropic.RateLimitError) as e:
            client.messages.create(**GOOD)
        assert e.value.body["error"]["type"] == "rate_limit_error" and e.value.response.headers["retry-after"] == "1"
        busy.join()
        with pytest.raises(anthropic.AuthenticationError):
            anthropic.Anthropic(base_url=s.url, api_key="wrong", max_retries=0).messages.create(**GOOD)
        assert client.messages.create(**GOOD).content[0].text == REPLY
