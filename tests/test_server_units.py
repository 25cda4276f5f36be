"""The server's pieces without a model or a socket: request -> SamplingParams, chunk shapes, admission."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest
from mlx_engine.api import ResponseFormat, SamplingParams, TokenLogprob, Usage

from app.server.bridge import AdmissionGate
from app.server.errors import APIError, from_request_error
from app.server.fields import parse_body
from app.server.protocol import Job, Prompt, model_slug, parse_job
from app.server.responses import Choice, Echo, Formatter, sse, token_bytes_fn, token_str
from tests.support.server_fakes import FakeTokenizer

NAMES = {"fake", "default"}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}}


def job(body: dict, endpoint: str = "chat") -> Job:
    base = {"model": "fake", "messages": [{"role": "user", "content": "hi"}]} if endpoint == "chat" else \
        {"model": "fake", "prompt": "hi"}
    return parse_job({**base, **body}, endpoint, NAMES, "fake", context_length=64,  # type: ignore[arg-type]
                     vocab_size=1000)


def error(body: dict, endpoint: str = "chat") -> APIError:
    with pytest.raises(APIError) as e:
        job(body, endpoint)
    return e.value


def test_openai_fields_map_to_sampling_params() -> None:
    j = job({"temperature": 0.5, "top_p": 0.9, "seed": 7, "stop": ["\n", "END"], "presence_penalty": 0.5,
             "frequency_penalty": -1, "logit_bias": {"42": -100, "7": 5.5}, "max_tokens": 8, "logprobs": True,
             "top_logprobs": 3, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "user": "u1",
             "response_format": {"type": "text"}, "n": 1, "stream": True,
             "stream_options": {"include_usage": True}})
    assert SamplingParams(max_tokens=j.max_tokens, **j.sampling) == SamplingParams(
        temperature=0.5, top_p=0.9, top_k=20, min_p=0.05, repetition_penalty=1.1, presence_penalty=0.5,
        frequency_penalty=-1.0, logit_bias={42: -100.0, 7: 5.5}, seed=7, max_tokens=8, stop=("\n", "END"),
        logprobs=3)
    assert (j.stream, j.include_usage, j.logprobs, j.top_logprobs) == (True, True, True, 3)
    assert j.messages == [{"role": "user", "content": "hi"}]


def test_tools_become_a_system_prompt_and_a_json_schema() -> None:
    """Offered tools: their instructions lead the conversation, and the reply is held to a call of one of them (its
    arguments closed to the declared properties) or to a plain reply; "required", a named function and parallel
    calls narrow or widen that schema; "none" offers nothing."""
    j = job({"tools": [WEATHER, ADD], "messages": [{"role": "system", "content": "Be brief."},
                                                   {"role": "user", "content": "hi"}]})
    assert [m["role"] for m in j.messages] == ["system", "user"]
    assert j.messages[0]["content"].startswith("Be brief.\n\nYou can call these functions")
    assert '"name": "get_weather"' in j.messages[0]["content"] and '{"response": "<your reply>"}' in j.messages[0]["content"]
    schema = j.sampling["response_format"].schema
    call, plain = schema["anyOf"]
    assert plain == {"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"],
                     "additionalProperties": False}
    calls = call["properties"]["tool_calls"]
    assert calls["maxItems"] == 1 and [c["properties"]["name"] for c in calls["items"]["anyOf"]] == [
        {"const": "get_weather"}, {"const": "add"}]
    weather_args = calls["items"]["anyOf"][0]["properties"]["arguments"]
    assert weather_args["additionalProperties"] is False and weather_args["required"] == ["city"]

    required = job({"tools": [WEATHER, ADD], "tool_choice": "required", "parallel_tool_calls": True})
    calls = required.sampling["response_format"].schema["properties"]["tool_calls"]
    assert "maxItems" not in calls and len(calls["items"]["anyOf"]) == 2
    named = job({"tools": [WEATHER, ADD], "tool_choice": {"type": "function", "function": {"name": "add"}}})
    calls = named.sampling["response_format"].schema["properties"]["tool_calls"]
    assert calls["items"]["properties"]["name"] == {"const": "add"} and calls["maxItems"] == 1
    assert "Call add" in named.messages[0]["content"] and "get_weather" not in named.messages[0]["content"]
    none = job({"tools": [WEATHER], "tool_choice": "none"})
    assert none.tools is None and "response_format" not in none.sampling and none.messages[0]["role"] == "user"


def test_a_conversation_s_tool_calls_go_back_as_the_json_the_model_writes() -> None:
    j = job({"messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "3 degrees"}]})
    assert j.messages[1] == {"role": "assistant",
                             "content": '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}]}'}
    assert j.messages[2] == {"role": "tool", "content": "3 degrees"}  # no tools offered: as sent


def test_after_tool_results_the_model_is_told_it_may_answer() -> None:
    """Under "auto", the last result of each run of tool results ends with a line saying the model may now answer;
    under "required" (or a named function) the model must call, so nothing is added."""
    call = {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    history = [{"role": "user", "content": "weather in Oslo and Rome?"},
               {"role": "assistant", "content": None, "tool_calls": [call, call]},
               {"role": "tool", "tool_call_id": "c", "content": "3 degrees"},
               {"role": "tool", "tool_call_id": "c", "content": "20 degrees"},
               {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "c", "content": "4 degrees"}]
    j = job({"tools": [WEATHER], "messages": history})
    assert [m["content"] for m in j.messages if m["role"] == "tool"] == [
        "3 degrees",
        "20 degrees\n\nThe functions have answered. Tell the user the answer, or call another function if you still "
        "need one.",
        "4 degrees\n\nThe function has answered. Tell the user the answer, or call another function if you still "
        "need one."]
    required = job({"tools": [WEATHER], "tool_choice": "required", "messages": history})
    assert [m["content"] for m in required.messages if m["role"] == "tool"] == ["3 degrees", "20 degrees", "4 degrees"]


def test_closed_adds_no_extra_properties_where_the_schema_is_silent() -> None:
    from app.toolcalls.tools import closed

    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "string"}}},
                                               "c": {"type": "array", "items": {"type": "object"}},
                                               "d": {"type": "object", "additionalProperties": True},
                                               "e": {"$ref": "#/$defs/point"}},
              "$defs": {"point": {"type": "object", "properties": {"x": {"type": "number"}}}}}
    out = closed(schema)
    assert out["$defs"]["point"]["additionalProperties"] is False and "additionalProperties" not in out["$defs"]
    assert out["additionalProperties"] is False
    assert out["properties"]["a"]["additionalProperties"] is False
    assert out["properties"]["c"]["items"]["additionalProperties"] is False
    assert out["properties"]["d"]["additionalProperties"] is True
    assert "additionalProperties" not in schema  # the request's own schema is untouched


def test_tool_replies_format_as_openai_messages_and_chunks() -> None:
    from app.toolcalls.tools import reply

    content, calls = reply('{"tool_calls": [{"name": "add", "arguments": {"a": 2, "b": 3}}]}')
    assert content is None and calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    assert calls[0]["function"] == {"name": "add", "arguments": '{"a": 2, "b": 3}'}
    assert reply('{"response": "hello"}') == ("hello", None)
    assert reply('{"response": "hel') == ("hel", None)  # cut short (max_tokens, a stop string): the text so far
    assert reply('{"tool_calls": [{"na') == ('{"tool_calls": [{"na', None)  # a cut call: the raw text
    fmt = Formatter(job({"tools": [ADD]}), "fake", "fp_x", lambda t: b"x")
    body = fmt.response([Choice('{"tool_calls": [{"name": "add", "arguments": {"a": 1, "b": 1}}]}', (), "stop"),
                         Choice('{"response": "two"}', (), "stop"), Choice('{"tool_calls": [{"na', (), "length")],
                        Usage(5, 3))
    first, second, third = body["choices"]
    assert first["finish_reason"] == "tool_calls" and first["message"]["content"] is None
    assert first["message"]["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 1, "b": 1}'}
    assert second["finish_reason"] == "stop" and second["message"]["content"] == "two"
    assert "tool_calls" not in second["message"]
    assert third["finish_reason"] == "length" and third["message"]["content"] == '{"tool_calls": [{"na'
    reader = fmt.job.tool_format.stream()  # streamed: a call goes out whole once its JSON is complete
    assert reader.feed('{"tool_calls": [{"name": "add", "arguments": {}}]}') == [] and not reader.called
    [delta] = reader.finish()
    chunk = fmt.tool_delta_chunk(delta, 0)
    assert chunk["choices"][0]["delta"]["tool_calls"][0]["index"] == 0 and reader.called


def responses_error(body: dict) -> APIError:
    from app.server.responses_api import parse_responses

    with pytest.raises(APIError) as e:
        parse_responses({"model": "fake", **body}, NAMES, "fake", context_length=64, vocab_size=1000)
    return e.value


def test_responses_input_items_become_chat_messages() -> None:
    from app.server.responses_api import parse_responses

    j = parse_responses({"model": "fake", "instructions": "Be brief.", "max_output_tokens": 7, "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "3 degrees"},
        {"type": "reasoning", "summary": []},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Cold."}]}]},
        NAMES, "fake", context_length=64, vocab_size=1000)
    assert j.max_tokens == 7 and j.max_tokens_param == "max_tokens"
    assert j.messages == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
                                         '{"name": "get_weather", "arguments": {"city": "Rome"}}]}'},
        {"role": "tool", "content": "3 degrees"}, {"role": "assistant", "content": "Cold."}]


@pytest.mark.parametrize("body,param,words", [
    ({}, "input", "'input' is required"),
    ({"input": []}, "input", "non-empty array"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type", "text parts only"),
    ({"input": [{"type": "file_search_call"}]}, "input[0].type", "not supported here"),
    ({"input": [{"type": "function_call", "name": "f"}]}, "input[0]", "needs string 'call_id'"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens", "'max_output_tokens' must be an integer >= 1"),
    ({"input": "x", "temperature": 5}, "temperature", "[0, 2]"),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format.type", "not supported"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "schema": [1]}}}, "text.format.schema",
     "JSON Schema object"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type", "function tools only"),
    ({"input": "x", "tools": [{"type": "function", "name": "a b"}]}, "tools[0].name", "1-64 letters"),
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id", "stores no responses"),
    ({"input": "x", "background": True}, "background", "not supported"),
    ({"instructions": 5, "input": "x"}, "instructions", "must be a string"),
    ({"instructions": "\ud800", "input": "x"}, "instructions", "unpaired UTF-16 surrogate"),
])
def test_bad_responses_fields_are_named_as_sent(body: dict, param: str, words: str) -> None:
    e = responses_error(body)
    assert (e.status, e.param) == (400, param) and words in e.message, (e.param, e.message)


@pytest.mark.parametrize("full", ['{"response": "Hi \\"you\\"\\n caf\\u00e9 \\ud83d\\ude00 \\\\ end"}',
                                  '{\n  "response"  :\n    "two"\n}',
                                  '{"tool_calls": [{"name": "f", "arguments": {"a": "{\\"response\\": 1}"}}]}'])
def test_a_plain_tool_reply_streams_as_it_comes(full: str) -> None:
    """ReplyStream, fed the reply in random pieces: a plain reply's text comes out decoded, piece by piece, the
    same as parsing the whole; split escapes and surrogate pairs are held until whole; a call gives nothing."""
    import json
    import random

    from app.toolcalls.tools import ReplyStream

    want = json.loads(full)
    rng = random.Random(7)
    for _ in range(200):
        rs, out, i = ReplyStream(), [], 0
        while i < len(full):
            j = i + rng.randint(1, 4)
            out.append(rs.feed(full[i:j]))
            i = j
        if "response" in want:
            assert "".join(out) == want["response"] and rs.mode == "done"
            assert len(want["response"]) < 8 or sum(1 for o in out if o) > 1  # it streamed
        else:
            assert out == [""] * len(out) and rs.mode == "calls"


def test_response_formats_map_to_the_engine_s() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "object"}}}
    fmt = lambda body, endpoint="chat": job({"response_format": body}, endpoint).sampling.get("response_format")  # noqa: E731
    assert fmt({"type": "text"}) is None
    assert fmt({"type": "json_object"}) == ResponseFormat("json_object")
    # objects are closed where the schema is silent (as llama.cpp and vLLM's xgrammar read it); strict, as OpenAI's
    # strict mode, also requires every property
    assert fmt({"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}) == ResponseFormat(
        "json_schema", schema={**schema, "properties": {"a": {"type": "integer"}, "b": {
            "type": "object", "additionalProperties": False}}, "additionalProperties": False})
    assert fmt({"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}}) == \
        ResponseFormat("json_schema", schema={**schema, "properties": {"a": {"type": "integer"}, "b": {
            "type": "object", "additionalProperties": False}}, "required": ["a", "b"], "additionalProperties": False})
    assert fmt({"type": "json_schema", "json_schema": {"name": "any"}}) == ResponseFormat("json_object")
    assert fmt({"type": "json_object"}, "completion") == ResponseFormat("json_object")  # as vLLM accepts


def test_vllm_guided_fields_map_to_the_engine_s_formats() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = lambda body: job(body).sampling.get("response_format")  # noqa: E731
    assert fmt({"guided_json": schema}) == ResponseFormat("json_schema", schema={**schema, "additionalProperties": False})
    assert fmt({"guided_json": '{"type": "object"}'}) == ResponseFormat("json_schema", schema={
        "type": "object", "additionalProperties": False})
    assert fmt({"structured_outputs": {"regex": "[0-9]+"}}) == ResponseFormat("regex", pattern="[0-9]+")
    assert fmt({"guided_choice": ["yes", 'no "way"']}) == ResponseFormat("lark", grammar='start: "yes" | "no \\"way\\""')
    lark = fmt({"guided_grammar": 'root ::= "a" | "b"'}).grammar
    assert 'start: "a"' in lark and '"b"' in lark
    assert fmt({"structured_outputs": {"grammar": "start: /[a-z]+/"}}) == ResponseFormat("lark", grammar="start: /[a-z]+/")
    assert job({"guided_regex": "x"}).format_param == "guided_regex"


def test_a_bad_tool_schema_names_that_tool_s_parameters() -> None:
    good = {"type": "function", "function": {"name": "ok", "parameters": {"type": "object"}}}
    bad = {"type": "function", "function": {"name": "bad", "parameters": {
        "type": "object", "properties": {"colour": {"type": "colour"}}}}}
    e = error({"tools": [good, bad]})
    assert (e.status, e.param, e.code) == (400, "tools[1].function.parameters", "invalid_schema")
    assert "Invalid type: colour" in e.message
    e = responses_error({"input": "x", "tools": [{"type": "function", "name": "bad",
                                                  "parameters": bad["function"]["parameters"]}]})
    assert (e.status, e.param) == (400, "tools[0].parameters") and "colour" in e.message
    # a tool marked strict gets OpenAI's strict schema: closed, every property required
    strict = {"type": "function", "function": {"name": "s", "strict": True, "parameters": {
        "type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}}}}}
    [fn] = job({"tools": [strict]}).tools.functions
    assert fn["parameters"]["required"] == ["a", "b"] and fn["parameters"]["additionalProperties"] is False


def test_an_engine_format_error_names_response_format() -> None:
    e = from_request_error("response format json_schema: the JSON Schema cannot be used: Invalid type: colour")
    assert (e.status, e.param) == (400, "response_format")


def test_openai_defaults() -> None:
    j = job({})
    assert j.max_tokens is None and not j.stream and not j.logprobs
    assert SamplingParams(max_tokens=5, **j.sampling) == SamplingParams(temperature=1.0, max_tokens=5)


def test_max_completion_tokens_wins_and_names_itself() -> None:
    j = job({"max_tokens": 5, "max_completion_tokens": 3})
    assert (j.max_tokens, j.max_tokens_param) == (3, "max_completion_tokens")


def test_completion_prompt_forms_and_logprobs() -> None:
    assert job({"prompt": ["one"]}, "completion").prompts == [Prompt(text="one")]
    assert job({"prompt": [5, 6, 7]}, "completion").prompts == [Prompt(token_ids=[5, 6, 7])]
    assert job({"prompt": [[5, 6]]}, "completion").prompts == [Prompt(token_ids=[5, 6])]
    assert job({"prompt": ["a", [5], "b"]}, "completion").prompts == [Prompt("a"), Prompt(None, [5]), Prompt("b")]
    assert not job({}, "completion").echo and job({"echo": True}, "completion").echo
    assert job({"echo": True, "max_tokens": 0}, "completion").max_tokens == 0  # scoring only
    j = job({"logprobs": 2}, "completion")
    assert (j.logprobs, j.top_logprobs, j.sampling["logprobs"]) == (True, 2, 2)
    j = job({"logprobs": 0}, "completion")
    assert (j.logprobs, j.sampling["logprobs"]) == (True, 0)


def test_message_content_parts_and_developer_role() -> None:
    j = job({"messages": [{"role": "developer", "content": "be brief"},
                          {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                          {"role": "assistant", "content": None, "name": "x"}]})
    assert j.messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a\nb"},
                          {"role": "assistant", "content": ""}]


@pytest.mark.parametrize("body,endpoint,status,param,words", [
    ({"model": None}, "chat", 400, "model", "must provide a model"),
    ({"model": 3}, "chat", 400, "model", "must be a string"),
    ({"model": "gpt-4o"}, "chat", 404, "model", "does not exist"),
    ({"messages": None}, "chat", 400, "messages", "required"),
    ({"messages": "hi"}, "chat", 400, "messages", "must be an array"),
    ({"messages": []}, "chat", 400, "messages", "non-empty"),
    ({"messages": [{"content": "x"}]}, "chat", 400, "messages[0].role", "required"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "chat", 400, "messages[0].role", "one of"),
    ({"messages": [{"role": "user", "content": 5}]}, "chat", 400, "messages[0].content", "string"),
    ({"messages": [{"role": "user"}]}, "chat", 400, "messages[0].content", "required"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "chat", 400,
     "messages[0].content[0].type", "not supported"),
    ({"messages": [{"role": "user", "content": "\ud800"}]}, "chat", 400, "messages[0].content", "surrogate"),
    ({"temperature": 2.5}, "chat", 400, "temperature", "[0, 2]"),
    ({"temperature": "hot"}, "chat", 400, "temperature", "must be a number"),
    ({"temperature": True}, "chat", 400, "temperature", "must be a number"),
    ({"top_p": 0}, "chat", 400, "top_p", "(0, 1]"),
    ({"max_tokens": 0}, "chat", 400, "max_tokens", ">= 1"),
    ({"max_tokens": 0}, "completion", 400, "max_tokens", ">= 1"),  # 0 only with echo
    ({"max_tokens": 2.5}, "chat", 400, "max_tokens", "an integer"),
    ({"max_tokens": 64}, "chat", 400, "max_tokens", "context is 64"),
    ({"max_completion_tokens": 100}, "chat", 400, "max_completion_tokens", "context"),
    ({"n": 65}, "chat", 400, "n", "in [1, 64]"),
    ({"n": 0}, "chat", 400, "n", "in [1, 64]"),
    ({"prompt": ["a"] * 9, "n": 8}, "completion", 400, "n", "9 prompts x n=8 is 72 choices; at most 64"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "chat", 400, "stop", "at most 4"),
    ({"stop": [""]}, "chat", 400, "stop", "non-empty"),
    ({"stop": 5}, "chat", 400, "stop", "string"),
    ({"seed": "1"}, "chat", 400, "seed", "integer"),
    ({"logit_bias": {"abc": 1}}, "chat", 400, "logit_bias", "not a token id"),
    ({"logit_bias": {"5000": 1}}, "chat", 400, "logit_bias", "outside the vocabulary"),
    ({"logit_bias": {"5": 101}}, "chat", 400, "logit_bias", "[-100, 100]"),
    ({"presence_penalty": 3}, "chat", 400, "presence_penalty", "[-2, 2]"),
    ({"top_logprobs": 2}, "chat", 400, "top_logprobs", "needs 'logprobs'"),
    ({"logprobs": True, "top_logprobs": 21}, "chat", 400, "top_logprobs", "[0, 20]"),
    ({"response_format": {"type": "xml"}}, "chat", 400, "response_format.type", "not supported"),
    ({"response_format": "json"}, "chat", 400, "response_format", "must be an object"),
    ({"response_format": {"type": "json_schema"}}, "chat", 400, "response_format.json_schema", "needs 'json_schema'"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}}, "chat", 400,
     "response_format.json_schema.schema", "must be a JSON Schema object, got an array"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": "yes"}}}, "chat", 400,
     "response_format.json_schema.strict", "must be a boolean"),
    ({"tools": [{"type": "function"}]}, "chat", 400, "tools[0]", "must be an object like"),
    ({"tools": {"type": "function"}}, "chat", 400, "tools", "must be an array"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "chat", 400, "tools[0].function.name",
     "1-64 letters"),
    ({"tools": [WEATHER, WEATHER]}, "chat", 400, "tools[1].function.name", "offered twice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "chat", 400,
     "tools[0].function.parameters", "JSON Schema object"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "other"}}}, "chat", 400,
     "tool_choice", "'other', which is not among the tools"),
    ({"tools": [WEATHER], "tool_choice": "always"}, "chat", 400, "tool_choice", "'none', 'auto', 'required'"),
    ({"tool_choice": "required"}, "chat", 400, "tool_choice", "needs 'tools'"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "chat", 400, "parallel_tool_calls", "boolean"),
    ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "chat", 400, "response_format",
     "cannot be combined with 'tools'"),
    ({"tools": [WEATHER], "logprobs": True}, "chat", 400, "logprobs", "not supported with 'tools'"),
    ({"guided_json": "{nope"}, "chat", 400, "guided_json", "not valid JSON"),
    ({"guided_json": [1]}, "chat", 400, "guided_json", "JSON Schema object"),
    ({"guided_choice": []}, "chat", 400, "guided_choice", "non-empty array"),
    ({"guided_regex": 5}, "chat", 400, "guided_regex", "must be a string"),
    ({"guided_grammar": "root ::= ("}, "chat", 400, "guided_grammar", "not a grammar this server reads"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "chat", 400, "guided_regex", "only one of"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "chat", 400, "guided_regex",
     "only one of response_format, guided_regex"),
    ({"structured_outputs": "json"}, "chat", 400, "structured_outputs", "must be an object"),
    ({"guided_regex": "a", "tools": [WEATHER]}, "chat", 400, "guided_regex", "cannot be combined with 'tools'"),
    ({"functions": [{"name": "f"}]}, "chat", 400, "functions", "send 'tools'"),
    ({"tools": [WEATHER]}, "completion", 400, "tools", "completions have no tool calling"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f"}}]}]}, "chat",
     400, "messages[0].tool_calls[0]", "'arguments': '<JSON text>'"),
    ({"stream_options": {"include_usage": True}}, "chat", 400, "stream_options", "only allowed when 'stream'"),
    ({"stream": True, "stream_options": {"include_usage": "yes"}}, "chat", 400, "stream_options.include_usage",
     "boolean"),
    ({"stream": "yes"}, "chat", 400, "stream", "boolean"),
    ({"prompt": None}, "completion", 400, "prompt", "required"),
    ({"prompt": ["a"] * 65}, "completion", 400, "prompt", "at most 64 per request"),
    ({"prompt": ["a", []]}, "completion", 400, "prompt[1]", "empty array"),
    ({"prompt": ["a", [1, 5000]]}, "completion", 400, "prompt[1]", "outside the vocabulary"),
    ({"prompt": [[1], [1.5]]}, "completion", 400, "prompt[1]", "integer token ids"),
    ({"prompt": [1, "a"]}, "completion", 400, "prompt", "token ids"),
    ({"prompt": [1, 5000]}, "completion", 400, "prompt", "outside the vocabulary"),
    ({"prompt": []}, "completion", 400, "prompt", "empty array"),
    ({"prompt": {"a": 1}}, "completion", 400, "prompt", "string"),
    ({"echo": 1}, "completion", 400, "echo", "boolean"),
    ({"best_of": 3}, "completion", 400, "best_of", "best_of must be 1"),
    ({"logprobs": 21}, "completion", 400, "logprobs", "[0, 20]"),
    ({"suffix": "x"}, "completion", 400, "suffix", "not supported"),
])
def test_each_bad_field_is_a_clear_error_naming_it(body, endpoint, status, param, words) -> None:
    e = error(body, endpoint)
    assert (e.status, e.param) == (status, param)
    assert words in e.message
    assert e.body()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("raw,words", [
    (b"\xff\xfe{}", "not valid UTF-8"),
    (b'{"model": "fake", ', "not valid JSON"),
    (b"", "empty"),
    (b'{"temperature": NaN}', "NaN is not valid JSON"),
    (b"[1, 2]", "must be a JSON object"),
    (b"[" * 100000 + b"]" * 100000, "not valid JSON"),
])
def test_bodies_that_are_not_json_objects(raw: bytes, words: str) -> None:
    with pytest.raises(APIError) as e:
        parse_body(raw)
    assert e.value.status == 400 and words in e.value.message


def test_engine_request_errors_keep_the_field_name() -> None:
    e = from_request_error("invalid sampling parameter logprobs=30: expected an integer in [0, 20] or None",
                           {"logprobs": "top_logprobs"})
    assert (e.status, e.param) == (400, "top_logprobs")
    e = from_request_error("the prompt is 9000 tokens but the model's context is 8192 tokens")
    assert (e.status, e.code) == (400, "context_length_exceeded")


def test_model_slug() -> None:
    assert model_slug("SmolLM2-135M-Instruct (Q4_1 GGUF, embedded)") == "smollm2-135m-instruct-q4_1-gguf-embedded"
    assert model_slug("Qwen/Qwen3-0.6B") == "qwen-qwen3-0.6b"
    assert model_slug("(((") == "model"


def test_token_bytes_from_pieces() -> None:
    tb = token_bytes_fn(FakeTokenizer())
    assert tb(300) == b"\xe4" and token_str(tb(300)) == "\\xe4"
    assert tb(ord("é")) == "é".encode()


def fmt(body: dict, endpoint: str = "chat") -> Formatter:
    f = Formatter(job(body, endpoint), "fake", "fp_0", token_bytes_fn(FakeTokenizer()))
    f.id, f.created = "chatcmpl-X" if endpoint == "chat" else "cmpl-X", 1
    return f


def test_chat_chunks_in_openai_shape() -> None:
    f = fmt({"stream": True, "stream_options": {"include_usage": True}, "logprobs": True, "top_logprobs": 1})
    head = {"id": "chatcmpl-X", "object": "chat.completion.chunk", "created": 1, "model": "fake",
            "system_fingerprint": "fp_0"}
    assert f.first_chunks() == [{**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                      "logprobs": None, "finish_reason": None}], "usage": None}]
    lp = TokenLogprob(72, -0.5, ((72, -0.5), (73, -1.0)))
    assert f.delta_chunk("H", (lp,)) == {**head, "usage": None, "choices": [{
        "index": 0, "delta": {"content": "H"}, "finish_reason": None,
        "logprobs": {"content": [{"token": "H", "logprob": -0.5, "bytes": [72],
                                  "top_logprobs": [{"token": "H", "logprob": -0.5, "bytes": [72]}]}],
                     "refusal": None}}]}
    assert f.finish_chunk("stop")["choices"] == [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}]
    assert f.usage_chunk(Usage(5, 2, 4)) == {**head, "choices": [], "usage": {
        "prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7, "prompt_tokens_details": {"cached_tokens": 4}}}
    assert sse({"a": "é"}) == 'data: {"a":"é"}\n\n'.encode()


def test_chunks_without_include_usage_have_no_usage_key() -> None:
    f = fmt({"stream": True})
    assert "usage" not in f.delta_chunk("x", ()) and "usage" not in f.finish_chunk("length")


def test_completion_response_with_logprobs() -> None:
    f = fmt({"logprobs": 2}, "completion")
    lps = (TokenLogprob(72, -0.5, ((72, -0.5), (300, -1.0))), TokenLogprob(105, -0.1, ((105, -0.1), (72, -3.0))))
    body = f.response([Choice("Hi", lps, "length")], Usage(3, 2, 0))
    assert body["object"] == "text_completion" and body["id"] == "cmpl-X"
    assert body["choices"] == [{"index": 0, "text": "Hi", "finish_reason": "length", "logprobs": {
        "tokens": ["H", "i"], "token_logprobs": [-0.5, -0.1], "top_logprobs": [{"H": -0.5, "\\xe4": -1.0},
                                                                                {"i": -0.1, "H": -3.0}],
        "text_offset": [0, 1]}}]
    assert body["usage"]["total_tokens"] == 5


def test_echoed_completions_put_the_prompt_first() -> None:
    """`echo`: each choice's text starts with its prompt; with logprobs the prompt's tokens come first, the first
    without a log-probability (null, as OpenAI's), offsets running on into the reply. A stream sends each prompt,
    with the log-probabilities its first event brought, in a chunk of its own before its reply."""
    scored = (TokenLogprob(98, -2.0, ((120, -0.5),)),)
    reply = (TokenLogprob(72, -0.25, ((72, -0.25),)),)
    f = fmt({"logprobs": 1, "echo": True, "prompt": ["ab", "c"]}, "completion")
    f.echoes.update({0: Echo("ab", [97, 98]), 1: Echo("c", [99])})
    body = f.response([Choice("H", reply, "length", scored), Choice("", (), "stop")], Usage(3, 1, 0))
    assert body["choices"] == [
        {"index": 0, "text": "abH", "finish_reason": "length", "logprobs": {
            "tokens": ["a", "b", "H"], "token_logprobs": [None, -2.0, -0.25],
            "top_logprobs": [None, {"x": -0.5}, {"H": -0.25}], "text_offset": [0, 1, 2]}},
        {"index": 1, "text": "c", "finish_reason": "stop", "logprobs": {
            "tokens": ["c"], "token_logprobs": [None], "top_logprobs": [None], "text_offset": [0]}}]
    f = fmt({"logprobs": 1, "echo": True, "stream": True, "prompt": ["ab", "c"]}, "completion")
    f.echoes.update({0: Echo("ab", [97, 98]), 1: Echo("c", [99])})
    assert f.first_chunks() == []
    head = f.echo_chunk(0, scored)["choices"][0]
    assert (head["index"], head["text"], head["logprobs"]["token_logprobs"]) == (0, "ab", [None, -2.0])
    assert f.delta_chunk("H", reply, 0)["choices"][0]["logprobs"]["text_offset"] == [2]  # after the prompt
    assert f.echo_chunk(1, ())["choices"][0]["text"] == "c"
    assert f.delta_chunk("d", (TokenLogprob(100, -1.0, ()),), 1)["choices"][0]["logprobs"]["text_offset"] == [1]
    assert fmt({"prompt": "x"}, "completion").echo_chunk(0, ()) is None  # no echo: nothing before the reply


def test_admission_gate_is_fifo_and_bounded() -> None:
    async def scenario() -> None:
        gate = AdmissionGate(max_running=1, max_waiting=2)
        await gate.acquire()
        order: list[str] = []

        async def wait(name: str) -> None:
            await gate.acquire()
            order.append(name)

        a = asyncio.create_task(wait("a"))
        b = asyncio.create_task(wait("b"))
        c = asyncio.create_task(wait("c"))
        await asyncio.sleep(0)
        assert gate.waiting == 2
        with pytest.raises(APIError) as e:
            await c
        assert (e.value.status, e.value.code) == (429, "rate_limit_exceeded")
        a.cancel()  # a waiter that gives up leaves no hole
        await asyncio.sleep(0)
        gate.release()
        await b
        assert order == ["b"] and gate.running == 1 and gate.waiting == 0
        gate.release()
        assert gate.running == 0

    asyncio.run(scenario())


def test_server_imports_no_mlx() -> None:
    code = "import app.server, app.server.app\nimport sys\nprint(' '.join(sys.modules))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert not {"mlx", "mlx_lm", "kernels_metal", "torch", "textual"} & {m.split(".")[0] for m in r.stdout.split()}


def test_serving_off_loopback_without_a_key_warns(monkeypatch, capsys) -> None:
    import app.server.run as run
    from app.cli import main
    from mlx_engine.api import RooflineError

    def refuse(host: str, port: int):
        raise RooflineError(f"cannot listen on {host}:{port}: test")

    monkeypatch.setattr(run, "bind", refuse)
    monkeypatch.delenv("ROOFLINE_API_KEY", raising=False)
    assert main(["serve", "--host", "0.0.0.0", "--port", "9"]) == 2
    err = capsys.readouterr().err
    assert "warning: serving on 0.0.0.0" in err and "--api-key" in err
    assert main(["serve", "--host", "0.0.0.0", "--port", "9", "--api-key", "k"]) == 2
    assert "warning" not in capsys.readouterr().err
    assert run.is_loopback("127.0.0.1") and run.is_loopback("::1") and run.is_loopback("localhost")
    assert not run.is_loopback("0.0.0.0") and not run.is_loopback("192.168.1.2")


def test_speculative_extensions_pass_through_when_the_engine_has_them() -> None:
    from dataclasses import fields

    if "speculative" not in {f.name for f in fields(SamplingParams)}:
        assert error({"speculative": "draft"}).param == "speculative"
        return
    j = job({"speculative": "prompt-lookup", "num_draft_tokens": 3})
    assert (j.sampling["speculative"], j.sampling["num_draft_tokens"]) == ("prompt-lookup", 3)
    assert "speculative" not in job({}).sampling  # absent: the engine's default
