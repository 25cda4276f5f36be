"""Anthropic's Messages API as programs use it: the official `anthropic` client against a live server on the embedded
model, checked against the OpenAI chat route on the same engine (the same conversation, the same tokens).

One server for the module (uvicorn in a thread, free loopback port), and a second app with an API key over the same
engine. The SDK (2.x) has no `temperature` argument any more: greedy requests send it in `extra_body`.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

from app.server import ServerConfig, create_app
from tests.support.server_fakes import LiveServer

HI = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0}
KEY = "sekret-key"
WEATHER = {"name": "get_weather", "description": "Current weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"},
                                                             "unit": {"enum": ["celsius", "fahrenheit"]}},
                            "required": ["city"]}}
CHAT_WEATHER = {"type": "function", "function": {"name": WEATHER["name"], "description": WEATHER["description"],
                                                 "parameters": WEATHER["input_schema"]}}
ASK = [{"role": "user", "content": "What's the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def chat(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model_id(chat) -> str:
    return chat.models.list().data[0].id


def raw_events(url: str, body: dict, **headers: str) -> list[tuple[str, dict]]:
    """A streamed request's SSE events as (event line, data), in order: what the SDK reads, pings included."""
    out = []
    with httpx.stream("POST", url + "/v1/messages", json={**body, "stream": True}, headers=headers, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    for name, data in zip(lines[::2], lines[1::2]):
        assert name.startswith("event: ") and data.startswith("data: ")
        out.append((name[7:], json.loads(data[6:])))
    return out


def test_a_reply_is_the_chat_reply_to_the_same_conversation(client, chat, model_id) -> None:
    """Greedy, the Messages reply is the chat completion's text, token for token, with its usage; `system` as text
    blocks (with cache_control, ignored) is the chat's system message; ended by max_tokens it says so."""
    r = client.messages.create(model=model_id, max_tokens=30, messages=HI, extra_body=GREEDY)
    c = chat.chat.completions.create(model=model_id, max_tokens=30, messages=HI, temperature=0)
    assert r.type == "message" and r.role == "assistant" and r.id.startswith("msg_") and r.model == model_id
    assert [b.type for b in r.content] == ["text"] and r.content[0].text == c.choices[0].message.content
    assert r.content[0].text == "The capital of France is Paris."
    assert (r.stop_reason, r.stop_sequence, c.choices[0].finish_reason) == ("end_turn", None, "stop")
    assert r.usage.input_tokens + r.usage.cache_read_input_tokens == c.usage.prompt_tokens
    assert r.usage.output_tokens == c.usage.completion_tokens == 7 and r.usage.cache_creation_input_tokens == 0

    system = [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}]
    r = client.messages.create(model=model_id, max_tokens=5, system=system, messages=HI, extra_body=GREEDY)
    c = chat.chat.completions.create(model=model_id, max_tokens=5, temperature=0,
                                     messages=[{"role": "system", "content": "Be brief."}, *HI])
    assert r.content[0].text == c.choices[0].message.content and r.stop_reason == "max_tokens"
    assert r.usage.output_tokens == 5
    # the same prompt again: the prefix cache serves its full blocks, and Anthropic's usage counts them apart
    again = client.messages.create(model=model_id, max_tokens=5, system=system, messages=HI, extra_body=GREEDY)
    assert again.usage.cache_read_input_tokens > 0
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == c.usage.prompt_tokens


def test_a_stream_sends_anthropics_events_in_order(server, client, model_id) -> None:
    body = {"model": model_id, "max_tokens": 30, "messages": HI, **GREEDY}
    events = raw_events(server.url, body)
    names = [name for name, _ in events]
    assert all(data["type"] == name for name, data in events)
    n = names.count("content_block_delta")
    assert n == 7 and names == ["message_start", "content_block_start", "ping", *["content_block_delta"] * n,
                                "content_block_stop", "message_delta", "message_stop"]
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["id"].startswith("msg_")
    assert events[1][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    deltas = [data["delta"] for name, data in events if name == "content_block_delta"]
    assert {d["type"] for d in deltas} == {"text_delta"}
    assert "".join(d["text"] for d in deltas) == "The capital of France is Paris."
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "end_turn", "stop_sequence": None} and delta["usage"]["output_tokens"] == 7
    assert delta["usage"]["input_tokens"] + delta["usage"]["cache_read_input_tokens"] == start["usage"]["input_tokens"]

    with client.messages.stream(model=model_id, max_tokens=30, messages=HI, extra_body=GREEDY) as stream:
        texts = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(texts) == final.content[0].text == "The capital of France is Paris." and len(texts) == 7
    assert final.stop_reason == "end_turn" and final.usage.output_tokens == 7
    kinds = [e.type for e in client.messages.create(model=model_id, max_tokens=3, messages=HI, stream=True,
                                                     extra_body=GREEDY)]
    assert kinds == ["message_start", "content_block_start", "content_block_delta", "content_block_delta",
                     "content_block_delta", "content_block_stop", "message_delta", "message_stop"]  # (no ping)


def test_stop_sequences_name_the_one_that_ended_the_reply(server, client, chat, model_id) -> None:
    r = client.messages.create(model=model_id, max_tokens=30, messages=HI, stop_sequences=["zzz", "Paris"],
                               extra_body=GREEDY)
    c = chat.chat.completions.create(model=model_id, max_tokens=30, messages=HI, temperature=0, stop=["zzz", "Paris"])
    assert (r.stop_reason, r.stop_sequence) == ("stop_sequence", "Paris")
    assert r.content[0].text == c.choices[0].message.content == "The capital of France is "
    events = raw_events(server.url, {"model": model_id, "max_tokens": 30, "messages": HI, "stop_sequences": ["Paris"],
                                     **GREEDY})
    assert events[-2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "Paris"}
    r = client.messages.create(model=model_id, max_tokens=30, messages=HI, stop_sequences=["zzz"], extra_body=GREEDY)
    assert (r.stop_reason, r.stop_sequence) == ("end_turn", None)  # EOS, though stop sequences were sent


def test_a_forced_tool_use_and_its_result(server, client, chat, model_id) -> None:
    """tool_choice {"type": "tool"}: one tool_use block whose input holds to the schema, the chat route's call
    exactly; streamed, the same input as one input_json_delta; its tool_result turn gets an answer, from the same
    prompt tokens as the chat route's tool message."""
    r = client.messages.create(model=model_id, max_tokens=60, messages=ASK, tools=[WEATHER],
                               tool_choice={"type": "tool", "name": "get_weather"}, extra_body=GREEDY)
    [use] = r.content
    assert use.type == "tool_use" and use.name == "get_weather" and use.id.startswith("toolu_")
    assert r.stop_reason == "tool_use" and r.stop_sequence is None
    assert use.input == {"city": "Paris", "unit": "celsius"}
    assert isinstance(use.input["city"], str) and set(use.input) <= {"city", "unit"}  # the schema's keys,
    assert use.input.get("unit", "celsius") in WEATHER["input_schema"]["properties"]["unit"]["enum"]  # its enum
    c = chat.chat.completions.create(model=model_id, max_tokens=60, messages=ASK, tools=[CHAT_WEATHER], temperature=0,
                                     tool_choice={"type": "function", "function": {"name": "get_weather"}})
    [call] = c.choices[0].message.tool_calls
    assert json.loads(call.function.arguments) == use.input
    assert r.usage.input_tokens + r.usage.cache_read_input_tokens == c.usage.prompt_tokens
    assert r.usage.output_tokens == c.usage.completion_tokens

    events = raw_events(server.url, {"model": model_id, "max_tokens": 60, "messages": ASK, "tools": [WEATHER],
                                     "tool_choice": {"type": "any"}, **GREEDY})
    assert [name for name, _ in events] == ["message_start", "content_block_start", "ping", "content_block_delta",
                                            "content_block_stop", "message_delta", "message_stop"]
    block, delta = events[1][1]["content_block"], events[3][1]["delta"]
    assert block["type"] == "tool_use" and block["name"] == "get_weather" and block["input"] == {}
    assert delta["type"] == "input_json_delta" and json.loads(delta["partial_json"]) == use.input
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"
    with client.messages.stream(model=model_id, max_tokens=60, messages=ASK, tools=[WEATHER],
                                tool_choice={"type": "any"}, extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    assert final.content[0].input == use.input and final.stop_reason == "tool_use"

    history = [*ASK, {"role": "assistant", "content": [use.model_dump(exclude_none=True)]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                             "content": [{"type": "text", "text": "18 degrees and sunny"}]}]}]
    follow = client.messages.create(model=model_id, max_tokens=40, messages=history, tools=[WEATHER],
                                    extra_body=GREEDY)
    chat_history = [*ASK, c.choices[0].message.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"}]
    cf = chat.chat.completions.create(model=model_id, max_tokens=40, messages=chat_history, tools=[CHAT_WEATHER],
                                      temperature=0)
    assert follow.stop_reason == "end_turn" and [b.type for b in follow.content] == ["text"]  # an answer: loop ends
    assert follow.content[0].text == cf.choices[0].message.content == "The weather in Paris is sunny and warm."
    assert follow.usage.input_tokens + follow.usage.cache_read_input_tokens == cf.usage.prompt_tokens
    counted = client.messages.count_tokens(model=model_id, messages=history, tools=[WEATHER])
    assert counted.input_tokens == cf.usage.prompt_tokens


def test_count_tokens_is_the_chat_routes_prompt(client, chat, model_id) -> None:
    c = chat.chat.completions.create(model=model_id, max_tokens=1, messages=HI)
    assert client.messages.count_tokens(model=model_id, messages=HI).input_tokens == c.usage.prompt_tokens == 37
    with_tools = client.messages.count_tokens(model=model_id, messages=ASK, tools=[WEATHER])
    c = chat.chat.completions.create(model=model_id, max_tokens=1, messages=ASK, tools=[CHAT_WEATHER])
    assert with_tools.input_tokens == c.usage.prompt_tokens
    assert with_tools.input_tokens > client.messages.count_tokens(model=model_id, messages=ASK).input_tokens


@pytest.mark.parametrize("max_tokens, words", [(0, "'max_tokens' must be an integer >= 1, got 0"),
                                                (None, "'max_tokens' is required"),
                                                ("5", "'max_tokens' must be an integer, got a string"),
                                                (9000, "'max_tokens' is 9000 but the model's context is 8192")])
def test_a_bad_max_tokens_is_a_bad_request_in_anthropics_shape(client, model_id, max_tokens, words) -> None:
    body = {"model": model_id, "messages": HI, **({} if max_tokens is None else {"max_tokens": max_tokens})}
    with pytest.raises(anthropic.BadRequestError) as e:
        client.post("/v1/messages", cast_to=object, body=body)  # the raw body: the SDK would not send some of these
    assert e.value.status_code == 400 and e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "invalid_request_error" and words in e.value.body["error"]["message"]
    if max_tokens is not None:
        with pytest.raises(anthropic.BadRequestError) as e:
            client.messages.create(model=model_id, max_tokens=max_tokens, messages=HI)
        assert words in e.value.body["error"]["message"]


@pytest.mark.parametrize("messages, extra, words", [
    ([{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                   {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                "data": "iVBORw0KGgo="}}]}], {},
     "'messages[0].content[1].type' is 'image': this model reads text only"),
    ([*ASK, {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                               "input": {"city": "Paris"}}]},
      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_2", "content": "sunny"}]}],
     {"tools": [WEATHER]}, "'messages[2].content[0].tool_use_id' \"toolu_2\" answers no tool_use block"),
    (HI, {"thinking": {"type": "enabled", "budget_tokens": 1024}, "max_tokens": 2048},
     "'thinking.budget_tokens': this model does not reason"),
    (HI, {"tools": [{"name": "x", "input_schema": {"type": "colour"}}]}, "'tools[0].input_schema' is not a JSON Schema"),
    (HI, {"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, "'tool_choice' names 'nope'"),
    (HI, {"output_config": {"format": {"type": "json_schema", "schema": {"type": "colour"}}}},
     "'output_config.format' is not a JSON Schema"),
    (HI, {"model": "claude-sonnet-4-5"}, "The model 'claude-sonnet-4-5' does not exist"),
])
def test_refusals_name_the_field(client, model_id, messages, extra, words) -> None:
    body = {"model": model_id, "max_tokens": 5, "messages": messages, **extra}
    with pytest.raises(anthropic.APIStatusError) as e:
        client.messages.create(**body)
    status = 404 if "model" in extra else 400
    kind = "not_found_error" if status == 404 else "invalid_request_error"
    assert e.value.status_code == status and e.value.body["error"]["type"] == kind
    assert words in e.value.body["error"]["message"]


def test_thinking_disabled_or_adaptive_on_a_model_without_reasoning(client, model_id) -> None:
    for thinking in ({"type": "disabled"}, {"type": "adaptive"}):
        r = client.messages.create(model=model_id, max_tokens=30, messages=HI, thinking=thinking, extra_body=GREEDY)
        assert [b.type for b in r.content] == ["text"] and r.content[0].text == "The capital of France is Paris."


def test_models_in_anthropics_shape_for_its_clients(server, engine, client, model_id) -> None:
    page = client.models.list()
    assert [m.id for m in page.data] == [model_id] and page.data[0].type == "model"
    assert page.data[0].display_name == engine.info.name and (page.first_id, page.last_id) == (model_id, model_id)
    assert client.models.retrieve("default").id == model_id
    assert httpx.get(server.url + "/v1/models").json()["object"] == "list"  # OpenAI's, without anthropic-version
    with pytest.raises(anthropic.NotFoundError) as e:
        client.models.retrieve("claude-opus-4")
    assert e.value.body["error"]["type"] == "not_found_error"


def test_the_api_key_as_x_api_key_or_a_bearer_token(engine, model_id) -> None:
    with LiveServer(create_app(engine, ServerConfig(api_key=KEY))) as s:
        for client in (anthropic.Anthropic(base_url=s.url, api_key=KEY, max_retries=0, timeout=60),
                       anthropic.Anthropic(base_url=s.url, auth_token=KEY, max_retries=0, timeout=60)):
            r = client.messages.create(model=model_id, max_tokens=2, messages=HI, extra_body=GREEDY)
            assert r.content[0].text == "The capital"
            assert client.messages.count_tokens(model=model_id, messages=HI).input_tokens == 37
        wrong = anthropic.Anthropic(base_url=s.url, api_key="nope", max_retries=0, timeout=60)
        with pytest.raises(anthropic.AuthenticationError) as e:
            wrong.messages.create(model=model_id, max_tokens=2, messages=HI)
        assert e.value.body == {"type": "error", "error": {"type": "authentication_error",
                                                           "message": "Incorrect API key provided."}}
        r = httpx.post(s.url + "/v1/messages", json={"model": model_id, "max_tokens": 2, "messages": HI})
        assert r.status_code == 401 and "x-api-key" in r.json()["error"]["message"]
        r = httpx.get(s.url + "/v1/models", headers={"x-api-key": KEY})  # the OpenAI routes take it too
        assert r.status_code == 200 and r.json()["data"][0]["id"] == model_id


def test_output_config_format_holds_the_reply_to_a_schema(client, model_id) -> None:
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 20}}, "required": ["answer"]}
    r = client.messages.create(model=model_id, max_tokens=40, messages=HI, extra_body=GREEDY,
                               output_config={"format": {"type": "json_schema", "schema": schema}})
    assert r.stop_reason == "end_turn" and list(json.loads(r.content[0].text)) == ["answer"]


def test_the_sdks_tool_runner_sends_the_whole_conversation(server, client, model_id) -> None:
    """The SDK's tool runner asks for a Thread by default (`thread: {"type": "create"}`, then `continue` with only the
    new tool_result turn). This server stores nothing: `thread` is a 400 with the `error_code` the SDK reads as "send
    the whole conversation without it", so the runner's next turn carries the tool_use its tool_result answers (when
    `thread` was ignored, that turn was a 400 "answers no tool_use block")."""
    r = httpx.post(server.url + "/v1/messages", json={"model": model_id, "max_tokens": 2, "messages": HI,
                                                      "thread": {"type": "create"}})
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error" and "'thread'" in r.json()["error"]["message"]
    assert r.json()["error"]["details"] == {"error_code": "thread_unsupported_request"}
    ran: list[str] = []

    @anthropic.beta_tool
    def get_weather(city: str) -> str:
        """Current weather in a city.

        Args:
            city: the city's name
        """
        ran.append(city)
        return "18 C, sunny"

    runner = client.beta.messages.tool_runner(model=model_id, max_tokens=60, tools=[get_weather], messages=ASK,
                                              max_iterations=2, extra_body=GREEDY)
    replies = list(runner)
    assert len(replies) == 2 and replies[0].stop_reason == "tool_use" and ran == ["Paris"] * len(ran) and ran
    assert replies[1].stop_reason in ("end_turn", "tool_use")
