"""Ollama's API on the server's port, through the real `ollama` Python client (what Open WebUI and friends send) and
raw httpx (NDJSON framing, errors): chat and generate, streaming and not, options mapped onto the sampling, format,
think, tools, images refused, tags / ps / show / version, loading and unloading by keep_alive, and every 400 naming
the field as the client sent it."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import httpx
import ollama
import pytest
from mlx_engine.api import GenerationEvent, GenerationRequest, ToolCall

from app.server import create_app
from tests.support.server_fakes import THOUGHT, FakeEngine, FakeStream, LiveServer, wait_until
from tests.support.pool_fakes import Loads, make_pool

USER = [{"role": "user", "content": "Hi"}]


class CallingStream(FakeStream):
    """Replies with nothing but a call the engine read in the model's own format (as harmony's are)."""

    def __next__(self) -> GenerationEvent:
        event = super().__next__()
        if event.finish_reason is None:
            return GenerationEvent(token_ids=event.token_ids)
        return GenerationEvent(finish_reason="stop", usage=event.usage, stats=event.stats,
                               tool_calls=(ToolCall("get_weather", '{"city": "Paris"}'),))


class CallingEngine(FakeEngine):
    """With a context that holds the tools' rendering (a few hundred characters, one token each)."""

    def __init__(self, name: str):
        super().__init__(name=name)
        self.info = dataclasses.replace(self.info, context_length=4096)

    def generate(self, request: GenerationRequest) -> FakeStream:
        self.requests.append(request)
        self.streams.append(CallingStream(self, list(request.prompt_token_ids or []), request))
        return self.streams[-1]


class OllamaLoads(Loads):
    def load(self, p: Any) -> FakeEngine:
        engine = super().load(p)
        if p.ref == "org/b":  # a reasoning model
            engine = self.engines[p.ref] = FakeEngine(name=p.ref, reasoning="think")
        if p.ref == "org/c":
            engine = self.engines[p.ref] = CallingEngine(name=p.ref)
        return engine


@pytest.fixture(scope="module")
def served():
    loads = OllamaLoads()
    pool = make_pool(loads)
    with LiveServer(create_app(pool)) as s:
        yield s, loads, pool, ollama.Client(host=s.url)


def test_chat_and_generate_whole_and_streamed(served) -> None:
    s, loads, _, client = served
    r = client.chat("org/a", USER)
    assert r.model == "org/a" and r.done and r.done_reason == "stop" and r.message.role == "assistant"
    assert r.message.content == "Hello world" and r.eval_count == 11
    prompt = loads.engines["org/a"].requests[-1].prompt_token_ids
    assert r.prompt_eval_count == len(prompt) and r.total_duration > 0
    parts = list(client.chat("org/a", USER, stream=True))
    assert "".join(p.message.content for p in parts) == "Hello world"
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True] and parts[-1].eval_count == 11
    g = client.generate("org/a", "Hi", system="Be brief.")
    assert g.response == "Hello world" and g.done
    text = loads.engines["org/a"].tokenizer.decode(loads.engines["org/a"].requests[-1].prompt_token_ids)
    assert text == "<system>Be brief.<user>Hi<assistant>"
    assert "".join(p.response for p in client.generate("org/a", "Hi", stream=True)) == "Hello world"
    g = client.generate("org/a", "abc", raw=True)  # no template: the prompt as it is
    assert g.response == "Hello world"
    assert loads.engines["org/a"].requests[-1].prompt_token_ids == [2, 97, 98, 99]


def test_options_map_onto_the_sampling(served) -> None:
    _, loads, _, client = served
    options = {"temperature": 0.3, "top_p": 0.8, "top_k": 7, "min_p": 0.1, "seed": 11, "stop": ["wor"],
               "num_predict": 9, "repeat_penalty": 1.2, "presence_penalty": 0.5, "frequency_penalty": 0.25,
               "num_ctx": 4096, "num_gpu": 99, "mirostat": 0}  # the last two: nothing here uses them
    r = client.chat("org/a", USER, options=options)
    assert r.message.content == "Hello wo" and r.done_reason == "stop"  # the fake ends before the stop's last token
    p = loads.engines["org/a"].requests[-1].sampling
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.seed, p.stop, p.max_tokens, p.repetition_penalty,
            p.presence_penalty, p.frequency_penalty) == (0.3, 0.8, 7, 0.1, 11, ("wor",), 9, 1.2, 0.5, 0.25)
    r = client.generate("org/a", "Hi", options={"num_predict": 4})
    assert r.response == "Hell" and r.done_reason == "length"
    client.generate("org/a", "Hi", options={"num_predict": -1})  # Ollama's "no limit": the server's default
    assert loads.engines["org/a"].requests[-1].sampling.max_tokens == 64 - len(
        loads.engines["org/a"].requests[-1].prompt_token_ids)


def test_format_becomes_structured_output(served) -> None:
    _, loads, _, client = served
    client.chat("org/a", USER, format="json")
    f = loads.engines["org/a"].requests[-1].sampling.response_format
    assert f is not None and f.type == "json_object"
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    client.chat("org/a", USER, format=schema)
    f = loads.engines["org/a"].requests[-1].sampling.response_format
    assert f is not None and f.type == "json_schema" and f.schema["properties"] == schema["properties"]


def test_think_shows_the_reasoning_apart_and_false_turns_it_off(served) -> None:
    _, loads, _, client = served
    r = client.chat("org/b", USER)
    assert r.message.thinking == THOUGHT and r.message.content == "Hello world"
    parts = list(client.chat("org/b", USER, stream=True))
    assert "".join(p.message.thinking or "" for p in parts) == THOUGHT
    assert "".join(p.message.content for p in parts) == "Hello world"
    r = client.chat("org/b", USER, think=False)
    assert not r.message.thinking and r.message.content == "Hello world"
    assert loads.engines["org/b"].tokenizer.template_kwargs[-1].get("enable_thinking") is False
    r = client.generate("org/b", "Hi")
    assert r.thinking == THOUGHT and r.response == "Hello world"


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]


def test_tool_calls_in_ollamas_shape_both_ways(served) -> None:
    _, loads, _, client = served
    r = client.chat("org/c", USER, tools=TOOLS)
    calls = r.message.tool_calls
    assert len(calls) == 1 and calls[0].function.name == "get_weather"
    assert calls[0].function.arguments == {"city": "Paris"}  # an object, as Ollama sends arguments
    parts = list(client.chat("org/c", USER, tools=TOOLS, stream=True))
    assert parts[-1].done and parts[-1].message.tool_calls[0].function.arguments == {"city": "Paris"}
    history = [*USER, {"role": "assistant", "content": "",
                       "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
               {"role": "tool", "content": "sunny", "tool_name": "get_weather"}]
    client.chat("org/c", history, tools=TOOLS)  # the earlier call goes back through the model's template
    text = loads.engines["org/c"].tokenizer.decode(loads.engines["org/c"].requests[-1].prompt_token_ids)
    assert '"get_weather"' in text and '"Paris"' in text and "<tool>sunny" in text


def test_ndjson_framing_over_raw_http(served) -> None:
    s, _, _, _ = served
    with httpx.stream("POST", s.url + "/api/chat", json={"model": "org/a", "messages": USER}) as r:
        assert r.status_code == 200 and r.headers["content-type"] == "application/x-ndjson"
        raw = b"".join(r.iter_bytes())
    lines = raw.split(b"\n")
    assert lines[-1] == b"" and all(lines[:-1])  # one object a line, each line ended
    objs = [json.loads(x) for x in lines[:-1]]
    assert [o["done"] for o in objs] == [False] * 11 + [True]
    assert "".join(o["message"]["content"] for o in objs) == "Hello world"
    last = objs[-1]
    assert last["done_reason"] == "stop" and last["eval_count"] == 11 and last["eval_duration"] > 0
    assert set(last) >= {"total_duration", "load_duration", "prompt_eval_count", "prompt_eval_duration"}
    r = httpx.post(s.url + "/api/generate", json={"model": "org/a", "prompt": "Hi", "stream": False})
    assert r.headers["content-type"] == "application/json" and r.json()["response"] == "Hello world"


@pytest.mark.parametrize("body, field, words", [
    ({"options": {"temperature": 5}}, "options.temperature", "must be in [0, 2]"),
    ({"options": {"num_predict": "many"}}, "options.num_predict", "must be an integer"),
    ({"options": {"top_p": "x"}}, "options.top_p", "must be a number"),
    ({"options": {"num_ctx": 0}}, "options.num_ctx", "integer >= 1"),
    ({"options": [1]}, "options", "must be an object"),
    ({"format": "yaml"}, "format", "\"json\" or a JSON Schema"),
    ({"think": "lots"}, "think", "true, false"),
    ({"stream": "yes"}, "stream", "must be a boolean"),
    ({"keep_alive": "later"}, "keep_alive", "expected seconds"),
    ({"messages": [{"role": "user", "content": "Hi", "images": ["aGk="]}]}, "messages[0].images", "text only"),
    ({"messages": [{"role": "robot", "content": "Hi"}]}, "messages[0].role", "must be one of"),
])
def test_a_bad_chat_is_a_400_naming_the_field_as_sent(served, body: dict[str, Any], field: str, words: str) -> None:
    s, _, _, _ = served
    r = httpx.post(s.url + "/api/chat", json={"model": "org/a", "messages": USER, **body})
    assert r.status_code == 400
    message = r.json()["error"]
    assert f"'{field}'" in message and words in message, message


def test_generate_errors_name_the_prompt_not_the_messages_it_became(served) -> None:
    s, _, _, _ = served
    r = httpx.post(s.url + "/api/generate", json={"model": "org/a", "prompt": "x" * 80})
    assert r.status_code == 400 and "but the prompt is 97 tokens" in r.json()["error"]  # with the template's
    assert "messages" not in r.json()["error"]
    r = httpx.post(s.url + "/api/generate", json={"model": "org/a", "prompt": 5})
    assert r.status_code == 400 and r.json()["error"] == "'prompt' must be a string, got an integer"


def test_generate_refuses_what_it_cannot_do(served) -> None:
    s, _, _, client = served
    with pytest.raises(ollama.ResponseError) as e:
        client.generate("org/a", "Hi", images=["aGk="])
    assert e.value.status_code == 400 and "'images'" in e.value.error and "text only" in e.value.error
    for field, value in (("suffix", "end"), ("template", "{{ .Prompt }}"), ("context", [1, 2])):
        r = httpx.post(s.url + "/api/generate", json={"model": "org/a", "prompt": "Hi", field: value})
        assert r.status_code == 400 and r.json()["error"].startswith(f"'{field}': ")
    with pytest.raises(ollama.ResponseError) as e:
        client.chat("org/nope", USER)
    assert e.value.status_code == 404 and "not on this machine" in e.value.error and "ollama pull" in e.value.error
    r = httpx.post(s.url + "/api/embed", json={"model": "org/a", "input": "hi"})
    assert r.status_code == 400 and "'org/a' is a chat model" in r.json()["error"]
    r = httpx.post(s.url + "/api/pull", json={"model": "org/a"})
    assert r.status_code == 501 and "roofline pull" in r.json()["error"]


def test_tags_ps_show_version_and_loading_by_keep_alive(served) -> None:
    s, loads, pool, client = served
    names = [m.model for m in client.list().models]
    assert names == ["org/a", "org/b", "org/c", "ollama:tiny:latest", "org/big"]
    tiny = next(m for m in client.list().models if m.model == "ollama:tiny:latest")
    assert tiny.size == 1000 and tiny.details.quantization_level == "Q4_0" and tiny.details.family == "llama"
    r = client.generate("tiny", keep_alive="forever")  # no prompt: load it, as Ollama's clients preload
    assert r.done and r.done_reason == "load" and "ollama:tiny:latest" in loads.loaded
    running = {m.model: m for m in client.ps().models}
    assert "tiny" in running or "ollama:tiny:latest" in running
    assert running.get("ollama:tiny:latest", running.get("tiny")).context_length == 64
    r = client.generate("tiny", keep_alive=0)  # and unload it
    assert r.done_reason == "unload"
    assert wait_until(lambda: "ollama:tiny:latest" in loads.closed)
    assert "ollama:tiny:latest" not in {m.model for m in client.ps().models}
    shown = client.show("org/b")
    assert shown.modelinfo["llama.context_length"] == 64 and "thinking" in shown.capabilities
    assert shown.modelfile.startswith("FROM org/b")
    assert httpx.get(s.url + "/api/version").json()["version"].count(".") == 2


def test_a_missing_api_key_is_refused_in_ollamas_shape() -> None:
    from app.server.config import ServerConfig

    with LiveServer(create_app(make_pool(OllamaLoads()), ServerConfig(api_key="k"))) as s:
        with pytest.raises(ollama.ResponseError) as e:
            ollama.Client(host=s.url).list()
        assert e.value.status_code == 401 and e.value.error.startswith("You didn't provide an API key")
        listed = ollama.Client(host=s.url, headers={"Authorization": "Bearer k"}).list().models
        assert [m.model for m in listed][:2] == ["org/a", "org/b"]
