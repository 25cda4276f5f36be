"""What the server answers before and around the routes: the Host header (DNS rebinding), malformed HTTP and refused
CORS preflights in OpenAI's error shape, and the drain on shutdown (503s while it listens on, then an error chunk and
`[DONE]` for what the drain timeout cuts). A live server over the scripted engine."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from app.server import ServerConfig, create_app
from tests.support.server_fakes import REPLY, FakeEngine, LiveServer, raw_request, wait_until

LONG = {"model": "default", "prompt": "[long][slow]", "max_tokens": 44, "stream": True}  # 44 tokens, 20 ms each


@pytest.fixture(scope="module")
def url():
    with LiveServer(create_app(FakeEngine(), ServerConfig(allow_hosts=("my.box",)))) as s:
        yield s.url


def openai_error(r: httpx.Response, status: int, code: str) -> dict:
    assert r.status_code == status and r.headers["content-type"].startswith("application/json"), r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code, error
    return error


# ---- Host (DNS rebinding) -----------------------------------------------------------------------------------


@pytest.mark.parametrize("host", ["127.0.0.1:8080", "localhost", "LOCALHOST:1", "app.localhost", "[::1]:8080",
                                  "10.1.2.3", "my.box", "my.box.:443", socket.gethostname()])
def test_the_names_this_server_is_known_by_pass(url: str, host: str) -> None:
    assert httpx.get(url + "/v1/models", headers={"Host": host}).status_code == 200


@pytest.mark.parametrize("path", ["/v1/models", "/metrics", "/tokenizer_info", "/health"])
def test_a_page_that_rebinds_its_dns_name_to_this_machine_is_refused(url: str, path: str) -> None:
    """The page's own name comes as Host: it gets 403, so it can read nothing (the models, the metrics, the
    tokenizer) from a server without a key."""
    error = openai_error(httpx.get(url + path, headers={"Host": "rebind.evil.example:8080"}), 403, "host_not_allowed")
    assert "'rebind.evil.example'" in error["message"] and "--allow-host rebind.evil.example" in error["message"]


def test_allow_host_star_serves_any_name() -> None:
    with LiveServer(create_app(FakeEngine(), ServerConfig(allow_hosts=("*",)))) as s:
        assert httpx.get(s.url + "/v1/models", headers={"Host": "anything.example"}).status_code == 200


def test_a_server_bound_to_a_name_answers_to_it() -> None:
    with LiveServer(create_app(FakeEngine(), ServerConfig(host="roofline.lan"))) as s:
        assert httpx.get(s.url + "/v1/models", headers={"Host": "roofline.lan:8080"}).status_code == 200
        assert httpx.get(s.url + "/v1/models", headers={"Host": "other.lan"}).status_code == 403


# ---- malformed HTTP and refused preflights in OpenAI's shape ------------------------------------------------


@pytest.mark.parametrize("head, status, code, words", [
    (b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 2**20 + b"\r\n\r\n", 431, "headers_too_large",
     "over 16,384 bytes"),
    (b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Bad: a\x00b\r\n\r\n", 400, "invalid_http_request",
     "malformed HTTP request"),
    (b"NOT HTTP\r\n\r\n", 400, "invalid_http_request", "malformed HTTP request"),
])
def test_malformed_http_is_answered_in_openai_shape(url: str, head: bytes, status: int, code: str, words: str) -> None:
    got, headers, body = raw_request(url, head)
    assert got == status and headers["content-type"] == "application/json", (got, headers, body[:200])
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code and words in error["message"]
    assert httpx.get(url + "/health").status_code == 200  # and the server goes on


def test_a_refused_preflight_is_in_openai_shape(url: str) -> None:
    """A page of this machine asking for a header the API does not take: Starlette's text/plain 400 becomes JSON."""
    pre = httpx.options(url + "/v1/chat/completions", headers={
        "Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "x-not-allowed"})
    error = openai_error(pre, 400, "cors_preflight_refused")
    assert "Disallowed CORS headers" in error["message"]
    pre = httpx.options(url + "/v1/chat/completions", headers={"Origin": "https://evil.example",
                                                               "Access-Control-Request-Method": "POST"})
    openai_error(pre, 403, "origin_not_allowed")


# ---- the drain ------------------------------------------------------------------------------------------------


def stream_in_thread(url: str, body: dict, started: threading.Event) -> list:
    """Reads a completion stream on a thread; its `data:` payloads land in the returned list."""
    out: list = []

    def run() -> None:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    out.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
                    started.set()
    t = threading.Thread(target=run, daemon=True)
    t.start()
    out.append(t)  # type: ignore[arg-type]
    return out


def test_while_draining_new_requests_get_503_and_running_ones_finish() -> None:
    """SIGTERM (should_exit): the socket stays open; a new request gets 503 in OpenAI's shape with Retry-After,
    /health says "draining", /metrics still answers; the stream already running ends whole. Then the server exits."""
    app = create_app(FakeEngine())
    live = LiveServer(app, drain_s=20)
    with live:
        started = threading.Event()
        got = stream_in_thread(live.url, LONG, started)
        assert started.wait(10)
        live.server.should_exit = True
        assert wait_until(lambda: app.state.server.drain.draining)
        r = httpx.post(live.url + "/v1/chat/completions", json={"model": "default", "messages": [
            {"role": "user", "content": "hi"}]}, timeout=10)
        openai_error(r, 503, "server_shutting_down")
        assert 1 <= int(r.headers["retry-after"]) <= 20 and r.headers["connection"] == "close"
        health = httpx.get(live.url + "/health", timeout=10)
        assert health.status_code == 503 and health.json() == {"status": "draining"} and health.headers["retry-after"]
        assert httpx.get(live.url + "/metrics", timeout=10).status_code == 200
        thread = got.pop(0)
        thread.join(30)
        assert got[-1] == "[DONE]" and "".join(c["choices"][0]["text"] for c in got[:-1]) == (REPLY * 4)[:44]
        live.thread.join(30)
        assert not live.thread.is_alive()
    with pytest.raises(httpx.TransportError):
        httpx.get(live.url + "/health", timeout=2)


def test_when_the_drain_timeout_runs_out_streams_end_with_an_error_chunk_and_done() -> None:
    """A stream still running at the deadline gets an error chunk naming the drain timeout, then `[DONE]`, never a
    cut mid-chunk; a request still waiting for a slot gets 503."""
    app = create_app(FakeEngine(), ServerConfig(max_concurrency=1, max_queue=4))
    live = LiveServer(app, drain_s=0.3)
    with live:
        started = threading.Event()
        got = stream_in_thread(live.url, LONG, started)
        assert started.wait(10)
        waiting: list[httpx.Response] = []
        waiter = threading.Thread(target=lambda: waiting.append(httpx.post(live.url + "/v1/completions", json={
            "model": "default", "prompt": "x", "max_tokens": 3}, timeout=30)), daemon=True)
        waiter.start()
        assert wait_until(lambda: app.state.server.gate.waiting == 1)
        t0 = time.monotonic()
        live.server.should_exit = True
        thread = got.pop(0)
        thread.join(30)
        waiter.join(30)
        assert time.monotonic() - t0 < 5
        assert got[-1] == "[DONE]"
        error = got[-2]["error"]
        assert error["code"] == "cancelled" and "drain timeout of 0.3 s ran out" in error["message"]
        assert 0 < len("".join(c["choices"][0]["text"] for c in got[:-2])) < 44
        openai_error(waiting[0], 503, "server_shutting_down")
        live.thread.join(30)
        assert not live.thread.is_alive()
