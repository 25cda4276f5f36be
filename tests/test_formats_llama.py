"""Llama 3.x's JSON tool calls: a Llama 3.1 chat template (`tests/data/llama3_1_chat_template.jinja`) is detected,
its own `tools` variable lists the tools in the first user message, an earlier call renders as `{"name": ...,
"parameters": ...}` and a result as an `ipython` turn; the reply is held to one call in that shape (perhaps after
`<|python_tag|>`) or text, and is read back whole or streamed as OpenAI's `tool_calls` deltas. A tiny random model
with a byte-level tokenizer and Llama 3's special tokens runs it through the real openai client."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest
from mlx_engine import Engine
from mlx_engine.tokenizer import Tokenizer

from app.server import create_app
from app.server.protocol import parse_job
from app.toolcalls.tool_formats import JSON, HermesTools, LlamaTools, detect
from tests.support.server_fakes import LiveServer
from tests.support.tool_format_checks import ADD, ASK, DATA, EARLIER, WEATHER, accepts, read_alike, tiny_folder

TEMPLATE = (DATA / "llama3_1_chat_template.jinja").read_text()
SPECIAL = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
           "<|python_tag|>"]
TAG = 261
HEADER = "<|start_header_id|>{}<|end_header_id|>\n\n"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    return tiny_folder(tmp_path_factory.mktemp("llama"), TEMPLATE, SPECIAL, "<|eot_id|>", "<|begin_of_text|>")


@pytest.fixture(scope="module")
def tokenizer(model) -> Tokenizer:
    return Tokenizer.from_folder(model[0])


def job(body: dict, fmt=LlamaTools(TAG)):
    return parse_job({"model": "fake", "messages": ASK, **body}, "chat", {"fake"}, "fake", 4096, 300, fmt)


def test_the_template_s_markup_picks_the_format(tokenizer: Tokenizer) -> None:
    found = detect(tokenizer.chat_template, lambda t: tokenizer.encode(t, add_special_tokens=False))
    assert isinstance(found, LlamaTools) and found.tag_id == TAG
    assert detect(TEMPLATE, lambda t: list(t.encode())).tag_id is None  # a tag that is no token of its own
    # Llama 3's own template has no tools: the JSON format; nor does a mention of "parameters" alone make one
    plain = ("{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content }}<|eot_id|>"
             "{% endfor %}")
    assert detect(plain) is JSON and detect(plain + '{# "parameters" #}') is JSON
    assert isinstance(detect((DATA / "qwen2_5_chat_template.jinja").read_text()), HermesTools)


def test_tools_an_earlier_call_and_its_result_render_through_the_template(tokenizer: Tokenizer) -> None:
    history = [*ASK, EARLIER, {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"},
               {"role": "user", "content": "And Rome?"}]
    j = job({"messages": history, "tools": [WEATHER]})
    listed = json.dumps({"type": "function", "function": j.tools.functions[0]}, indent=4)
    assert tokenizer.apply_chat_template(j.messages, **j.tool_variables) == (
        "<|begin_of_text|>" + HEADER.format("system") + "Environment: ipython\nCutting Knowledge Date: December 2023\n"
        "Today Date: 26 Jul 2024\n\n<|eot_id|>" + HEADER.format("user") +
        "Given the following functions, please respond with a JSON for a function call with its proper arguments "
        "that best answers the given prompt.\n\nRespond in the format {\"name\": function name, \"parameters\": "
        f"dictionary of argument name and its value}}.Do not use variables.\n\n{listed}\n\nWeather in Paris?<|eot_id|>"
        + HEADER.format("assistant") + '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}<|eot_id|>'
        + HEADER.format("ipython") + '"18 degrees"<|eot_id|>'  # the template quotes a string result
        + HEADER.format("user") + "And Rome?<|eot_id|>" + HEADER.format("assistant"))


def test_parallel_calls_render_a_turn_each_and_a_json_result_as_its_value(tokenizer: Tokenizer) -> None:
    """The template raises on a turn of two calls; each goes in a turn of its own, text first."""
    two = {**EARLIER, "content": "Checking.", "tool_calls": [
        *EARLIER["tool_calls"], {"id": "call_2", "type": "function", "function": {"name": "add",
                                                                                    "arguments": '{"a": 1}'}}]}
    history = [*ASK, two, {"role": "tool", "content": '{"temp": 18}'}, {"role": "tool", "content": "1"}]
    j = job({"messages": history})  # no tools offered: the conversation still renders
    text = tokenizer.apply_chat_template(j.messages, **j.tool_variables)
    assert text.endswith(
        HEADER.format("assistant") + "Checking.<|eot_id|>" + HEADER.format("assistant")
        + '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}<|eot_id|>'
        + HEADER.format("assistant") + '{"name": "add", "parameters": {"a": 1}}<|eot_id|>'
        + HEADER.format("ipython") + '{"temp": 18}<|eot_id|>' + HEADER.format("ipython") + '"1"<|eot_id|>'
        + HEADER.format("assistant"))


CALL = '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}'
ADDS = '{"name": "add", "parameters": {"a": 3}}'


def test_the_grammar_holds_the_reply_to_one_call_or_text() -> None:
    spelled = LlamaTools()  # the byte-level matcher has no <|python_tag|> token
    auto = spelled.grammar(job({"tools": [WEATHER, ADD], "parallel_tool_calls": True}).tools)
    assert auto.type == "lark"
    assert accepts(auto, CALL) and accepts(auto, ADDS) and accepts(auto, "It is sunny.")
    assert not accepts(auto, CALL.replace('"parameters"', '"arguments"'))  # the template's key
    assert not accepts(auto, CALL.replace("Paris", "Oslo")) and not accepts(auto, CALL.replace("get_", "set_"))
    assert not accepts(auto, CALL.replace(": ", ":"))  # the template's own JSON style
    assert not accepts(auto, CALL + "; " + ADDS)  # one call a reply: the template renders no more
    assert not accepts(auto, ' {"name": "get_weather"}')  # text never opens like a call
    required = spelled.grammar(job({"tools": [WEATHER, ADD], "tool_choice": "required"}).tools)
    assert accepts(required, ADDS) and not accepts(required, "It is sunny.") and not accepts(required, "Hm. " + ADDS)
    named = spelled.grammar(job({"tools": [WEATHER, ADD], "tool_choice": {"type": "function",
                                                                          "function": {"name": "add"}}}).tools)
    assert accepts(named, ADDS) and not accepts(named, CALL)
    tagged = LlamaTools(TAG).grammar(job({"tools": [ADD], "tool_choice": "required"}).tools)
    assert f"<[{TAG}]>? call" in tagged.grammar


PARSED = [(CALL, None, [("get_weather", {"city": "Paris", "days": 2})]),
          ("<|python_tag|>" + ADDS, None, [("add", {"a": 3})]),
          (" \n" + ADDS + "\n", None, [("add", {"a": 3})]),
          ('{"name": "add", "arguments": {"a": 3}}', None, [("add", {"a": 3})]),  # what Llama 3.2 writes at times
          ("It is sunny.\n", "It is sunny.\n", []),
          ("{not a call}", "{not a call}", []),
          (CALL[:20], CALL[:20], []),  # cut short (max_tokens) before the call's head is whole: the raw text
          ("<|python_tag|>brave_search.call(query=\"x\")", "<|python_tag|>brave_search.call(query=\"x\")", [])]


@pytest.mark.parametrize(("text", "content", "calls"), PARSED)
def test_replies_are_read_whole_and_streamed_alike(text: str, content: str | None, calls: list) -> None:
    read_alike(LlamaTools(TAG), text, content, calls)


@pytest.fixture(scope="module")
def client(model):
    with LiveServer(create_app(Engine.load(str(model[0]))), drain_s=5) as s:
        yield openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_a_random_llama_calls_in_its_own_format_through_the_openai_client(client, tokenizer: Tokenizer) -> None:
    r = client.chat.completions.create(model="default", messages=ASK, tools=[WEATHER, ADD], tool_choice="required",
                                       temperature=0, max_tokens=100)
    choice = r.choices[0]
    [call] = choice.message.tool_calls
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    args = json.loads(call.function.arguments)
    assert (call.function.name, set(args)) in (("get_weather", {"city", "days"}), ("add", {"a"}))
    j = job({"tools": [WEATHER, ADD], "tool_choice": "required"})
    assert r.usage.prompt_tokens == len(tokenizer.encode_chat(j.messages, **j.tool_variables))

    chunks = [c for c in client.chat.completions.create(
        model="default", messages=ASK, tools=[WEATHER, ADD], tool_choice="required", temperature=0, max_tokens=100,
        stream=True) if c.choices]
    parts = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert parts[0].id.startswith("call_") and parts[0].function.name == call.function.name
    assert all(p.index == 0 and p.id is None for p in parts[1:])
    assert json.loads("".join(p.function.arguments or "" for p in parts)) == args
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    named = client.chat.completions.create(model="default", messages=ASK, tools=[WEATHER, ADD], temperature=0,
                                           max_tokens=100, tool_choice={"type": "function",
                                                                       "function": {"name": "get_weather"}})
    weather = json.loads(named.choices[0].message.tool_calls[0].function.arguments)
    assert weather["city"] in ("Paris", "Rome") and 1 <= weather["days"] <= 7

    follow = client.chat.completions.create(model="default", tools=[WEATHER, ADD], temperature=0, max_tokens=8,
                                            messages=[*ASK, choice.message.model_dump(exclude_none=True),
                                                      {"role": "tool", "tool_call_id": call.id, "content": "18"}])
    assert follow.choices[0].finish_reason in ("stop", "length", "tool_calls")
