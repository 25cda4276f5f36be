"""Mistral's `[TOOL_CALLS]` format: a Mistral Nemo chat template (`tests/data/mistral_nemo_chat_template.jinja`) is
detected, its `tools` variable lists the tools in `[AVAILABLE_TOOLS]`, an earlier call and its result render with
the 9-character ids the template demands (given from their place in the conversation), the reply is held to
`[TOOL_CALLS]` and a JSON array of calls, and is read back whole or streamed as OpenAI's `tool_calls` deltas with
ids Mistral's templates accept. A tiny random model with a byte-level tokenizer and Mistral's control tokens runs it
through the real openai client."""

from __future__ import annotations

import json
import re
from pathlib import Path

import openai
import pytest
from mlx_engine import Engine
from mlx_engine.tokenizer import Tokenizer

from app.server import create_app
from app.server.protocol import parse_job
from app.toolcalls.formats.mistral import place_id
from app.toolcalls.tool_formats import JSON, MistralTools, detect
from tests.support.server_fakes import LiveServer
from tests.support.tool_format_checks import ADD, ASK, DATA, EARLIER, WEATHER, accepts, read_alike, tiny_folder

TEMPLATE = (DATA / "mistral_nemo_chat_template.jinja").read_text()
SPECIAL = ["<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
           "[TOOL_RESULTS]", "[/TOOL_RESULTS]"]
CALLS_ID = 260
NINE = re.compile(r"^[A-Za-z0-9]{9}$")


def nine(i: str) -> bool:
    return NINE.match(i) is not None


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    return tiny_folder(tmp_path_factory.mktemp("mistral"), TEMPLATE, SPECIAL, "</s>", "<s>")


@pytest.fixture(scope="module")
def tokenizer(model) -> Tokenizer:
    return Tokenizer.from_folder(model[0])


def job(body: dict, fmt=MistralTools(CALLS_ID)):
    return parse_job({"model": "fake", "messages": ASK, **body}, "chat", {"fake"}, "fake", 4096, 300, fmt)


def test_the_template_s_markup_picks_the_format(tokenizer: Tokenizer) -> None:
    found = detect(tokenizer.chat_template, lambda t: tokenizer.encode(t, add_special_tokens=False))
    assert isinstance(found, MistralTools) and (found.calls_id, found.space) == (CALLS_ID, "")
    v3 = TEMPLATE.replace('"[TOOL_CALLS]["', '"[TOOL_CALLS] ["')  # Mistral 7B v0.3's spacing
    assert detect(v3).space == " " and detect(v3).calls_id is None
    # a template with no tools list (Mistral's earliest) is not this format
    assert detect("{% for m in messages %}[INST]{{ m.content }}[/INST]{% endfor %}{# [TOOL_CALLS] #}") is JSON
    v11 = TEMPLATE.split("-#}", 1)[1].replace(  # past the header, which describes the array
        '"[TOOL_CALLS]["', '"[TOOL_CALLS]" + tool_call.function.name + "[ARGS]"')
    assert detect(v11) is JSON  # Mistral Small 3.2's `[TOOL_CALLS]name[ARGS]{...}`


def test_tools_an_earlier_call_and_its_result_render_with_ids(tokenizer: Tokenizer) -> None:
    history = [*ASK, EARLIER, {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"},
               {"role": "assistant", "content": "18 degrees."}, {"role": "user", "content": "And Rome?"}]
    j = job({"messages": history, "tools": [WEATHER]})
    listed = json.dumps(j.tools.functions[0]["parameters"])
    one = place_id("1.0")
    assert nine(one) and one == place_id("1.0") != place_id("3.0")
    assert tokenizer.apply_chat_template(j.messages, **j.tool_variables) == (
        '<s>[INST]Weather in Paris?[/INST][TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", '
        f'"days": 2}}, "id": "{one}"}}]</s>[TOOL_RESULTS]{{"content": 18 degrees, "call_id": "{one}"}}[/TOOL_RESULTS]'
        '18 degrees.</s>[AVAILABLE_TOOLS][{"type": "function", "function": {"name": "get_weather", "description": '
        f'"Weather in a city", "parameters": {listed}}}}}][/AVAILABLE_TOOLS][INST]And Rome?[/INST]')


def test_parallel_calls_and_their_results_pair_by_place(tokenizer: Tokenizer) -> None:
    two = {**EARLIER, "content": "Checking.", "tool_calls": [
        *EARLIER["tool_calls"], {"id": "call_2", "type": "function", "function": {"name": "add",
                                                                                    "arguments": '{"a": 1}'}}]}
    history = [*ASK, two, {"role": "tool", "content": "18"}, {"role": "tool", "content": "1"}]
    j = job({"messages": history})  # no tools offered: the ids are still given
    first, second = place_id("1.0"), place_id("1.1")
    assert tokenizer.apply_chat_template(j.messages, **j.tool_variables) == (
        '<s>[INST]Weather in Paris?[/INST]Checking.</s>[TOOL_CALLS][{"name": "get_weather", "arguments": '
        f'{{"city": "Paris", "days": 2}}, "id": "{first}"}}, {{"name": "add", "arguments": {{"a": 1}}, "id": '
        f'"{second}"}}]</s>[TOOL_RESULTS]{{"content": 18, "call_id": "{first}"}}[/TOOL_RESULTS]'
        f'[TOOL_RESULTS]{{"content": 1, "call_id": "{second}"}}[/TOOL_RESULTS]')


CALL = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}]'
ADDS = '[TOOL_CALLS][{"name": "add", "arguments": {"a": 3}, "id": "abcDEF123"}]'
BOTH = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}, {"name": "add", ' \
       '"arguments": {"a": 3}}]'


def test_the_grammar_holds_the_reply_to_the_calls_array() -> None:
    spelled = MistralTools()  # the byte-level matcher has no [TOOL_CALLS] token
    auto = spelled.grammar(job({"tools": [WEATHER, ADD]}).tools)
    assert accepts(auto, CALL) and accepts(auto, ADDS) and accepts(auto, "It is sunny.")
    assert accepts(auto, "Let me look." + CALL)
    assert not accepts(auto, CALL.replace('"arguments"', '"parameters"'))  # the template's key
    assert not accepts(auto, CALL.replace("Paris", "Oslo")) and not accepts(auto, ADDS.replace("123", "1234"))
    assert not accepts(auto, BOTH)  # one call unless parallel
    assert not accepts(auto, CALL.replace("][", "] ["))  # tekken's spacing
    assert accepts(MistralTools(space=" ").grammar(job({"tools": [WEATHER]}).tools), CALL.replace("][", "] ["))
    required = spelled.grammar(job({"tools": [WEATHER, ADD], "tool_choice": "required",
                                    "parallel_tool_calls": True}).tools)
    assert accepts(required, BOTH) and not accepts(required, "It is sunny.") and not accepts(required, "Hm." + CALL)
    named = spelled.grammar(job({"tools": [WEATHER, ADD], "tool_choice": {"type": "function",
                                                                          "function": {"name": "add"}}}).tools)
    assert accepts(named, ADDS) and not accepts(named, CALL)


PARSED = [(CALL, None, [("get_weather", {"city": "Paris", "days": 2})]),
          (ADDS, None, [("add", {"a": 3})]),
          ("Let me look.\n" + CALL, "Let me look.", [("get_weather", {"city": "Paris", "days": 2})]),
          (BOTH, None, [("get_weather", {"city": "Paris", "days": 2}), ("add", {"a": 3})]),
          ('[TOOL_CALLS] [{"name": "add", "arguments": {"a": 3}}]', None, [("add", {"a": 3})]),
          ("It is [sunny].\n", "It is [sunny].\n", []),
          (CALL[:30], CALL[:30], []),  # cut short (max_tokens) before the first call's head: the raw text
          ("[TOOL_CALLS] no", "[TOOL_CALLS] no", [])]


@pytest.mark.parametrize(("text", "content", "calls"), PARSED)
def test_replies_are_read_whole_and_streamed_alike(text: str, content: str | None, calls: list) -> None:
    read_alike(MistralTools(CALLS_ID), text, content, calls, id_check=nine)


@pytest.fixture(scope="module")
def client(model):
    with LiveServer(create_app(Engine.load(str(model[0]))), drain_s=5) as s:
        yield openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_a_random_mistral_calls_in_its_own_format_through_the_openai_client(client, tokenizer: Tokenizer) -> None:
    r = client.chat.completions.create(model="default", messages=ASK, tools=[WEATHER, ADD], tool_choice="required",
                                       temperature=0, max_tokens=120)
    choice = r.choices[0]
    [call] = choice.message.tool_calls
    assert choice.finish_reason == "tool_calls" and choice.message.content is None and nine(call.id)
    args = json.loads(call.function.arguments)
    assert (call.function.name, set(args)) in (("get_weather", {"city", "days"}), ("add", {"a"}))
    j = job({"tools": [WEATHER, ADD], "tool_choice": "required"})
    assert r.usage.prompt_tokens == len(tokenizer.encode_chat(j.messages, **j.tool_variables))

    chunks = [c for c in client.chat.completions.create(
        model="default", messages=ASK, tools=[WEATHER, ADD], tool_choice="required", temperature=0, max_tokens=120,
        stream=True) if c.choices]
    parts = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert nine(parts[0].id) and parts[0].function.name == call.function.name
    assert all(p.index == 0 and p.id is None for p in parts[1:])
    assert json.loads("".join(p.function.arguments or "" for p in parts)) == args
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    named = client.chat.completions.create(model="default", messages=ASK, tools=[WEATHER, ADD], temperature=0,
                                           max_tokens=120, tool_choice={"type": "function",
                                                                        "function": {"name": "get_weather"}})
    weather = json.loads(named.choices[0].message.tool_calls[0].function.arguments)
    assert weather["city"] in ("Paris", "Rome") and 1 <= weather["days"] <= 7

    # the call and its result go back with the client's ids, which the template would refuse: a reply, not a 400
    follow = client.chat.completions.create(model="default", tools=[WEATHER, ADD], temperature=0, max_tokens=8,
                                            messages=[*ASK, choice.message.model_dump(exclude_none=True),
                                                      {"role": "tool", "tool_call_id": "call_x", "content": "18"}])
    assert follow.choices[0].finish_reason in ("stop", "length", "tool_calls")
