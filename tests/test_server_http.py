"""HTTP hygiene at the listener (`app/server/listener.py`) and the body reader (`app/server/app.py` read_body): the
head's size limit however it arrives, Content-Length beside Transfer-Encoding refused, time limits for the head and
the body (slowloris), a client hanging up mid-body logged in one line, an empty prompt refused naming the field."""

from __future__ import annotations

import json
import logging
import socket
import time

import httpx
import pytest

from app.server.app import ServerConfig, create_app
from tests.support.server_fakes import FakeEngine, FakeTokenizer, LiveServer, raw_request

LIMIT_S = 0.6  # the head's and the body's time limits here


@pytest.fixture(scope="module")
def url():
    with LiveServer(create_app(FakeEngine(), ServerConfig(body_timeout_s=LIMIT_S)), head_timeout_s=LIMIT_S) as s:
        yield s.url


def address(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


def error_of(body: bytes) -> dict:
    return json.loads(body)["error"]


def test_a_large_head_in_one_write_is_refused_with_431(url: str) -> None:
    """h11 checks its size limit only while a head is incomplete; 64 KB in one write used to pass."""
    head = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n" + b"".join(
        b"X-H%d: %s\r\n" % (i, b"a" * 1000) for i in range(64)) + b"\r\n"
    status, headers, body = raw_request(url, head)
    assert status == 431 and error_of(body)["code"] == "headers_too_large"
    small = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-A: " + b"a" * 15_000 + b"\r\n\r\n"
    assert raw_request(url, small)[0] == 200  # under the limit, in one write too


def test_content_length_beside_transfer_encoding_is_refused(url: str) -> None:
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n")
    status, _, body = raw_request(url, head)
    assert status == 400 and "both Content-Length and Transfer-Encoding" in error_of(body)["message"]


def test_a_head_that_trickles_in_gets_408_at_the_limit(url: str) -> None:
    t0 = time.monotonic()
    with socket.create_connection(address(url), timeout=10) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # and never the blank line
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    elapsed = time.monotonic() - t0
    assert data.startswith(b"HTTP/1.1 408 ") and error_of(data.partition(b"\r\n\r\n")[2])["code"] == "request_timeout"
    assert LIMIT_S * 0.9 <= elapsed < LIMIT_S + 2


def test_a_connection_that_says_nothing_is_closed_at_the_limit(url: str) -> None:
    t0 = time.monotonic()
    with socket.create_connection(address(url), timeout=10) as sock:
        assert sock.recv(65536) == b""  # closed without a word: nothing was asked
    assert LIMIT_S * 0.9 <= time.monotonic() - t0 < LIMIT_S + 2


def read_response(sock: socket.socket) -> bytes:
    """One response on a kept-alive connection: its head and Content-Length bytes of body."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
    while len(body) < length:
        body += sock.recv(65536)
    return head + b"\r\n\r\n" + body


def test_a_kept_alive_connection_serves_two_requests_and_the_limit_restarts(url: str) -> None:
    request = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    with socket.create_connection(address(url), timeout=10) as sock:
        for _ in range(2):
            time.sleep(LIMIT_S * 0.6)  # each within the limit, both together past it
            sock.sendall(request)
            assert read_response(sock).startswith(b"HTTP/1.1 200 ")


def test_a_body_that_trickles_in_gets_408_at_the_limit(url: str) -> None:
    t0 = time.monotonic()
    with socket.create_connection(address(url), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"model\": ")  # 90 bytes short, forever
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    elapsed = time.monotonic() - t0
    assert data.startswith(b"HTTP/1.1 408 "), data[:200]
    assert error_of(data.partition(b"\r\n\r\n")[2])["code"] == "request_timeout"
    assert LIMIT_S * 0.9 <= elapsed < LIMIT_S + 2
    assert httpx.get(url + "/health").status_code == 200


def test_a_client_hanging_up_mid_body_is_one_info_line(url: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="uvicorn.error"):
        with socket.create_connection(address(url), timeout=10) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n{\"model\": ")
            time.sleep(0.1)
        deadline = time.monotonic() + 5
        while "closed the connection before" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.02)
    lines = [r for r in caplog.records if "closed the connection before" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO and lines[0].exc_info is None
    assert "POST /v1/completions body" in lines[0].getMessage()
    assert "Exception in ASGI application" not in caplog.text and "Traceback" not in caplog.text


class NoBOSTokenizer(FakeTokenizer):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return super().encode(text, add_special_tokens=False)


@pytest.mark.parametrize("prompt, param", [("", "prompt"), (["a", ""], "prompt[1]")])
def test_an_empty_prompt_is_refused_naming_it(prompt, param) -> None:
    engine = FakeEngine()
    engine.tokenizer = NoBOSTokenizer()
    with LiveServer(create_app(engine)) as s:
        r = httpx.post(s.url + "/v1/completions", json={"model": "default", "prompt": prompt})
    assert r.status_code == 400 and r.json()["error"]["param"] == param
    assert f"'{param}' is empty" in r.json()["error"]["message"]
