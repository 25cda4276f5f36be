"""Each family's own tool-call format: a Qwen 2.5 chat template (Hermes-style `<tool_call>` blocks) is detected, its
own `tools` variable and `message.tool_calls` render the tools and earlier calls, the reply is held to
`<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>` by a grammar, and is read back whole or streamed as
OpenAI's `tool_calls` deltas (id and name, then argument fragments). A tiny random qwen2 with a byte-level tokenizer
and Qwen's added tokens runs it through the real openai client."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import anthropic
import numpy as np
import openai
import pytest
from llguidance import LLMatcher
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from app.server import create_app
from app.server.protocol import parse_job
from app.toolcalls.tool_formats import JSON, HermesTools, JsonTools, detect
from mlx_engine import Engine
from mlx_engine.structured import grammar
from mlx_engine.tokenizer import Tokenizer
from tests.support.schema_models import BYTES, PERSON
from tests.support.server_fakes import LiveServer
from tests.support.tiny_models import byte_level_vocab, folder_with_weights

DATA = Path(__file__).parent / "data"
QWEN_TEMPLATE = (DATA / "qwen2_5_chat_template.jinja").read_text()
VOCAB = 264  # 256 bytes, <|endoftext|> <|im_start|> <|im_end|> (special), <tool_call> </tool_call> (added), spare
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"]}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["a"]}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The golden random qwen2 with a bigger vocabulary and context, a byte-level tokenizer with Qwen's special and
    added tokens, and Qwen 2.5's chat template."""
    folder = tmp_path_factory.mktemp("qwen") / "tiny-qwen"
    embed = np.random.default_rng(0).standard_normal((VOCAB, 64)).astype(np.float32)
    folder_with_weights(DATA / "golden" / "qwen2", folder, {"model.embed_tokens.weight": embed})
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "vocab_size": VOCAB, "max_position_embeddings": 4096}))
    tok = HFTokenizer(models.BPE(vocab={c: i for i, c in enumerate(byte_level_vocab(256))}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<tool_call>", "</tool_call>")])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                                                              "chat_template": QWEN_TEMPLATE}))
    return folder


@pytest.fixture(scope="module")
def tokenizer(qwen: Path) -> Tokenizer:
    return Tokenizer.from_folder(qwen)


def job(body: dict[str, Any], tool_format=HermesTools(259, 260)):
    return parse_job({"model": "fake", "messages": ASK, **body}, "chat", {"fake"}, "fake", 4096, VOCAB, tool_format)


def test_the_template_s_markup_picks_the_format(tokenizer: Tokenizer) -> None:
    found = detect(tokenizer.chat_template, lambda t: tokenizer.encode(t, add_special_tokens=False))
    assert isinstance(found, HermesTools) and (found.open_id, found.close_id) == (259, 260)
    spelled = detect(QWEN_TEMPLATE, lambda t: list(t.encode()))  # markers that are no tokens of their own
    assert isinstance(spelled, HermesTools) and spelled.open_id is None
    assert detect("{% for m in messages %}{{ m.content }}{% endfor %}") is JSON and detect(None) is JSON
    coder = "{{- '<tool_call>\\n<function=' + tool_call.name + '>\\n' }}"  # Qwen3-Coder's XML: not this format
    assert detect(coder) is JSON


def test_tools_and_earlier_calls_render_through_the_template(tokenizer: Tokenizer) -> None:
    """The template's own `tools` variable lists the tools; an assistant turn's calls and the tool's result are
    rendered by the template (`message.tool_calls`, `<tool_response>`), not as the JSON format's text."""
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris", "days": 2}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"}]
    j = job({"messages": history, "tools": [WEATHER]})
    assert j.messages[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}]}
    assert j.messages[2] == {"role": "tool", "content": "18 degrees"}  # no line added: the model knows its loop
    text = tokenizer.apply_chat_template(j.messages, **j.tool_variables)
    listed = json.dumps({"type": "function", "function": j.tools.functions[0]}, ensure_ascii=False)
    assert text == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.\n\n# Tools\n\n"
        "You may call one or more functions to assist with the user query.\n\nYou are provided with function "
        f"signatures within <tools></tools> XML tags:\n<tools>\n{listed}\n</tools>\n\nFor each function call, "
        "return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n18 degrees\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n")
    plain = job({"messages": history})  # no tools offered: the earlier call still renders natively
    assert "tool_calls" in plain.messages[1] and plain.tool_variables == {}
    old = job({"messages": history, "tools": [WEATHER]}, JSON)  # the JSON format: calls as text, tools as a line
    assert old.messages[2]["content"].startswith('{"tool_calls": [') and "tools" not in old.tool_variables


def accepts(fmt, text: str) -> bool:
    m = LLMatcher(BYTES, grammar(fmt), log_level=0)
    assert not m.is_error(), m.get_error()
    return m.consume_tokens(list(text.encode())) and m.is_accepting()


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
ADDS = '<tool_call>\n{"name": "add", "arguments": {"a": 3}}\n</tool_call>'


def test_the_grammar_holds_the_reply_to_the_native_format() -> None:
    hermes = HermesTools()  # markers as text: the byte-level matcher has no tokens of their own
    auto = hermes.grammar(job({"tools": [WEATHER, ADD]}).tools)
    assert auto.type == "lark"
    assert accepts(auto, CALL) and accepts(auto, "It is sunny.") and accepts(auto, "Let me look.\n" + CALL)
    assert not accepts(auto, CALL.replace("Paris", "Oslo"))  # its arguments' schema
    assert not accepts(auto, CALL.replace("get_weather", "get_time"))  # an offered function
    assert not accepts(auto, CALL.replace('{"name": ', '{"name":  '))  # the template's own JSON style
    assert not accepts(auto, CALL + "\n" + ADDS)  # one call unless parallel
    assert not accepts(auto, "text <tool_call> more")  # text never opens a call it does not make
    required = hermes.grammar(job({"tools": [WEATHER, ADD], "tool_choice": "required",
                                   "parallel_tool_calls": True}).tools)
    assert accepts(required, CALL + "\n" + ADDS) and not accepts(required, "It is sunny.")
    assert not accepts(required, "Sure.\n" + CALL)  # a required call comes first
    named = hermes.grammar(job({"tools": [WEATHER, ADD], "tool_choice": {"type": "function",
                                                                         "function": {"name": "add"}}}).tools)
    assert accepts(named, ADDS) and not accepts(named, CALL)
    nested = hermes.grammar(job({"tools": [{"type": "function", "function": {"name": "save", "parameters": PERSON}}],
                                 "tool_choice": "required"}).tools)  # pydantic's $defs, inside the block's %json
    person = {"name": "Bob", "address": {"street": "1 Main St", "city": "Springfield"}}
    assert accepts(nested, f'<tool_call>\n{json.dumps({"name": "save", "arguments": person})}\n</tool_call>')


PARSED = [(CALL, None, [("get_weather", {"city": "Paris", "days": 2})]),
          ("Let me look.\n" + CALL, "Let me look.", [("get_weather", {"city": "Paris", "days": 2})]),
          (CALL + "\n" + ADDS, None, [("get_weather", {"city": "Paris", "days": 2}), ("add", {"a": 3})]),
          ("It is sunny.\n", "It is sunny.\n", []),
          (CALL[:40], CALL[:40], []),  # cut short (max_tokens) inside a call: the raw text
          ('<tool_call>\n{"name": "add", "arguments": "a=1"}\n</tool_call>', None, [("add", "a=1")])]


@pytest.mark.parametrize(("text", "content", "calls"), PARSED)
def test_replies_are_read_whole_and_streamed_alike(text: str, content: str | None, calls: list) -> None:
    hermes = HermesTools()
    got_content, got_calls = hermes.parse(text)
    assert got_content == content
    assert [(c["function"]["name"], _args(c["function"]["arguments"])) for c in got_calls or []] == calls
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in got_calls or [])
    rng = random.Random(0)
    for _ in range(5):  # any split of the text into pieces
        reader, deltas, at = hermes.stream(), [], 0
        while at < len(text):
            n = rng.randint(1, 7)
            deltas += reader.feed(text[at:at + n])
            at += n
        deltas += reader.finish()
        streamed = "".join(d.content for d in deltas if d.content is not None)
        assert streamed == (content or "" if calls else text)
        pieces: dict[int, list[dict]] = {}
        for d in deltas:
            if d.call is not None:
                pieces.setdefault(d.call["index"], []).append(d.call)
        assert reader.called == bool(calls) and len(pieces) == len(calls)
        for (name, arguments), parts in zip(calls, pieces.values()):
            head, rest = parts[0], parts[1:]
            assert head["id"].startswith("call_") and head["type"] == "function" and head["function"]["name"] == name
            assert all(set(p) == {"index", "function"} and set(p["function"]) == {"arguments"} for p in rest)
            assert _args("".join(p["function"]["arguments"] for p in parts)) == arguments


def _args(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def test_the_json_format_streams_calls_whole() -> None:
    reader = JsonTools().stream()
    assert reader.feed('{"tool_calls": [{"name": "add", "arguments": {"a": 1}}]}') == []
    [delta] = reader.finish()
    assert delta.call["function"] == {"name": "add", "arguments": '{"a": 1}'} and reader.called


@pytest.fixture(scope="module")
def server(qwen: Path):
    with LiveServer(create_app(Engine.load(str(qwen))), drain_s=5) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_a_random_qwen_calls_in_its_own_format_through_the_openai_client(client, tokenizer: Tokenizer) -> None:
    """Held to the grammar, even random weights make a call that parses and validates; streamed, it arrives as its
    id and name, then argument fragments that add up to the same arguments; the prompt is the template's."""
    r = client.chat.completions.create(model="default", messages=ASK, tools=[WEATHER, ADD], tool_choice="required",
                                       temperature=0, max_tokens=80)
    choice = r.choices[0]
    [call] = choice.message.tool_calls
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    args = json.loads(call.function.arguments)
    assert (call.function.name, set(args)) in (("get_weather", {"city", "days"}), ("add", {"a"}))
    j = job({"tools": [WEATHER, ADD], "tool_choice": "required"})
    assert r.usage.prompt_tokens == len(tokenizer.encode_chat(j.messages, **j.tool_variables))

    chunks = [c for c in client.chat.completions.create(
        model="default", messages=ASK, tools=[WEATHER, ADD], tool_choice="required", temperature=0, max_tokens=80,
        stream=True) if c.choices]
    parts = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert parts[0].id.startswith("call_") and parts[0].function.name == call.function.name
    assert len(parts) > 2 and all(p.index == 0 and p.id is None and p.function.name is None for p in parts[1:])
    assert json.loads("".join(p.function.arguments or "" for p in parts)) == args
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    named = client.chat.completions.create(model="default", messages=ASK, tools=[WEATHER, ADD], temperature=0,
                                           max_tokens=80, tool_choice={"type": "function",
                                                                       "function": {"name": "get_weather"}})
    weather = json.loads(named.choices[0].message.tool_calls[0].function.arguments)
    assert weather["city"] in ("Paris", "Rome") and 1 <= weather["days"] <= 7

    follow = client.chat.completions.create(model="default", tools=[WEATHER, ADD], temperature=0, max_tokens=8,
                                            messages=[*ASK, choice.message.model_dump(exclude_none=True),
                                                      {"role": "tool", "tool_call_id": call.id, "content": "18"}])
    assert follow.choices[0].finish_reason in ("stop", "length", "tool_calls")

    flat = {"type": "function", **WEATHER["function"]}
    out = client.responses.create(model="default", input="Weather?", tools=[flat], tool_choice="required",
                                  temperature=0, max_output_tokens=80)
    [item] = out.output
    assert item.type == "function_call" and item.name == "get_weather" and set(json.loads(item.arguments)) == {
        "city", "days"}


def test_a_random_qwen_calls_in_its_own_format_through_the_anthropic_client(server, client,
                                                                            tokenizer: Tokenizer) -> None:
    """/v1/messages offers tools, holds the call and reads it back in the model's own format, as chat does: the same
    prompt tokens and the same call as chat's, streamed alike; a tool_use turn goes back through the template's
    `message.tool_calls` (count_tokens is the prompt chat renders for the same conversation). Before, the Messages
    route always used the JSON format's system prompt and grammar."""
    messages = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120).messages
    offered = [{"name": f["function"]["name"], "description": f["function"].get("description", ""),
                "input_schema": f["function"]["parameters"]} for f in (WEATHER, ADD)]
    ask = {"model": "default", "max_tokens": 80, "messages": ASK, "tools": offered, "extra_body": {"temperature": 0}}
    r = messages.create(**ask, tool_choice={"type": "any"})
    [use] = r.content
    assert use.type == "tool_use" and r.stop_reason == "tool_use"
    c = client.chat.completions.create(model="default", messages=ASK, tools=[WEATHER, ADD], tool_choice="required",
                                       temperature=0, max_tokens=80)
    [call] = c.choices[0].message.tool_calls
    assert (use.name, use.input) == (call.function.name, json.loads(call.function.arguments))
    assert r.usage.input_tokens + r.usage.cache_read_input_tokens == c.usage.prompt_tokens
    assert r.usage.output_tokens == c.usage.completion_tokens
    with messages.stream(**ask, tool_choice={"type": "any"}) as stream:
        final = stream.get_final_message()
    assert [(b.type, b.name, b.input) for b in final.content] == [("tool_use", use.name, use.input)]

    history = [*ASK, {"role": "assistant", "content": [use.model_dump(exclude_none=True)]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "18"}]}]
    counted = messages.count_tokens(model="default", messages=history, tools=offered)
    j = job({"messages": [*ASK, c.choices[0].message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": "18"}], "tools": [WEATHER, ADD]})
    assert counted.input_tokens == len(tokenizer.encode_chat(j.messages, **j.tool_variables))
