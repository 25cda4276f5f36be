"""OpenAI response bodies and SSE chunks, built from GenerationEvents, byte for byte in OpenAI's shape."""

from __future__ import annotations

import json
import math
import re
import time
import uuid
from collections.abc import Callable
from functools import lru_cache
from typing import Any

from mlx_engine.api import TokenLogprob, Usage

from app.server.protocol import Job

DONE = b"data: [DONE]\n\n"
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def usage_dict(u: Usage, accepted_draft_tokens: int | None = None) -> dict[str, Any]:
    """OpenAI's usage object; `accepted_draft_tokens` (None: no draft token was verified) goes where OpenAI
    counts accepted predicted-output tokens."""
    out: dict[str, Any] = {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
                           "total_tokens": u.prompt_tokens + u.completion_tokens,
                           "prompt_tokens_details": {"cached_tokens": u.cached_prompt_tokens}}
    if accepted_draft_tokens is not None:
        out["completion_tokens_details"] = {"accepted_prediction_tokens": accepted_draft_tokens}
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


class Formatter:
    """Builds one request's chunks and final body: ids, timestamps, model and logprobs in OpenAI's shape."""

    def __init__(self, job: Job, model_id: str, fingerprint: str, token_bytes: Callable[[int], bytes]):
        self.job = job
        self.chat = job.endpoint == "chat"
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.model = model_id
        self.fingerprint = fingerprint
        self.token_bytes = token_bytes
        self.text_offset = 0  # completions logprobs: where the next token starts in the reply

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

    def completion_logprobs(self, lps: tuple[TokenLogprob, ...]) -> dict[str, Any]:
        tokens, token_lps, tops, offsets = [], [], [], []
        for lp in lps:
            s = token_str(self.token_bytes(lp.token_id))
            tokens.append(s)
            token_lps.append(finite(lp.logprob))
            top: dict[str, float] = {}
            for t, v in lp.top[:self.job.top_logprobs]:
                top.setdefault(token_str(self.token_bytes(t)), finite(v))
            tops.append(top)
            offsets.append(self.text_offset)
            self.text_offset += len(s)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def _logprobs(self, lps: tuple[TokenLogprob, ...]) -> Any:
        if not self.job.logprobs:
            return None
        if self.chat:
            return {"content": self.chat_logprobs(lps), "refusal": None}
        return self.completion_logprobs(lps)

    # ---- streaming ---------------------------------------------------------------------------------------

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        obj = self._head("chat.completion.chunk" if self.chat else "text_completion")
        obj["choices"] = [choice]
        if self.job.include_usage:
            obj["usage"] = None
        return obj

    def first_chunk(self) -> dict[str, Any] | None:
        """Chat streams open with the assistant role and empty content, as OpenAI's do."""
        if not self.chat:
            return None
        return self._chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None})

    def delta_chunk(self, text: str, lps: tuple[TokenLogprob, ...]) -> dict[str, Any]:
        if self.chat:
            return self._chunk({"index": 0, "delta": {"content": text}, "logprobs": self._logprobs(lps),
                                "finish_reason": None})
        return self._chunk({"index": 0, "text": text, "logprobs": self._logprobs(lps), "finish_reason": None})

    def finish_chunk(self, finish_reason: str) -> dict[str, Any]:
        if self.chat:
            return self._chunk({"index": 0, "delta": {}, "logprobs": None, "finish_reason": finish_reason})
        return self._chunk({"index": 0, "text": "", "logprobs": None, "finish_reason": finish_reason})

    def usage_chunk(self, usage: Usage, accepted_draft_tokens: int | None = None) -> dict[str, Any]:
        obj = self._head("chat.completion.chunk" if self.chat else "text_completion")
        obj["choices"] = []
        obj["usage"] = usage_dict(usage, accepted_draft_tokens)
        return obj

    # ---- whole responses ---------------------------------------------------------------------------------

    def response(self, text: str, lps: tuple[TokenLogprob, ...], finish_reason: str, usage: Usage,
                 accepted_draft_tokens: int | None = None) -> dict[str, Any]:
        if self.chat:
            obj = self._head("chat.completion")
            obj["choices"] = [{"index": 0, "message": {"role": "assistant", "content": text, "refusal": None},
                               "logprobs": self._logprobs(lps), "finish_reason": finish_reason}]
        else:
            obj = self._head("text_completion")
            obj["choices"] = [{"index": 0, "text": text, "logprobs": self._logprobs(lps),
                               "finish_reason": finish_reason}]
        obj["usage"] = usage_dict(usage, accepted_draft_tokens)
        return obj


def error_chunk(message: str, code: str | None = None) -> dict[str, Any]:
    """What a stream sends when its generation fails after the 200 was sent (then `[DONE]`)."""
    return {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
