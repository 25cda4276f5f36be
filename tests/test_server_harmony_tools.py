"""gpt-oss's tool calls on the server (`app/server/harmony_tools.py`): a tiny gpt-oss whose greedy reply is a harmony
call (`tests/support/harmony_tool_models.py`: the real o200k_harmony tokenizer, gpt-oss's chat template, bigram weights)
served live and driven by the `openai` and `anthropic` SDKs. The call the engine reads from the `commentary` channel
comes back as chat `tool_calls` (whole and streamed), a Responses `function_call` item and an Anthropic `tool_use`
block; the follow-up turn's prompt is the one openai-harmony itself renders for the same conversation.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import anthropic
import openai
import pytest
from mlx_engine.tokenizer import Tokenizer

from app.server import create_app
from app.server.harmony_tools import HARMONY_TOOLS
from app.server.protocol import parse_job
from tests.support.harmony_tool_models import ARGUMENTS, TEMPLATE_FILE, harmony_tool_model_folder
from tests.support.server_fakes import LiveServer

PARAMETERS = {"type": "object", "properties": {"city": {"type": "string", "description": "The city"},
                                               "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
              "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather",
                                            "parameters": PARAMETERS}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
GREEDY = {"temperature": 0, "max_tokens": 40}


@pytest.fixture(scope="module")
def folder(tmp_path_factory, cache) -> Path:
    return harmony_tool_model_folder(tmp_path_factory.mktemp("gptoss") / "m")


@pytest.fixture(scope="module")
def server(folder):
    from mlx_engine import Engine

    engine = Engine.load(str(folder))
    with LiveServer(create_app(engine), drain_s=5) as s:
        yield s
    engine.close()


@pytest.fixture(scope="module")
def chat(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


def test_a_commentary_call_is_openais_tool_call(chat) -> None:
    r = chat.chat.completions.create(model="default", messages=ASK, tools=[WEATHER], **GREEDY)
    choice = r.choices[0]
    [call] = choice.message.tool_calls
    assert (call.type, call.function.name, call.function.arguments) == ("function", "get_weather", ARGUMENTS)
    assert call.id.startswith("call_") and choice.finish_reason == "tool_calls"
    assert choice.message.content is None and choice.message.reasoning_content is None


def test_streamed_the_call_is_its_name_then_its_arguments(chat) -> None:
    chunks = list(chat.chat.completions.create(model="default", messages=ASK, tools=[WEATHER], stream=True, **GREEDY))
    deltas = [c.choices[0].delta for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    head, arguments = (d.tool_calls[0] for d in deltas)
    assert (head.index, head.type, head.function.name, head.function.arguments) == (0, "function", "get_weather", "")
    assert head.id.startswith("call_")
    assert (arguments.index, arguments.id, arguments.function.name, arguments.function.arguments) == (
        0, None, None, ARGUMENTS)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)


def test_the_follow_up_turn_goes_through_the_template(chat, folder) -> None:
    """The call and its result rendered by gpt-oss's template: the prompt openai-harmony renders for the same
    conversation, token for token; the model (which always calls) answers it."""
    from openai_harmony import (Author, Conversation, DeveloperContent, Message, ReasoningEffort, Role,
                                SystemContent, ToolDescription)

    from mlx_engine.harmony import harmony_format

    first = chat.chat.completions.create(model="default", messages=ASK, tools=[WEATHER], **GREEDY)
    [call] = first.choices[0].message.tool_calls
    history = [{"role": "system", "content": "Be brief."}, *ASK, first.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "18C"}]
    follow = chat.chat.completions.create(model="default", messages=history, tools=[WEATHER], reasoning_effort="low",
                                          **GREEDY)
    assert follow.choices[0].finish_reason == "tool_calls"

    tok = Tokenizer.from_folder(folder)
    job = parse_job({"model": "default", "messages": history, "tools": [WEATHER]}, "chat", {"default"}, "default",
                    4096, tok.vocab_size, HARMONY_TOOLS)
    ids = tok.encode_chat(job.messages, reasoning_effort="low", **job.tool_variables)
    assert follow.usage.prompt_tokens == len(ids)
    tool = ToolDescription.new("get_weather", "Current weather", parameters=PARAMETERS)
    today = datetime.date.today().isoformat()
    conversation = Conversation.from_messages([
        Message.from_role_and_content(Role.SYSTEM, SystemContent.new().with_reasoning_effort(ReasoningEffort.LOW)
                                      .with_conversation_start_date(today)),
        Message.from_role_and_content(Role.DEVELOPER, DeveloperContent.new().with_instructions("Be brief.")
                                      .with_function_tools([tool])),
        Message.from_role_and_content(Role.USER, "Weather in Paris?"),
        Message.from_role_and_content(Role.ASSISTANT, '{"city": "Paris"}').with_channel("commentary")
        .with_recipient("functions.get_weather").with_content_type("json"),
        Message.from_author_and_content(Author.new(Role.TOOL, "functions.get_weather"), '"18C"')
        .with_channel("commentary").with_recipient("assistant"),
    ])
    encoding = harmony_format(tok).encoding
    expected = encoding.decode(encoding.render_conversation_for_completion(conversation, Role.ASSISTANT))
    assert tok.decode(ids) == expected


def test_the_fixture_is_gpt_oss_s_template_as_openai_harmony_renders_it(folder) -> None:
    """The fixture against the format's own renderer on what it covers beyond the follow-up: no system message, a
    function without parameters, integers, arrays, booleans and optional ones."""
    from openai_harmony import Conversation, DeveloperContent, Message, Role, SystemContent, ToolDescription

    from mlx_engine.harmony import harmony_format

    tok = Tokenizer.from_folder(folder)
    params = {"type": "object", "properties": {"n": {"type": "integer"}, "tags": {"type": "array",
                                                                                   "items": {"type": "string"}},
                                               "dry": {"type": "boolean", "description": "Only check"}},
              "required": ["n"]}
    tools = [{"type": "function", "function": {"name": "roll", "description": "Roll dice", "parameters": params}},
             {"type": "function", "function": {"name": "now", "description": "The time"}}]
    ids = tok.encode_chat(ASK, tools=tools)
    today = datetime.date.today().isoformat()
    conversation = Conversation.from_messages([
        Message.from_role_and_content(Role.SYSTEM, SystemContent.new().with_conversation_start_date(today)),
        Message.from_role_and_content(Role.DEVELOPER, DeveloperContent.new().with_function_tools(
            [ToolDescription.new("roll", "Roll dice", parameters=params), ToolDescription.new("now", "The time")])),
        Message.from_role_and_content(Role.USER, "Weather in Paris?"),
    ])
    encoding = harmony_format(tok).encoding
    assert tok.decode(ids) == encoding.decode(encoding.render_conversation_for_completion(conversation,
                                                                                          Role.ASSISTANT))
    assert TEMPLATE_FILE.read_text() == tok.chat_template


def test_a_named_or_required_call_is_asked_for_not_enforced(folder) -> None:
    tok = Tokenizer.from_folder(folder)
    other = {"type": "function", "function": {"name": "get_time", "description": "Now", "parameters": PARAMETERS}}
    for choice, line in (("required", "Call a function before you answer."),
                         ({"type": "function", "function": {"name": "get_weather"}},
                          "Call the function get_weather before you answer.")):
        job = parse_job({"model": "default", "messages": ASK, "tools": [WEATHER, other], "tool_choice": choice},
                        "chat", {"default"}, "default", 4096, tok.vocab_size, HARMONY_TOOLS)
        text = tok.decode(tok.encode_chat(job.messages, **job.tool_variables))
        assert f"<|start|>developer<|message|># Instructions\n\n{line}\n\n# Tools" in text
        assert ("type get_time" in text) == (choice == "required")  # a named function is the only one offered
        assert job.sampling["response_format"] is None  # no grammar: the model writes its own commentary


def test_responses_gives_a_function_call_item(chat) -> None:
    tool = {"type": "function", "name": "get_weather", "description": "Current weather", "parameters": PARAMETERS}
    r = chat.responses.create(model="default", input="Weather in Paris?", tools=[tool], temperature=0,
                              max_output_tokens=40)
    [item] = r.output
    assert (item.type, item.name, item.arguments, r.status) == ("function_call", "get_weather", ARGUMENTS, "completed")
    events = list(chat.responses.create(model="default", input="Weather in Paris?", tools=[tool], temperature=0,
                                        max_output_tokens=40, stream=True))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [(e.name, e.arguments) for e in done] == [("get_weather", ARGUMENTS)]
    assert events[-1].type == "response.completed" and events[-1].response.output[0].type == "function_call"


def test_anthropic_gets_a_tool_use_block(client) -> None:
    tool = {"name": "get_weather", "description": "Current weather", "input_schema": PARAMETERS}
    r = client.messages.create(model="default", max_tokens=40, messages=ASK, tools=[tool],
                               extra_body={"temperature": 0})
    [use] = r.content
    assert (use.type, use.name, use.input, r.stop_reason) == ("tool_use", "get_weather", {"city": "Paris"}, "tool_use")
    with client.messages.stream(model="default", max_tokens=40, messages=ASK, tools=[tool],
                                extra_body={"temperature": 0}) as stream:
        final = stream.get_final_message()
    assert [(b.type, b.input) for b in final.content] == [("tool_use", {"city": "Paris"})]
    assert final.stop_reason == "tool_use"
    history = [*ASK, {"role": "assistant", "content": [use.model_dump(exclude_none=True)]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "18C"}]}]
    follow = client.messages.create(model="default", max_tokens=40, messages=history, tools=[tool],
                                    extra_body={"temperature": 0})
    counted = client.messages.count_tokens(model="default", messages=history, tools=[tool])
    assert follow.usage.input_tokens + follow.usage.cache_read_input_tokens == counted.input_tokens
    assert json.dumps(follow.content[0].input) == '{"city": "Paris"}'


def test_a_call_cut_by_max_tokens_is_no_call(chat) -> None:
    # 17 tokens make the call before its <|call|>: 14 stop inside its arguments
    r = chat.chat.completions.create(model="default", messages=ASK, tools=[WEATHER], temperature=0, max_tokens=14)
    assert (r.choices[0].finish_reason, r.choices[0].message.tool_calls) == ("length", None)
    assert r.usage.completion_tokens == 14
