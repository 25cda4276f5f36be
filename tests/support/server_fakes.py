"""A scripted engine with the real Engine's surface (`mlx_engine.api.EngineLike`), and a live uvicorn
server in a background thread, for the server's tests.

The fake tokenizer is one token per character (id = code point), so counts are exact by eye. The prompt
steers the reply: "[raise]" makes iteration raise after two tokens, "[error]" ends in an engine error
event, "[slow]" sleeps 20 ms per token, "[long]" replies 40 tokens. With `prompt_logprobs` the first event gives
token t of the prompt the log-probability -t / 100, its best alternative 'x' at -0.5. A named speculative mode marks every
second token as drafted (final stats: half the drafts accepted, one per verification); "draft" is refused
(no draft model), "auto" steps aside.

`FakeEngine(reasoning="think")` is a reasoning model: its template ends the generation prompt with "<think>" (not
with `enable_thinking=False` among the template variables, which the tokenizer keeps in `template_kwargs`), and a
prompt ending so is answered with THOUGHT as reasoning events (one character a token), a closer token that gives no
text (id 3), then the reply; a `reasoning_budget` cuts THOUGHT to that many tokens.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

from mlx_engine.api import (NO_DRAFT_MODEL, GenerationEvent, GenerationRequest, ModelInfo, RequestError,
                            RooflineError, Stats, TokenLogprob, Usage)

VOCAB = 1000
CONTEXT = 64
REPLY = "Hello world"
THOUGHT = "Let me see."
CLOSER = 3


class FakeTokenizer:
    eos_token_ids = (1,)
    special_tokens = {"bos_token": "<s>", "eos_token": "</s>"}
    chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"

    def __init__(self, thinks: bool = False):
        self.thinks = thinks
        self.template_kwargs: list[dict[str, Any]] = []  # each encode_chat's template variables

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([2] if add_special_tokens else []) + [min(ord(c), VOCAB - 1) for c in text]

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    **kwargs: Any) -> list[int]:
        if any(m["content"] == "[template-error]" for m in messages):
            raise RequestError("chat template error: the template refused this conversation")
        self.template_kwargs.append(kwargs)
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages) + ("<assistant>" if add_generation_prompt
                                                                           else "")
        if self.thinks and add_generation_prompt and kwargs.get("enable_thinking") is not False:
            text += "<think>"
        return self.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(i) for i in ids)

    def id_to_piece(self, token_id: int) -> str:
        return {2: "<s>", 1: "</s>", 300: "<0xE4>"}.get(token_id, chr(token_id))


class FakeStream:
    def __init__(self, engine: FakeEngine, ids: list[int], request: GenerationRequest):
        self.engine = engine
        p = request.sampling
        text = engine.tokenizer.decode(ids)
        reply = REPLY * 4 if "[long]" in text else REPLY
        thought = THOUGHT[:p.reasoning_budget] if text.endswith("<think>") else ""
        self.num_reasoning = len(thought) + 1 if thought or text.endswith("<think>") else 0  # the closer's too
        self.tokens = ([ord(c) for c in thought] + [CLOSER] * bool(self.num_reasoning)
                       + [ord(c) for c in reply])[:p.max_tokens]
        self.raise_at = 2 if "[raise]" in text else None
        self.error = "[error]" in text
        self.delay = 0.02 if "[slow]" in text else 0.0
        self.params = p
        self.drafting = p.speculative in ("prompt-lookup", "self")
        self.num_prompt = len(ids)
        self.prompt_lps = () if p.prompt_logprobs is None else tuple(
            TokenLogprob(t, -t / 100, ((ord("x"), -0.5), (t, -t / 100))[:p.prompt_logprobs]) for t in ids[1:])
        self.i = 0
        self.out = ""
        self.cancelled = threading.Event()
        self.done = False
        with engine.lock:
            engine.active += 1

    def __iter__(self) -> FakeStream:
        return self

    def _end(self, reason: str, error: str | None = None, text: str = "", stop: str | None = None) -> GenerationEvent:
        self.done = True
        with self.engine.lock:
            self.engine.active -= 1
        drafted = self.i // 2 if self.drafting else 0  # tokens 1, 3, 5, ...: one accepted draft per verification
        stats = Stats(ttft_s=0.01, prefill_tps=1000.0, decode_tps=100.0, peak_memory_bytes=0,
                      acceptance_rate=0.5 if drafted else None, mean_accepted_tokens=1.0 if drafted else None,
                      target_forwards=self.i - drafted)
        plps, self.prompt_lps = self.prompt_lps, ()  # when no token took them (max_tokens=0)
        usage = Usage(self.num_prompt, self.i, self.engine.cached(self.num_prompt),
                      reasoning_tokens=min(self.i, self.num_reasoning))
        return GenerationEvent(text=text, finish_reason=reason, error=error,  # type: ignore[arg-type]
                               usage=usage, stats=stats, prompt_logprobs=plps, stop_string=stop)

    def __next__(self) -> GenerationEvent:
        if self.done:
            raise StopIteration
        if self.delay:
            time.sleep(self.delay)
        if self.cancelled.is_set():
            return self._end("cancelled")
        if self.raise_at is not None and self.i == self.raise_at:
            self._end("error")
            raise RuntimeError("the fake engine broke down")
        if self.i == len(self.tokens):
            if self.error:
                return self._end("error", "the fake engine failed this request")
            return self._end("length" if self.i == self.params.max_tokens else "stop")
        tok = self.tokens[self.i]
        self.i += 1
        thinking = self.i <= self.num_reasoning
        if not thinking:
            self.out += chr(tok)
        lps: tuple[TokenLogprob, ...] = ()
        if self.params.logprobs is not None:
            top = ((tok, -0.25), (300, -1.5), (ord("x"), -2.0))[:self.params.logprobs]
            lps = (TokenLogprob(tok, -0.25, top),)
        for s in self.params.stop:
            if s in self.out:
                return self._end("stop", stop=s)
        plps, self.prompt_lps = self.prompt_lps, ()
        text = "" if tok == CLOSER and thinking else chr(tok)
        return GenerationEvent(text="" if thinking else text, reasoning=text if thinking else "", token_ids=(tok,),
                               from_draft=(self.drafting and self.i % 2 == 0,), logprobs=lps, prompt_logprobs=plps)

    def cancel(self) -> None:
        self.cancelled.set()

    def close(self) -> None:
        self.cancel()


class FakeEngine:
    def __init__(self, name: str = "Fake-1B (Q4 test)", reasoning: str | None = None):
        self.info = ModelInfo(name=name, path="/fake", model_type="llama", source_format="gguf", num_parameters=1,
                              quantization="Q4_1", context_length=CONTEXT, weight_bytes=0, vocab_size=VOCAB,
                              native=True, dtype="float32", eos_token_ids=(1,), reasoning=reasoning)
        self.tokenizer = FakeTokenizer(thinks=reasoning is not None)
        self.lock = threading.Lock()
        self.active = 0
        self.requests: list[GenerationRequest] = []
        self.streams: list[FakeStream] = []
        self.seen: list[list[int]] = []
        self.closed = False

    def cached(self, n: int) -> int:
        return 0

    def generate(self, request: GenerationRequest) -> FakeStream:
        ids = list(request.prompt_token_ids or [])
        if len(ids) >= CONTEXT:
            raise RequestError(f"the prompt is {len(ids)} tokens but the model's context is {CONTEXT} tokens")
        if request.sampling.speculative == "draft":
            raise RequestError(NO_DRAFT_MODEL)
        if request.sampling.reasoning_budget is not None and self.info.reasoning is None:
            raise RequestError(f"invalid sampling parameter reasoning_budget={request.sampling.reasoning_budget}: "
                               f"{self.info.name} does not reason")
        self.requests.append(request)
        self.streams.append(FakeStream(self, ids, request))
        return self.streams[-1]

    def kv_stats(self) -> dict[str, Any]:
        return {"kind": "paged", "num_blocks": 100, "used": self.active, "cached": 0, "hit_rate": 0.0}

    def save_kv(self, path: str, request: GenerationRequest | list[int]) -> int:
        raise RooflineError("this engine keeps no KV files (ModelInfo.kv_files is False)")

    def restore_kv(self, path: str) -> int:
        raise RooflineError("this engine keeps no KV files (ModelInfo.kv_files is False)")

    def decode_bytes_per_token(self, context_tokens: int) -> int:
        return self.info.weight_bytes + 8 * context_tokens  # a pretend KV of 8 bytes a token

    def close(self) -> None:
        self.closed = True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """`roofline serve`'s uvicorn serving `app` on a free loopback port in a daemon thread. `should_exit = True` is
    what SIGTERM does: the drain begins."""

    def __init__(self, app: Any, drain_s: float = 2.0, **listener: Any):
        from app.server.listener import DrainingServer, uvicorn_config

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn_config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on", **listener)
        self.server = DrainingServer(config, app.state.server, drain_s)
        self.thread = threading.Thread(target=self.server.run, name="test-uvicorn", daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def wait_until(cond: Any, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def raw_request(url: str, head: bytes) -> tuple[int, dict[str, str], bytes]:
    """Sends `head` as it is (no client would), returns (status, headers, body)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        try:
            sock.sendall(head)
        except OSError:  # the server answered and closed before taking it all
            pass
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    top, _, body = data.partition(b"\r\n\r\n")
    lines = top.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), {k.lower(): v for k, v in headers.items()}, body
