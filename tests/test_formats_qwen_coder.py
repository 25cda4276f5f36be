"""Qwen3-Coder's XML tool calls: its chat template (`tests/data/qwen3_coder_chat_template.jinja`) is detected, its
`tools` variable lists the tools as XML, an earlier call renders as `<function=...>` with `<parameter=...>` blocks
and a result inside `<tool_response>`; the reply is held to that XML with each value typed by the parameter's schema
(raw text for strings, JSON otherwise), and is read back whole or streamed as OpenAI's `tool_calls` deltas with JSON
arguments. A tiny random model with a byte-level tokenizer and Qwen's tokens runs it through the real openai
client."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest

from app.server import create_app
from app.server.protocol import parse_job
from app.toolcalls.tool_formats import JSON, HermesTools, QwenCoderTools, detect
from mlx_engine import Engine
from mlx_engine.tokenizer import Tokenizer
from tests.support.schema_models import PERSON
from tests.support.server_fakes import LiveServer
from tests.support.tool_format_checks import ADD, ASK, DATA, EARLIER, WEATHER, accepts, read_alike, tiny_folder

TEMPLATE = (DATA / "qwen3_coder_chat_template.jinja").read_text()
WRITE = {"type": "function", "function": {"name": "write_file", "parameters": {"type": "object", "properties": {
    "path": {"type": "string"}, "content": {"type": "string"}, "append": {"type": "boolean"},
    "meta": {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}}}}},
    "required": ["path", "content"]}}}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    return tiny_folder(tmp_path_factory.mktemp("coder"), TEMPLATE, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                       "<|im_end|>", added=("<tool_call>", "</tool_call>"))


@pytest.fixture(scope="module")
def tokenizer(model) -> Tokenizer:
    return Tokenizer.from_folder(model[0])


def job(body: dict, fmt=QwenCoderTools(259, 260)):
    return parse_job({"model": "fake", "messages": ASK, **body}, "chat", {"fake"}, "fake", 4096, 300, fmt)


def test_the_template_s_markup_picks_the_format(tokenizer: Tokenizer) -> None:
    found = detect(tokenizer.chat_template, lambda t: tokenizer.encode(t, add_special_tokens=False))
    assert isinstance(found, QwenCoderTools) and (found.open_id, found.close_id) == (259, 260)
    assert isinstance(detect((DATA / "qwen2_5_chat_template.jinja").read_text()), HermesTools)
    assert detect("{{- '<tool_call>\\n<function=' + tool_call.name + '>\\n' }}") is JSON  # no parameters shown


def test_tools_an_earlier_call_and_its_result_render_through_the_template(tokenizer: Tokenizer) -> None:
    history = [*ASK, {**EARLIER, "content": "Looking."}, {"role": "tool", "tool_call_id": "call_1",
                                                           "content": "18 degrees"}]
    j = job({"messages": history, "tools": [WEATHER]})
    text = tokenizer.apply_chat_template(j.messages, **j.tool_variables)
    assert ("<tools>\n<function>\n<name>get_weather</name>\n<description>Weather in a city</description>\n"
            "<parameters>\n<parameter>\n<name>city</name>\n<enum>[\"Paris\", \"Rome\"]</enum>\n</parameter>\n"
            "<parameter>\n<name>days</name>\n<type>integer</type>\n<minimum>1</minimum>\n<maximum>7</maximum>\n"
            "</parameter>\n<required>[\"city\", \"days\"]</required>\n<additionalProperties>False"
            "</additionalProperties>\n</parameters>\n</function>\n</tools>") in text
    assert text.endswith(
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\nLooking.\n\n<tool_call>\n"
        "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n</parameter>\n"
        "</function>\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n18 degrees\n</tool_response>\n"
        "<|im_end|>\n<|im_start|>assistant\n")


CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n"
        "</parameter>\n</function>\n</tool_call>")
ADDS = "<tool_call>\n<function=add>\n<parameter=a>\n3\n</parameter>\n</function>\n</tool_call>"
WRITES = ("<tool_call>\n<function=write_file>\n<parameter=path>\na.py\n</parameter>\n<parameter=content>\n"
          'def f():\n    return "</function>"\n</parameter>\n<parameter=meta>\n{"tags": ["x"]}\n</parameter>\n'
          "</function>\n</tool_call>")


def test_the_grammar_holds_the_reply_to_the_xml_with_typed_values() -> None:
    spelled = QwenCoderTools()  # the byte-level matcher has no <tool_call> token
    auto = spelled.grammar(job({"tools": [WEATHER, ADD, WRITE]}).tools)
    assert accepts(auto, CALL) and accepts(auto, ADDS) and accepts(auto, WRITES) and accepts(auto, "It is sunny.")
    assert accepts(auto, "Let me look.\n\n" + CALL)
    assert not accepts(auto, CALL.replace("<parameter=city>", "<parameter=town>"))  # a parameter it does not have
    assert not accepts(auto, CALL.replace("Paris", "Oslo")) and not accepts(auto, ADDS.replace("3", "12"))
    assert not accepts(auto, CALL.replace("<parameter=days>\n2\n</parameter>\n", ""))  # a required one left out
    assert not accepts(auto, ADDS.replace("3", '"3"'))  # an integer is JSON, not text
    assert not accepts(auto, WRITES.replace('["x"]', '"x"'))  # an object's value is held to its schema
    assert accepts(auto, WRITES.replace("<parameter=meta>", "<parameter=append>\ntrue\n</parameter>\n"
                                        "<parameter=meta>"))  # optional ones in the schema's order
    assert not accepts(auto, CALL + "\n" + ADDS)  # one call unless parallel
    required = spelled.grammar(job({"tools": [WEATHER, ADD], "tool_choice": "required",
                                    "parallel_tool_calls": True}).tools)
    assert accepts(required, CALL + "\n" + ADDS) and not accepts(required, "It is sunny.")
    named = spelled.grammar(job({"tools": [WEATHER, ADD], "tool_choice": {"type": "function",
                                                                          "function": {"name": "add"}}}).tools)
    assert accepts(named, ADDS) and not accepts(named, CALL)


def test_a_parameter_that_refers_into_the_parameters_schema_is_held_to_it() -> None:
    """pydantic's `$defs` and a recursive "#": each parameter's own `%json` points into a copy of the whole schema."""
    save = {"type": "function", "function": {"name": "save", "parameters": PERSON}}
    tree = {"type": "function", "function": {"name": "tree", "parameters": {"type": "object", "properties": {
        "label": {"type": "string"}, "kids": {"type": "array", "items": {"$ref": "#"}}}, "required": ["label"]}}}
    g = QwenCoderTools().grammar(job({"tools": [save, tree], "tool_choice": "required"}).tools)
    address = '{"street": "1 Main St", "city": "Springfield"}'
    person = f"<parameter=name>\nBob\n</parameter>\n<parameter=address>\n{address}\n</parameter>\n"
    assert accepts(g, f"<tool_call>\n<function=save>\n{person}</function>\n</tool_call>")
    assert not accepts(g, f"<tool_call>\n<function=save>\n{person.replace('street', 'road')}</function>\n</tool_call>")

    def tree_call(kid: dict) -> str:
        kids = json.dumps([{"label": "b", **kid}])
        return (f"<tool_call>\n<function=tree>\n<parameter=label>\na\n</parameter>\n<parameter=kids>\n{kids}\n"
                "</parameter>\n</function>\n</tool_call>")
    assert accepts(g, tree_call({"kids": []})) and not accepts(g, tree_call({"x": 1}))


TOOLS = job({"tools": [WEATHER, ADD, WRITE]}).tools
PARSED = [(CALL, None, [("get_weather", {"city": "Paris", "days": 2})]),
          ("Let me look.\n\n" + CALL, "Let me look.", [("get_weather", {"city": "Paris", "days": 2})]),
          (CALL + "\n" + ADDS, None, [("get_weather", {"city": "Paris", "days": 2}), ("add", {"a": 3})]),
          (WRITES, None, [("write_file", {"path": "a.py", "content": 'def f():\n    return "</function>"',
                                          "meta": {"tags": ["x"]}})]),
          (WRITES.replace("a.py", "42"), None, [("write_file", {"path": "42", "content": 'def f():\n    return '
                                                                '"</function>"', "meta": {"tags": ["x"]}})]),
          ("<tool_call>\n<function=write_file>\n<parameter=path>\nx\n</parameter>\n<parameter=append>\nTrue\n"
           "</parameter>\n</function>\n</tool_call>", None, [("write_file", {"path": "x", "append": True})]),
          ("<tool_call>\n<function=add>\n</function>\n</tool_call>", None, [("add", {})]),
          ("It is sunny.\n", "It is sunny.\n", []),
          (CALL[:30], CALL[:30], [])]  # cut short (max_tokens) before the call's name: the raw text


@pytest.mark.parametrize(("text", "content", "calls"), PARSED)
def test_replies_are_read_whole_and_streamed_alike(text: str, content: str | None, calls: list) -> None:
    read_alike(QwenCoderTools(259, 260), text, content, calls, TOOLS)


def test_without_the_tools_a_value_that_reads_as_json_is_json() -> None:
    _, [call] = QwenCoderTools().parse(WRITES.replace("a.py", "42"))
    assert json.loads(call["function"]["arguments"])["path"] == 42


@pytest.fixture(scope="module")
def client(model):
    with LiveServer(create_app(Engine.load(str(model[0]))), drain_s=5) as s:
        yield openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_a_random_qwen_coder_calls_in_its_own_format_through_the_openai_client(client, tokenizer: Tokenizer) -> None:
    r = client.chat.completions.create(model="default", messages=ASK, tools=[WEATHER, ADD], tool_choice="required",
                                       temperature=0, max_tokens=120)
    choice = r.choices[0]
    [call] = choice.message.tool_calls
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    args = json.loads(call.function.arguments)
    assert (call.function.name, set(args)) in (("get_weather", {"city", "days"}), ("add", {"a"}))
    j = job({"tools": [WEATHER, ADD], "tool_choice": "required"})
    assert r.usage.prompt_tokens == len(tokenizer.encode_chat(j.messages, **j.tool_variables))

    chunks = [c for c in client.chat.completions.create(
        model="default", messages=ASK, tools=[WEATHER, ADD], tool_choice="required", temperature=0, max_tokens=120,
        stream=True) if c.choices]
    parts = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert parts[0].id.startswith("call_") and parts[0].function.name == call.function.name
    assert all(p.index == 0 and p.id is None for p in parts[1:])
    assert json.loads("".join(p.function.arguments or "" for p in parts)) == args
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    named = client.chat.completions.create(model="default", messages=ASK, tools=[WEATHER, WRITE], temperature=0,
                                           max_tokens=200, tool_choice={"type": "function",
                                                                        "function": {"name": "get_weather"}})
    weather = json.loads(named.choices[0].message.tool_calls[0].function.arguments)
    assert weather["city"] in ("Paris", "Rome") and 1 <= weather["days"] <= 7

    follow = client.chat.completions.create(model="default", tools=[WEATHER, ADD], temperature=0, max_tokens=8,
                                            messages=[*ASK, choice.message.model_dump(exclude_none=True),
                                                      {"role": "tool", "tool_call_id": call.id, "content": "18"}])
    assert follow.choices[0].finish_reason in ("stop", "length", "tool_calls")
