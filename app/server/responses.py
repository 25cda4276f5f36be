"""OpenAI response bodies and SSE chunks, built from GenerationEvents, byte for byte in OpenAI's shape."""

from __future__ import annotations

import json
import math
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from mlx_engine.api import TokenLogprob, ToolCall, Usage

from app.server.harmony_tools import tool_reply
from app.server.protocol import Job
from app.toolcalls.tool_formats import Delta

DONE = b"data: [DONE]\n\n"
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def usage_dict(u: Usage, accepted_draft_tokens: int | None = None, reasoning: bool = False) -> dict[str, Any]:
    """OpenAI's usage object; `accepted_draft_tokens` (None: no draft token was verified) goes where OpenAI
    counts accepted predicted-output tokens; with `reasoning` (a reasoning model), the reasoning tokens."""
    out: dict[str, Any] = {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
                           "total_tokens": u.prompt_tokens + u.completion_tokens,
                           "prompt_tokens_details": {"cached_tokens": u.cached_prompt_tokens}}
    details: dict[str, int] = {}
    if accepted_draft_tokens is not None:
        details["accepted_prediction_tokens"] = accepted_draft_tokens
    if reasoning:
        details["reasoning_tokens"] = u.reasoning_tokens
    if details:
        out["completion_tokens_details"] = details
    return out


def token_bytes_fn(tokenizer: Any) -> Callable[[int], bytes]:
    """token id -> its raw bytes. `id_to_piece` shows bytes that are not whole UTF-8 characters as `<0xE4>`;
    those are turned back into bytes."""

    @lru_cache(maxsize=65536)
    def token_bytes(token_id: int) -> bytes:
        piece = tokenizer.id_to_piece(token_id)
        out, at = bytearray(), 0
        for m in _BYTE_PIECE.finditer(piece):
            out += piece[at:m.start()].encode()
            out.append(int(m.group(1), 16))
            at = m.end()
        out += piece[at:].encode()
        return bytes(out)

    return token_bytes


def finite(logprob: float) -> float:
    """-inf (a token the sampler ruled out) is not JSON: OpenAI sends -9999.0 there."""
    return logprob if math.isfinite(logprob) else -9999.0


def token_str(b: bytes) -> str:
    return b.decode("utf-8", errors="backslashreplace")


@dataclass(frozen=True)
class Echo:
    """A completion prompt as `echo` returns it: its text and token ids. Its tokens' log-probabilities (all but
    the first) come with the choice's first event, the engine's `prompt_logprobs`."""

    text: str
    token_ids: list[int]


@dataclass(frozen=True)
class Choice:
    """One prompt's finished reply, for a whole (non-streamed) response."""

    text: str
    logprobs: tuple[TokenLogprob, ...]
    finish_reason: str
    prompt_logprobs: tuple[TokenLogprob, ...] = ()  # with `echo` and logprobs: the prompt's, from the engine
    reasoning: str = ""  # a reasoning model's thinking (GenerationEvent.reasoning), apart from `text`
    stop_string: str | None = None  # the stop string that ended it (GenerationEvent.stop_string)
    tool_calls: tuple[ToolCall, ...] = ()  # the calls the engine read in the model's own format (harmony's)


class Formatter:
    """Builds one request's chunks and final body: ids, timestamps, model and logprobs in OpenAI's shape. A
    request has n choices per prompt (`Job.n`), `index` = prompt * n + reply. On a reasoning model (`reasoning`)
    a chat message carries its thinking as `reasoning_content` and `reasoning` (vLLM's and OpenRouter's names, the
    same text), streamed as deltas of those, a completion choice as `reasoning_content`; usage counts
    `completion_tokens_details.reasoning_tokens`."""

    def __init__(self, job: Job, model_id: str, fingerprint: str, token_bytes: Callable[[int], bytes],
                 reasoning: bool = False):
        self.job = job
        self.reasoning = reasoning
        self.chat = job.endpoint == "chat"
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.model = model_id
        self.fingerprint = fingerprint
        self.token_bytes = token_bytes
        self.text_offset: dict[int, int] = {}  # completions logprobs: where choice i's next token starts
        self.echoes: dict[int, Echo] = {}  # completions with `echo`: each choice's prompt

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint}

    # ---- logprobs --------------------------------------------------------------------------------------

    def _chat_entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        b = self.token_bytes(token_id)
        return {"token": token_str(b), "logprob": finite(logprob), "bytes": list(b)}

    def chat_logprobs(self, lps: tuple[TokenLogprob, ...]) -> list[dict[str, Any]]:
        out = []
        for lp in lps:
            entry = self._chat_entry(lp.token_id, lp.logprob)
            entry["top_logprobs"] = [self._chat_entry(t, v) for t, v in lp.top[:self.job.top_logprobs]]
            out.append(entry)
        return out

    def _top(self, lp: TokenLogprob) -> dict[str, float]:
        top: dict[str, float] = {}
        for t, v in lp.top[:self.job.top_logprobs]:
            top.setdefault(token_str(self.token_bytes(t)), finite(v))
        return top

    def completion_logprobs(self, lps: tuple[TokenLogprob, ...], index: int = 0, echo: Echo | None = None,
                            prompt_lps: tuple[TokenLogprob, ...] = ()) -> dict[str, Any]:
        """The legacy logprobs object; with `echo`, the prompt's tokens first (`prompt_lps`; the first token
        has no log-probability: nothing comes before it)."""
        tokens: list[str] = []
        token_lps: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        offsets: list[int] = []
        at = self.text_offset.get(index, 0)
        entries: list[tuple[int, TokenLogprob | None]] = []
        if echo is not None:
            entries += [(echo.token_ids[0], None)] + [(lp.token_id, lp) for lp in prompt_lps]
        entries += [(lp.token_id, lp) for lp in lps]
        for token_id, lp in entries:
            s = token_str(self.token_bytes(token_id))
            tokens.append(s)
            token_lps.append(None if lp is None else finite(lp.logprob))
            tops.append(None if lp is None else self._top(lp))
            offsets.append(at)
            at += len(s)
        self.text_offset[index] = at
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def _logprobs(self, lps: tuple[TokenLogprob, ...], index: int = 0, echo: Echo | None = None,
                  prompt_lps: tuple[TokenLogprob, ...] = ()) -> Any:
        if not self.job.logprobs:
            return None
        if self.chat:
            return {"content": self.chat_logprobs(lps), "refusal": None}
        return self.completion_logprobs(lps, index, echo, prompt_lps)

    # ---- streaming ---------------------------------------------------------------------------------------

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        obj = self._head("chat.completion.chunk" if self.chat else "text_completion")
        obj["choices"] = [choice]
        if self.job.include_usage:
            obj["usage"] = None
        return obj

    def first_chunks(self) -> list[dict[str, Any]]:
        """Chat streams open with the assistant role and empty content for each choice, as OpenAI's do."""
        if not self.chat:
            return []
        return [self._chunk({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}) for i in range(self.job.n)]

    def echo_chunk(self, index: int, prompt_logprobs: tuple[TokenLogprob, ...]) -> dict[str, Any] | None:
        """With `echo`, a completion choice's prompt (and its log-probabilities, which come with the choice's
        first event), before anything of its reply; None without `echo`."""
        echo = self.echoes.get(index)
        if echo is None:
            return None
        return self._chunk({"index": index, "text": echo.text,
                            "logprobs": self._logprobs((), index, echo, prompt_logprobs), "finish_reason": None})

    def delta_chunk(self, text: str, lps: tuple[TokenLogprob, ...], index: int = 0) -> dict[str, Any]:
        if self.chat:
            return self._chunk({"index": index, "delta": {"content": text}, "logprobs": self._logprobs(lps),
                                "finish_reason": None})
        return self._chunk({"index": index, "text": text, "logprobs": self._logprobs(lps, index),
                            "finish_reason": None})

    def reasoning_chunk(self, text: str, lps: tuple[TokenLogprob, ...], index: int = 0) -> dict[str, Any]:
        """A delta of the reasoning (with the log-probabilities of tokens that gave no answer text)."""
        if self.chat:
            return self._chunk({"index": index, "delta": {"reasoning_content": text, "reasoning": text},
                                "logprobs": self._logprobs(lps), "finish_reason": None})
        return self._chunk({"index": index, "text": "", "reasoning_content": text,
                            "logprobs": self._logprobs(lps, index), "finish_reason": None})

    def finish_chunk(self, finish_reason: str, index: int = 0) -> dict[str, Any]:
        if self.chat:
            return self._chunk({"index": index, "delta": {}, "logprobs": None, "finish_reason": finish_reason})
        return self._chunk({"index": index, "text": "", "logprobs": None, "finish_reason": finish_reason})

    def tool_delta_chunk(self, delta: Delta, index: int = 0) -> dict[str, Any]:
        """A piece of a tool-calling choice (`tool_formats.Delta`): its text, or a piece of one of its calls."""
        body = {"content": delta.content} if delta.call is None else {"tool_calls": [delta.call]}
        return self._chunk({"index": index, "delta": body, "logprobs": None, "finish_reason": None})

    def usage_chunk(self, usage: Usage, accepted_draft_tokens: int | None = None) -> dict[str, Any]:
        obj = self._head("chat.completion.chunk" if self.chat else "text_completion")
        obj["choices"] = []
        obj["usage"] = usage_dict(usage, accepted_draft_tokens, self.reasoning)
        return obj

    # ---- whole responses ---------------------------------------------------------------------------------

    def response(self, choices: list[Choice], usage: Usage, accepted_draft_tokens: int | None = None
                 ) -> dict[str, Any]:
        """The whole body; an echoed prompt's log-probabilities are each Choice's `prompt_logprobs`."""
        if self.chat:
            obj = self._head("chat.completion")
            obj["choices"] = []
            for i, c in enumerate(choices):
                message: dict[str, Any] = {"role": "assistant", "content": c.text, "refusal": None}
                if self.reasoning:
                    message["reasoning_content"] = message["reasoning"] = c.reasoning or None
                reason = c.finish_reason
                if self.job.tools is not None:
                    message["content"], calls = tool_reply(self.job.tool_format, c.text, c.tool_calls, self.job.tools)
                    if calls:
                        message["tool_calls"], reason = calls, "tool_calls"
                obj["choices"].append({"index": i, "message": message, "logprobs": self._logprobs(c.logprobs),
                                       "finish_reason": reason})
        else:
            obj = self._head("text_completion")
            obj["choices"] = []
            for i, c in enumerate(choices):
                echo = self.echoes.get(i)
                choice = {"index": i, "text": (echo.text if echo else "") + c.text,
                          "logprobs": self._logprobs(c.logprobs, i, echo, c.prompt_logprobs),
                          "finish_reason": c.finish_reason}
                if self.reasoning:
                    choice["reasoning_content"] = c.reasoning or None
                obj["choices"].append(choice)
        obj["usage"] = usage_dict(usage, accepted_draft_tokens, self.reasoning)
        return obj


def error_chunk(message: str, code: str | None = None) -> dict[str, Any]:
    """What a stream sends when its generation fails after the 200 was sent (then `[DONE]`)."""
    return {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
