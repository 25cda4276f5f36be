"""`roofline serve` as a process: startup line, API key, and SIGTERM draining a stream in flight, then exit."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]
KEY = "test-key-123"


@pytest.fixture(scope="module")
def served():
    env = {**os.environ, "ROOFLINE_API_KEY": KEY}
    proc = subprocess.Popen([sys.executable, "-m", "app.cli", "serve", "-m", "embedded", "--port", "0",
                             "--drain-timeout", "60",
                             "--allow-origin", "https://my.app/", "--allow-host", "my.box"], cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        lines = []  # a warning may come first (backend="auto" on a fresh clone: how to get torch)
        while not lines or "roofline: warning:" in lines[-1]:
            lines.append(proc.stderr.readline())
        m = re.search(r"serving (\S+) \(also 'default', (MLX|torch) on \w+\) on (http://127\.0\.0\.1:\d+)/v1",
                      lines[-1])
        assert m, lines
        url = m.group(3)
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline and proc.poll() is None, "the server did not come up"
            time.sleep(0.1)
        yield proc, url, m.group(1)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)


def test_api_key_from_the_environment(served) -> None:
    _, url, model_id = served
    assert httpx.get(url + "/v1/models").status_code == 401
    r = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200 and r.json()["data"][0]["id"] == model_id
    # --allow-origin https://my.app/ lets that site's pages in (and read the reply); other sites stay out
    auth = {"Authorization": f"Bearer {KEY}"}
    r = httpx.get(url + "/v1/models", headers={**auth, "Origin": "https://my.app"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://my.app"
    assert httpx.get(url + "/v1/models", headers={**auth, "Origin": "https://other.app"}).status_code == 403
    # --allow-host my.box: that name is served; another name is refused, the key notwithstanding (DNS rebinding)
    assert httpx.get(url + "/v1/models", headers={**auth, "Host": "my.box:80"}).status_code == 200
    assert httpx.get(url + "/v1/models", headers={**auth, "Host": "other.box"}).status_code == 403


def test_sigterm_drains_the_stream_in_flight_then_exits(served) -> None:
    proc, url, _ = served
    body = {"model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    events = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[6:])
            if len(events) == 2:  # the role chunk and one token: the generation is running
                proc.send_signal(signal.SIGTERM)
    assert events[-1] == "[DONE]"
    usage = json.loads(events[-2])["usage"]
    assert usage["completion_tokens"] == 8
    # uvicorn re-raises the signal once drained, so the exit status says "terminated by SIGTERM", as supervisors expect
    assert proc.wait(timeout=30) == -signal.SIGTERM
    with pytest.raises(httpx.TransportError):
        httpx.get(url + "/health", timeout=2)


def test_serve_on_a_missing_cuda_device_is_one_clear_line() -> None:
    from tests.support.cli import assert_one_line_error, roofline
    from tests.support.torch_support import require

    torch = require("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    r = roofline("serve", "-m", "embedded", "--backend", "torch", "--device", "cuda", "--port", "0")
    assert_one_line_error(r, "device='cuda'", "sees no CUDA device")


@pytest.mark.parametrize("origin", ["https://my.app/chat", "my.app", "https://", "http://a b"])
def test_a_malformed_allow_origin_is_one_clear_line(origin: str) -> None:
    from tests.support.cli import assert_one_line_error, roofline

    r = roofline("serve", "--allow-origin", "https://fine.example", "--allow-origin", origin, "--port", "0")
    assert_one_line_error(r, f"--allow-origin {origin!r}", "scheme://host[:port], no path")


@pytest.mark.parametrize("host", ["http://my.box", "my.box:8080", "my box", "my.box/x"])
def test_a_malformed_allow_host_is_one_clear_line(host: str) -> None:
    from tests.support.cli import assert_one_line_error, roofline

    r = roofline("serve", "--allow-host", "fine.lan", "--allow-host", host, "--port", "0")
    assert_one_line_error(r, f"--allow-host {host!r}", "expected a host name")
