"""Speculative decoding through the server: the `speculative` / `num_draft_tokens` request fields, the
`--speculative` default, and accepted draft tokens in the usage (over a scripted engine: no model)."""

from __future__ import annotations

import json

import httpx
import pytest
from mlx_engine.api import NO_DRAFT_MODEL, Usage

from app.server import ServerConfig, create_app
from app.server.errors import from_request_error
from app.server.protocol import parse_job
from app.server.responses import usage_dict
from tests.support.server_fakes import REPLY, FakeEngine, LiveServer

CHAT = {"model": "default", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "default", "prompt": "hi"}
PATHS = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}


def job(body: dict, endpoint: str = "chat"):
    base = CHAT if endpoint == "chat" else COMPLETION
    return parse_job({**base, **body}, endpoint, {"default"}, "fake", context_length=64,  # type: ignore[arg-type]
                     vocab_size=1000)


@pytest.mark.parametrize("endpoint", ["chat", "completion"])
def test_speculative_fields_become_sampling_params(endpoint: str) -> None:
    for mode in ("auto", "prompt-lookup", "self", "draft"):
        assert job({"speculative": mode, "num_draft_tokens": 6}, endpoint).sampling["speculative"] == mode
    assert job({"speculative": "off"}, endpoint).sampling["speculative"] is None  # off: plain, whatever the default
    s = job({"speculative": None, "num_draft_tokens": 16}, endpoint).sampling  # null: absent
    assert "speculative" not in s and s["num_draft_tokens"] == 16
    assert "num_draft_tokens" not in job({}, endpoint).sampling


@pytest.mark.parametrize("endpoint", ["chat", "completion"])
@pytest.mark.parametrize("body,param,message", [
    ({"speculative": "medusa"}, "speculative",
     "'speculative' must be one of 'draft', 'prompt-lookup', 'self', 'auto', 'off', got \"medusa\""),
    ({"speculative": True}, "speculative", "'speculative' must be a string, got a boolean: true"),
    ({"num_draft_tokens": 0}, "num_draft_tokens", "'num_draft_tokens' must be an integer in [1, 16], got 0"),
    ({"num_draft_tokens": 17}, "num_draft_tokens", "'num_draft_tokens' must be an integer in [1, 16], got 17"),
    ({"num_draft_tokens": 2.5}, "num_draft_tokens", "'num_draft_tokens' must be an integer, got a number: 2.5"),
])
def test_bad_speculative_fields_are_openai_errors_naming_them(endpoint: str, body: dict, param: str,
                                                              message: str) -> None:
    engine = FakeEngine()
    with LiveServer(create_app(engine)) as s:
        r = httpx.post(s.url + PATHS[endpoint], json={**(CHAT if endpoint == "chat" else COMPLETION), **body},
                       timeout=10)
    assert r.status_code == 400
    assert r.json() == {"error": {"message": message, "type": "invalid_request_error", "param": param,
                                  "code": "unsupported_value" if body.get("speculative") == "medusa" else None}}
    assert engine.requests == []


def test_usage_reports_accepted_drafts_only_when_given() -> None:
    u = Usage(7, 11, 3)
    assert usage_dict(u) == {"prompt_tokens": 7, "completion_tokens": 11, "total_tokens": 18,
                             "prompt_tokens_details": {"cached_tokens": 3}}
    assert usage_dict(u, 5)["completion_tokens_details"] == {"accepted_prediction_tokens": 5}


def test_engine_refusing_a_mode_names_the_field() -> None:
    e = from_request_error(NO_DRAFT_MODEL)
    assert (e.status, e.param) == (400, "speculative")


@pytest.fixture(scope="module")
def servers():
    """A server with the default (plain) and one whose --speculative default is prompt-lookup."""
    plain, spec = FakeEngine(), FakeEngine()
    with LiveServer(create_app(plain)) as a, \
            LiveServer(create_app(spec, ServerConfig(speculative="prompt-lookup"))) as b:
        yield (a.url, plain), (b.url, spec)


def sse(r: httpx.Response) -> list:
    return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


@pytest.mark.parametrize("endpoint", ["chat", "completion"])
def test_accepted_drafts_in_the_usage_of_whole_and_streamed_replies(servers, endpoint: str) -> None:
    (url, engine), _ = servers
    base = CHAT if endpoint == "chat" else COMPLETION
    r = httpx.post(url + PATHS[endpoint], json={**base, "speculative": "self", "num_draft_tokens": 3}, timeout=10)
    assert r.status_code == 200, r.text
    p = engine.requests[-1].sampling
    assert (p.speculative, p.num_draft_tokens) == ("self", 3)
    usage = r.json()["usage"]
    assert usage["completion_tokens"] == len(REPLY) == 11
    assert usage["completion_tokens_details"] == {"accepted_prediction_tokens": 5}  # tokens 1, 3, 5, 7, 9

    body = {**base, "speculative": "prompt-lookup", "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url + PATHS[endpoint], json=body, timeout=10) as r:
        chunks = sse(r)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens_details"] == {
        "accepted_prediction_tokens": 5}


def test_no_details_when_nothing_was_drafted(servers) -> None:
    (url, engine), _ = servers
    for extra in ({}, {"speculative": "auto"}, {"speculative": "off"}):  # the fake's "auto" steps aside
        r = httpx.post(url + PATHS["chat"], json={**CHAT, **extra}, timeout=10)
        assert r.status_code == 200 and "completion_tokens_details" not in r.json()["usage"]
    assert [q.sampling.speculative for q in engine.requests[-3:]] == [None, "auto", None]


def test_server_default_applies_unless_the_request_says_otherwise(servers) -> None:
    _, (url, engine) = servers
    r = httpx.post(url + PATHS["chat"], json=CHAT, timeout=10)
    assert r.json()["usage"]["completion_tokens_details"] == {"accepted_prediction_tokens": 5}
    assert engine.requests[-1].sampling.speculative == "prompt-lookup"
    r = httpx.post(url + PATHS["chat"], json={**CHAT, "speculative": "off"}, timeout=10)
    assert "completion_tokens_details" not in r.json()["usage"]
    assert engine.requests[-1].sampling.speculative is None


def test_a_mode_the_engine_refuses_is_a_400_naming_speculative(servers) -> None:
    (url, engine), _ = servers
    n = len(engine.requests)
    r = httpx.post(url + PATHS["chat"], json={**CHAT, "speculative": "draft"}, timeout=10)
    assert r.status_code == 400
    assert r.json()["error"] == {
        "message": NO_DRAFT_MODEL,
        "type": "invalid_request_error", "param": "speculative", "code": None}
    assert len(engine.requests) == n
    assert httpx.post(url + PATHS["chat"], json=CHAT, timeout=10).status_code == 200  # the slot was given back


def test_serve_flag_passes_the_default(monkeypatch) -> None:
    import app.server as server_pkg
    from app.cli import main

    seen: dict = {}
    monkeypatch.setattr(server_pkg, "serve", lambda factory, **kw: seen.update(kw) or 0)
    assert main(["serve", "--speculative", "auto"]) == 0 and seen["speculative"] == "auto"
    assert main(["serve"]) == 0 and seen["speculative"] is None
    with pytest.raises(SystemExit):
        main(["serve", "--speculative", "medusa"])
