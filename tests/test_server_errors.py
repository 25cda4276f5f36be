"""Bad input, auth, admission and engine faults against a live server over a scripted engine (no model)."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from app.server import ServerConfig, create_app
from tests.support.server_fakes import CONTEXT, REPLY, FakeEngine, LiveServer, wait_until

GOOD = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
KEY = "sekret-key"


@pytest.fixture(scope="module")
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture(scope="module")
def url(engine: FakeEngine):
    with LiveServer(create_app(engine, ServerConfig(max_concurrency=64, max_queue=64))) as s:
        yield s.url


@pytest.fixture(scope="module")
def guarded():
    """A second server: an API key, one request at a time, one waiting."""
    engine = FakeEngine()
    with LiveServer(create_app(engine, ServerConfig(api_key=KEY, max_concurrency=1, max_queue=1))) as s:
        yield s.url, engine


def post(url: str, path: str, body: dict | bytes, **kw) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"content-type": "application/json", **kw.pop("headers", {})}
    return httpx.post(url + path, content=content, headers=headers, timeout=10, **kw)


def assert_still_serving(url: str) -> None:
    r = post(url, "/v1/chat/completions", GOOD)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == REPLY[:5]


def sse_events(r: httpx.Response) -> list:
    out = []
    for line in r.iter_lines():
        if line.startswith("data: "):
            data = line[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


BAD = [
    ("/v1/chat/completions", b'{"model": "default", "messages": [', 400, None, "not valid JSON"),
    ("/v1/chat/completions", b'{"model": "default", "messages": "\xff\xfe"}', 400, None, "not valid UTF-8"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}, 400, "model", "provide a model"),
    ("/v1/chat/completions", {**GOOD, "messages": 3}, 400, "messages", "must be an array"),
    ("/v1/chat/completions", {**GOOD, "model": "gpt-4"}, 404, "model", "'gpt-4' does not exist"),
    ("/v1/chat/completions", {**GOOD, "messages": []}, 400, "messages", "non-empty"),
    ("/v1/chat/completions", {**GOOD, "n": 65}, 400, "n", "in [1, 64]"),
    ("/v1/chat/completions", {**GOOD, "temperature": 9}, 400, "temperature", "[0, 2]"),
    ("/v1/chat/completions", {**GOOD, "max_tokens": 1000}, 400, "max_tokens", "context is 64"),
    # 17 tokens of template + 40 of text + 20 to generate > 64
    ("/v1/chat/completions", {**GOOD, "messages": [{"role": "user", "content": "x" * 40}], "max_tokens": 20}, 400,
     "max_tokens", "57 in the messages, 20 in 'max_tokens'); at most 7 can be generated"),
    ("/v1/chat/completions", {**GOOD, "messages": [{"role": "user", "content": "x" * 70}]}, 400, "messages",
     "context length is 64 tokens, but the messages are 87 tokens"),
    ("/v1/completions", {"model": "default", "prompt": "y" * CONTEXT}, 400, "prompt", "maximum context length"),
    ("/v1/chat/completions", {**GOOD, "messages": [{"role": "user", "content": "[template-error]"}]}, 400, None,
     "chat template error"),
    ("/v1/chat/completions", {**GOOD, "response_format": {"type": "grammar"}}, 400, "response_format.type",
     "not supported"),
    ("/v1/completions", {"model": "default", "prompt": ["a", "y" * CONTEXT]}, 400, "prompt[1]",
     "the prompt[1] is 65 tokens"),
    ("/v1/completions", {"model": "default", "prompt": ["a"] * 65}, 400, "prompt", "at most 64 per request"),
]


@pytest.mark.parametrize("path,body,status,param,words", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_request_is_a_clear_4xx_and_the_server_goes_on(url: str, path, body, status, param, words) -> None:
    r = post(url, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param and words in err["message"], err
    assert_still_serving(url)


def test_oversized_body_is_413(url: str) -> None:
    big = json.dumps({**GOOD, "messages": [{"role": "user", "content": "x" * (5 * 2**20)}]}).encode()
    r = post(url, "/v1/chat/completions", big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert "limit is 4,194,304 bytes" in r.json()["error"]["message"]

    def chunks():  # no Content-Length: the limit holds on the bytes read
        for _ in range(5):
            yield b" " * 2**20
    r = httpx.post(url + "/v1/chat/completions", content=chunks(), timeout=10)
    assert r.status_code == 413
    assert_still_serving(url)


def test_unknown_route_and_method_in_openai_shape(url: str) -> None:
    r = httpx.get(url + "/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["message"] == "Unknown request URL: GET /v1/nothing"
    r = httpx.get(url + "/v1/chat/completions")
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.get(url + "/v1/models/other")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert httpx.get(url + "/v1/models/default").json()["id"] == "fake-1b-q4-test"


def test_nothing_leaks_between_requests(url: str, engine: FakeEngine) -> None:
    r = post(url, "/v1/chat/completions", {**GOOD, "stop": ["wor"], "seed": 3, "logit_bias": {"5": 1},
                                            "temperature": 0.2, "logprobs": True, "top_logprobs": 2})
    assert r.json()["choices"][0]["logprobs"] is not None
    first = engine.requests[-1].sampling
    assert (first.stop, first.seed, first.logit_bias, first.logprobs) == (("wor",), 3, {5: 1.0}, 2)
    r = post(url, "/v1/chat/completions", GOOD)
    assert r.json()["choices"][0]["logprobs"] is None
    s = engine.requests[-1].sampling
    assert (s.stop, s.seed, s.logit_bias, s.logprobs, s.temperature, s.max_tokens) == ((), None, {}, None, 1.0, 5)


def test_without_max_tokens_the_rest_of_the_context_is_allowed(url: str, engine: FakeEngine) -> None:
    r = post(url, "/v1/completions", {"model": "default", "prompt": "abc"})
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    assert engine.requests[-1].sampling.max_tokens == CONTEXT - 4  # BOS + 3


def test_concurrent_requests_each_get_their_own_reply(url: str) -> None:
    results: dict[int, httpx.Response] = {}

    def one(i: int) -> None:
        results[i] = post(url, "/v1/completions", {"model": "default", "prompt": f"[slow] {i}", "max_tokens": 3 + i})

    threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, r in results.items():
        assert r.json()["choices"][0]["text"] == REPLY[:3 + i]
    assert len({r.json()["id"] for r in results.values()}) == 6


def test_engine_raising_mid_stream_fails_only_that_request(url: str, engine: FakeEngine) -> None:
    ok = {}
    t = threading.Thread(target=lambda: ok.update(r=post(url, "/v1/completions", {
        "model": "default", "prompt": "[slow]", "max_tokens": 11})))
    t.start()
    with httpx.stream("POST", url + "/v1/chat/completions", json={
            **GOOD, "messages": [{"role": "user", "content": "[raise]"}], "stream": True}, timeout=10) as r:
        events = sse_events(r)
    assert r.status_code == 200
    assert [e["choices"][0]["delta"].get("content") for e in events[1:3]] == ["H", "e"]
    assert events[-2]["error"]["message"] == "the generation failed: RuntimeError: the fake engine broke down"
    assert events[-1] == "[DONE]"
    r = post(url, "/v1/chat/completions", {**GOOD, "messages": [{"role": "user", "content": "[error]"}]})
    assert r.status_code == 500
    assert r.json()["error"] == {"message": "the generation failed: the fake engine failed this request",
                                 "type": "server_error", "param": None, "code": "generation_failed"}
    t.join()
    assert ok["r"].status_code == 200 and ok["r"].json()["choices"][0]["text"] == REPLY
    assert wait_until(lambda: engine.active == 0)
    assert_still_serving(url)


def test_a_responses_stream_that_fails_ends_failed_and_one_dropped_cancels(url: str, engine: FakeEngine) -> None:
    with httpx.stream("POST", url + "/v1/responses", json={"model": "default", "input": "[raise]", "stream": True},
                      timeout=10) as r:
        lines = [line for line in r.iter_lines() if line]
    kinds = [line[7:] for line in lines if line.startswith("event: ")]
    data = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    assert r.status_code == 200 and [d["type"] for d in data] == kinds
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert [d["delta"] for d in data if d["type"] == "response.output_text.delta"] == ["H", "e"]
    assert kinds[-2:] == ["error", "response.failed"]
    assert data[-1]["response"]["error"] == {
        "code": "generation_failed", "message": "the generation failed: RuntimeError: the fake engine broke down"}
    before = len(engine.streams)
    with httpx.stream("POST", url + "/v1/responses", json={"model": "default", "input": "[slow][long]",
                                                           "stream": True}, timeout=10) as r:
        assert r.status_code == 200
        next(r.iter_lines())  # then the client goes away mid-stream
    assert wait_until(lambda: engine.active == 0)
    assert engine.streams[before].cancelled.is_set()
    assert_still_serving(url)


@pytest.mark.parametrize("prompt", ["[slow][long]", ["[slow][long]", "[slow][long]x", "[long]"]],
                         ids=["one prompt", "three prompts"])
def test_streams_dropped_after_the_first_chunk_leave_nothing_running(url: str, engine: FakeEngine, prompt) -> None:
    body = {"model": "default", "prompt": prompt, "stream": True}
    before = len(engine.streams)
    with httpx.Client(timeout=10) as client:
        for _ in range(100):
            with client.stream("POST", url + "/v1/completions", json=body) as r:
                assert r.status_code == 200
                next(r.iter_lines())
            # leaving the block closes the connection mid-stream
    assert wait_until(lambda: engine.active == 0), engine.active
    new = engine.streams[before:]
    slow = [s for s in new if s.delay]  # 20 ms a token: still running when the client left
    assert all(s.done for s in new) and all(s.cancelled.is_set() for s in slow)
    assert len(slow) == 100 * sum("[slow]" in p for p in (prompt if isinstance(prompt, list) else [prompt]))
    metrics = httpx.get(url + "/metrics").text
    assert "roofline_requests_in_flight 0" in metrics
    assert 'roofline_generations_total{finish_reason="cancelled"}' in metrics
    assert_still_serving(url)


def test_non_streaming_client_that_gives_up_cancels_its_generation(url: str, engine: FakeEngine) -> None:
    for _ in range(3):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/completions", json={"model": "default", "prompt": "[slow][long]"}, timeout=0.15)
    assert wait_until(lambda: engine.active == 0)
    assert_still_serving(url)


def test_chat_stream_shape_with_usage(url: str) -> None:
    with httpx.stream("POST", url + "/v1/chat/completions", json={
            **GOOD, "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[1:-2] if e["choices"]) == REPLY[:5]
    assert events[-3]["choices"][0]["finish_reason"] == "length"
    assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 5
    assert all(e["usage"] is None for e in events[:-2]) and events[-1] == "[DONE]"
    assert len({e["id"] for e in events[:-1]}) == 1 and events[0]["id"].startswith("chatcmpl-")


def test_metrics_count_requests_by_route_and_status(url: str) -> None:
    post(url, "/v1/chat/completions", {**GOOD, "n": 0})
    text = httpx.get(url + "/metrics").text
    assert 'roofline_requests_total{endpoint="/v1/chat/completions",status="400"}' in text
    assert 'roofline_requests_total{endpoint="/v1/chat/completions",status="200"}' in text
    assert "roofline_kv_blocks_used 0" in text and "roofline_kv_blocks_total 100" in text
    assert "roofline_time_to_first_token_seconds_count" in text
    assert "roofline_spec_decode_acceptance_rate 0" in text


# ---- API key and admission ----------------------------------------------------------------------------


def test_api_key_guards_every_route_but_health(guarded) -> None:
    url, _ = guarded
    assert httpx.get(url + "/health").status_code == 200
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        for method, path in (("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/v1/chat/completions")):
            r = httpx.request(method, url + path, headers=headers, json=GOOD)
            assert r.status_code == 401, (path, headers)
            assert r.json()["error"]["code"] == "invalid_api_key"
    r = post(url, "/v1/chat/completions", GOOD, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200
    text = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    assert 'roofline_requests_total{endpoint="/v1/models",status="401"} 3' in text


def test_beyond_concurrency_and_queue_a_request_gets_429(guarded) -> None:
    url, engine = guarded
    auth = {"Authorization": f"Bearer {KEY}"}
    slow = {"model": "default", "prompt": "[slow][long]", "max_tokens": 30}
    results = []

    def one() -> None:
        results.append(post(url, "/v1/completions", slow, headers=auth))

    threads = [threading.Thread(target=one) for _ in range(2)]
    for t in threads:
        t.start()
    assert wait_until(lambda: engine.active == 1)  # one running; the other waits for its slot
    m = httpx.get(url + "/metrics", headers=auth).text
    assert wait_until(lambda: 'roofline_queue_depth{stage="admission"} 1' in httpx.get(url + "/metrics",
                                                                                        headers=auth).text), m
    r = post(url, "/v1/completions", slow, headers=auth)
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "rate_limit_exceeded"
    for t in threads:
        t.join()
    assert [x.status_code for x in results] == [200, 200]
    assert post(url, "/v1/completions", {**slow, "prompt": "x"}, headers=auth).status_code == 200


def test_a_waiting_client_that_leaves_frees_its_place(guarded) -> None:
    url, engine = guarded
    auth = {"Authorization": f"Bearer {KEY}"}
    busy = threading.Thread(target=lambda: post(url, "/v1/completions", {
        "model": "default", "prompt": "[slow][long]", "max_tokens": 30}, headers=auth))
    busy.start()
    assert wait_until(lambda: engine.active == 1)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json={"model": "default", "prompt": "q"}, headers=auth, timeout=0.2)
    assert wait_until(lambda: 'roofline_queue_depth{stage="admission"} 0' in httpx.get(url + "/metrics",
                                                                                       headers=auth).text)
    busy.join()
    assert wait_until(lambda: engine.active == 0)
    assert len([r for r in engine.requests if r.prompt_token_ids and r.prompt_token_ids[-1] == ord("q")]) == 0


def test_requests_from_other_sites_web_pages_are_refused(url: str) -> None:
    r = post(url, "/v1/chat/completions", GOOD, headers={"Origin": "https://evil.example"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed"
    assert post(url, "/v1/chat/completions", GOOD, headers={"Origin": "null"}).status_code == 403
    r = post(url, "/v1/chat/completions", GOOD, headers={"Origin": "http://localhost:3000"})
    assert r.status_code == 200


def test_several_prompts_get_a_choice_each_in_order(url: str, engine: FakeEngine) -> None:
    """/v1/completions with an array of prompts (strings and token ids): one choice per prompt, `index` in prompt
    order, usage added up; streamed, each choice's chunks carry its index, one finish each, one usage, one [DONE]."""
    prompts = ["[slow]a", "b", [5, 6]]
    body = {"model": "default", "prompt": prompts, "max_tokens": 8}
    r = post(url, "/v1/completions", body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert [(c["index"], c["text"], c["finish_reason"]) for c in out["choices"]] == [
        (0, REPLY[:8], "length"), (1, REPLY[:8], "length"), (2, REPLY[:8], "length")]
    assert out["usage"]["prompt_tokens"] == 8 + 2 + 2 and out["usage"]["completion_tokens"] == 24
    assert [r.prompt_token_ids for r in engine.requests[-3:]] == [[2, *map(ord, "[slow]a")], [2, ord("b")], [5, 6]]
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True,
                                                              "stream_options": {"include_usage": True}}) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = [e for e in events[:-1] if e["choices"]]
    texts = {i: "".join(c["choices"][0]["text"] for c in chunks if c["choices"][0]["index"] == i) for i in range(3)}
    assert texts == {0: REPLY[:8], 1: REPLY[:8], 2: REPLY[:8]}
    finishes = [c["choices"][0]["index"] for c in chunks if c["choices"][0]["finish_reason"]]
    assert sorted(finishes) == [0, 1, 2] and finishes[-1] == 0  # the slow prompt finished last
    assert events[-2]["usage"]["completion_tokens"] == 24 and not events[-2]["choices"]
    assert wait_until(lambda: engine.active == 0)
    slow = {"model": "default", "prompt": ["[slow][long]a", "[slow][long]b", "[slow][long]c"], "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=slow) as r:
        lines = r.iter_lines()  # kept: a dropped iterator closes the stream
        next(lines)  # the engine runs all three now: three generations in flight, one request
        assert "roofline_requests_in_flight 3" in httpx.get(url + "/metrics").text
        assert [line for line in lines if line.startswith("data: ")][-1] == "data: [DONE]"
    assert wait_until(lambda: "roofline_requests_in_flight 0" in httpx.get(url + "/metrics").text)


def test_a_prompt_that_cannot_run_starts_none_of_the_request(url: str, engine: FakeEngine) -> None:
    before = len(engine.requests)
    r = post(url, "/v1/completions", {"model": "default", "prompt": ["a", "b", "y" * 70]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt[2]"
    assert len(engine.requests) == before
    assert_still_serving(url)


def test_one_failing_prompt_fails_the_request_and_stops_the_others(url: str, engine: FakeEngine) -> None:
    for stream in (False, True):
        r = post(url, "/v1/completions", {"model": "default", "prompt": ["[slow][long]", "[error]"],
                                          "max_tokens": 40, "stream": stream})
        slow = engine.streams[-2]
        if stream:
            events = [e for e in sse_events(r) if e != "[DONE]"]
            assert events[-1]["error"]["code"] == "generation_failed"
        else:
            assert r.status_code == 500 and "fake engine failed" in r.json()["error"]["message"]
        assert wait_until(lambda: slow.done) and slow.cancelled.is_set() and slow.i < 40
    assert wait_until(lambda: engine.active == 0)
    assert_still_serving(url)


def test_echo_returns_each_prompt_with_its_logprobs(url: str) -> None:
    """lm-evaluation-harness's loglikelihood request: token-id prompts, echo, logprobs 1, max_tokens 1. Each
    choice holds its prompt's tokens (the first without a log-probability) and then the reply's."""
    body = {"model": "default", "prompt": [[104, 105], [111, 107, 33]], "echo": True, "logprobs": 1,
            "max_tokens": 1, "temperature": 0}
    r = post(url, "/v1/completions", body)
    assert r.status_code == 200, r.text
    a, b = r.json()["choices"]
    assert (a["text"], b["text"]) == ("hi" + REPLY[0], "ok!" + REPLY[0])
    assert a["logprobs"]["tokens"] == ["h", "i", "H"]
    assert a["logprobs"]["token_logprobs"] == [None, -1.05, -0.25]
    assert a["logprobs"]["top_logprobs"] == [None, {"x": -0.5}, {"H": -0.25}]
    assert a["logprobs"]["text_offset"] == [0, 1, 2]
    assert b["logprobs"]["token_logprobs"] == [None, -1.07, -0.33, -0.25]
    # a string prompt echoes as sent; without logprobs, the text alone
    r = post(url, "/v1/completions", {"model": "default", "prompt": "say", "echo": True, "max_tokens": 2})
    assert r.json()["choices"][0]["text"] == "say" + REPLY[:2] and r.json()["choices"][0]["logprobs"] is None
    # max_tokens 0: the prompt and its log-probabilities only, streamed too
    body = {**body, "prompt": [[104, 105]], "max_tokens": 0}
    r = post(url, "/v1/completions", body)
    [c] = r.json()["choices"]
    assert (c["text"], c["finish_reason"], r.json()["usage"]["completion_tokens"]) == ("hi", "length", 0)
    assert c["logprobs"]["token_logprobs"] == [None, -1.05]
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=10) as r:
        events = sse_events(r)
    assert [e["choices"][0]["text"] for e in events[:-1]] == ["hi", ""] and events[-1] == "[DONE]"
    assert events[0]["choices"][0]["logprobs"]["token_logprobs"] == [None, -1.05]
    assert events[1]["choices"][0]["finish_reason"] == "length"


def test_n_replies_per_prompt_with_their_own_seeds(url: str, engine: FakeEngine) -> None:
    """`n`: n choices per prompt, index prompt * n + reply, reply j sampled with seed + j; usage counts each prompt
    once. Streamed chat opens every choice with its role chunk."""
    r = post(url, "/v1/completions", {"model": "default", "prompt": ["a", [5, 6, 7]], "n": 3, "seed": 10,
                                      "max_tokens": 4, "echo": True})
    assert r.status_code == 200, r.text
    out = r.json()
    assert [(c["index"], c["text"]) for c in out["choices"]] == [
        (0, "a" + REPLY[:4]), (1, "a" + REPLY[:4]), (2, "a" + REPLY[:4]),
        (3, "\x05\x06\x07" + REPLY[:4]), (4, "\x05\x06\x07" + REPLY[:4]), (5, "\x05\x06\x07" + REPLY[:4])]
    assert [q.sampling.seed for q in engine.requests[-6:]] == [10, 11, 12, 10, 11, 12]
    assert [q.prompt_token_ids for q in engine.requests[-6:]] == [[2, 97]] * 3 + [[5, 6, 7]] * 3
    assert (out["usage"]["prompt_tokens"], out["usage"]["completion_tokens"]) == (2 + 3, 6 * 4)
    post(url, "/v1/chat/completions", {**GOOD, "n": 2})
    assert [q.sampling.seed for q in engine.requests[-2:]] == [None, None]  # no seed: each reply its own
    with httpx.stream("POST", url + "/v1/chat/completions", json={**GOOD, "n": 2, "stream": True}) as r:
        events = [e for e in sse_events(r) if e != "[DONE]"]
    assert [e["choices"][0]["delta"] for e in events[:2]] == [{"role": "assistant", "content": ""}] * 2
    assert [e["choices"][0]["index"] for e in events[:2]] == [0, 1]
    for i in (0, 1):
        assert "".join(e["choices"][0]["delta"].get("content", "") for e in events
                       if e["choices"][0]["index"] == i) == REPLY[:5]
    assert sorted(e["choices"][0]["index"] for e in events if e["choices"][0]["finish_reason"]) == [0, 1]


def test_tokenizer_routes_in_vllms_shape(url: str) -> None:
    """/tokenize, /detokenize and /tokenizer_info as vLLM serves them: lm-evaluation-harness's remote tokenizer
    (found by a GET of /tokenizer_info with an eos_token and a POST of /tokenize) uses the server's own."""
    r = post(url, "/tokenize", {"prompt": "hi", "add_special_tokens": False, "return_token_strs": True})
    assert r.json() == {"count": 2, "max_model_len": CONTEXT, "tokens": [104, 105], "token_strs": ["h", "i"]}
    assert post(url, "/tokenize", {"model": "default", "prompt": "hi"}).json()["tokens"] == [2, 104, 105]
    r = post(url, "/tokenize", {"messages": [{"role": "user", "content": "a"}]})
    assert r.json()["tokens"] == [ord(c) for c in "<user>a<assistant>"]
    r = post(url, "/tokenize", {"messages": [{"role": "user", "content": "a"}], "add_generation_prompt": False})
    assert r.json()["count"] == len("<user>a")
    assert post(url, "/detokenize", {"tokens": [104, 105]}).json() == {"prompt": "hi"}
    assert post(url, "/detokenize", {"tokens": []}).json() == {"prompt": ""}
    info = httpx.get(url + "/tokenizer_info").json()
    assert (info["eos_token"], info["bos_token"], info["model_max_length"]) == ("</s>", "<s>", CONTEXT)
    assert info["chat_template"].startswith("{% for m in messages %}")


@pytest.mark.parametrize("path,body,status,param,words", [
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "a"}]}, 400, "prompt", "not both"),
    ("/tokenize", {}, 400, None, "either 'prompt'"),
    ("/tokenize", {"prompt": 5}, 400, "prompt", "must be a string"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": "no"}, 400, "add_special_tokens", "boolean"),
    ("/tokenize", {"prompt": "a", "model": "gpt-4"}, 404, "model", "does not exist"),
    ("/tokenize", {"messages": [{"role": "user", "content": "[template-error]"}]}, 400, None, "template"),
    ("/detokenize", {}, 400, "tokens", "required"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens", "an array of integer token ids"),
    ("/detokenize", {"tokens": [1, 2.5]}, 400, "tokens", "found a number"),
    ("/detokenize", {"tokens": [1, 5000]}, 400, "tokens", "outside the vocabulary (0..999)"),
    ("/detokenize", b"[1, 2]", 400, None, "JSON object"),
])
def test_bad_tokenizer_requests_are_clear_4xx(url: str, path, body, status, param, words) -> None:
    r = post(url, path, body)
    assert r.status_code == status, r.text
    e = r.json()["error"]
    assert e["param"] == param and words in e["message"], e
    assert_still_serving(url)


def test_tokenizer_routes_need_the_api_key(guarded) -> None:
    url, _ = guarded
    assert post(url, "/tokenize", {"prompt": "a"}).status_code == 401
    assert httpx.get(url + "/tokenizer_info").status_code == 401
    r = post(url, "/detokenize", {"tokens": [104]}, headers={"Authorization": f"Bearer {KEY}"})
    assert r.json() == {"prompt": "h"}


def test_pages_on_this_machine_get_cors_headers_and_others_none(url: str) -> None:
    """A web front end served from localhost (any port) can call the API from a browser: its preflight is
    answered without a key, and every reply, streamed or not, names it in Access-Control-Allow-Origin. Another
    site's page gets no preflight and a 403."""
    page = "http://localhost:3000"
    pre = httpx.options(url + "/v1/chat/completions", headers={
        "Origin": page, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == page
    assert "POST" in pre.headers["access-control-allow-methods"]
    assert {"authorization", "content-type"} <= {h.strip().lower() for h in
                                                 pre.headers["access-control-allow-headers"].split(",")}
    r = post(url, "/v1/chat/completions", GOOD, headers={"Origin": page})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == page and "Origin" in r.headers["vary"]
    with httpx.stream("POST", url + "/v1/chat/completions", json={**GOOD, "stream": True},
                      headers={"Origin": "http://127.0.0.1:5173"}) as s:
        assert s.headers["access-control-allow-origin"] == "http://127.0.0.1:5173"
        assert sse_events(s)[-1] == "[DONE]"
    evil = "https://evil.example"
    pre = httpx.options(url + "/v1/chat/completions", headers={"Origin": evil, "Access-Control-Request-Method": "POST"})
    assert pre.status_code == 403 and "access-control-allow-origin" not in pre.headers  # in OpenAI's shape, as below
    assert pre.json()["error"]["code"] == "origin_not_allowed"
    r = post(url, "/v1/chat/completions", GOOD, headers={"Origin": evil})
    assert r.status_code == 403 and "access-control-allow-origin" not in r.headers
    assert "access-control-allow-origin" not in post(url, "/v1/chat/completions", GOOD).headers  # programs


def test_allowed_origins_reach_the_api_and_still_need_the_key() -> None:
    """--allow-origin adds a site (or '*' any): its pages pass the origin check and read the replies, a 401
    included, while other sites stay refused; the key is still required."""
    engine = FakeEngine()
    config = ServerConfig(api_key=KEY, allow_origins=("https://my.app",))
    with LiveServer(create_app(engine, config)) as s:
        pre = httpx.options(s.url + "/v1/completions", headers={"Origin": "https://my.app",
                                                                "Access-Control-Request-Method": "POST"})
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "https://my.app"
        r = post(s.url, "/v1/completions", {"model": "default", "prompt": "x"}, headers={"Origin": "https://my.app"})
        assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "https://my.app"
        r = post(s.url, "/v1/completions", {"model": "default", "prompt": "x"},
                 headers={"Origin": "https://my.app", "Authorization": f"Bearer {KEY}"})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == REPLY
        r = post(s.url, "/v1/completions", {"model": "default", "prompt": "x"},
                 headers={"Origin": "https://my.app.evil.example", "Authorization": f"Bearer {KEY}"})
        assert r.status_code == 403
    with LiveServer(create_app(FakeEngine(), ServerConfig(allow_origins=("*",)))) as s:
        r = post(s.url, "/v1/completions", {"model": "default", "prompt": "x"}, headers={"Origin": "https://any.site"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://any.site"
