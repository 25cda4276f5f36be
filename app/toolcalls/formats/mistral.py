"""Mistral's tool calls (Mistral 7B v0.3, Nemo, Small: templates with `[AVAILABLE_TOOLS]` and `[TOOL_CALLS]`).

The template lists the offered tools (its `tools` variable) in `[AVAILABLE_TOOLS]...[/AVAILABLE_TOOLS]` before the
last user message, renders an earlier call as `[TOOL_CALLS][{"name": ..., "arguments": {...}, "id": "..."}]` and a
result as `[TOOL_RESULTS]{"content": ..., "call_id": "..."}[/TOOL_RESULTS]`, and refuses a call or result whose id
is not 9 characters (Mistral's own tokenizer's rule: alphanumeric). The model answers `[TOOL_CALLS]` and a JSON array
of calls, held here to the offered functions' schemas (an `"id"` after the arguments is allowed, as the template
writes earlier calls); v3 templates put a space after the marker, tekken ones none.

Ids: the template reads each result's call by `tool_call_id`, but conversations reach the formats without their ids
(the chat app has none), so `conversation` gives each call an id from its place in the conversation and each `tool`
message the id of the call it follows; the same conversation always renders alike, and a longer one extends it. The
ids returned to the client are 9 alphanumeric characters too, so a client that passes them to another Mistral
server gets them accepted.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import string
from typing import Any

from mlx_engine.api import ResponseFormat

from app.toolcalls.formats.base import CALL_JSON, Delta, HeldText, ToolStream, ValueEnd, marker, partial, text_or_calls
from app.toolcalls.tools import Tools, openai_call

CALLS = "[TOOL_CALLS]"
ID_PATTERN = "^[A-Za-z0-9]{9}$"
_ALPHANUMERIC = string.ascii_letters + string.digits
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\S)')
# after a call's arguments: its id if written, its "}", and "," (another call) or "]" (the last)
_TAIL = re.compile(r'\s*(?:,\s*"id"\s*:\s*"[^"]*"\s*)?\}\s*([,\]])')


class MistralTools:
    """`calls_id`: the token `[TOOL_CALLS]` is, where it is one (Mistral's control tokens); `space`: what the
    template writes between the marker and the array."""

    name = "mistral"

    def __init__(self, calls_id: int | None = None, space: str = ""):
        self.calls_id = calls_id
        self.space = space

    def history(self, content: str, calls: list[dict[str, Any]]) -> dict[str, Any]:
        return {"role": "assistant", "content": content,
                "tool_calls": [{"type": "function", "function": c} for c in calls]}

    def conversation(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        waiting: list[str] = []  # the ids of the latest calls no result has answered yet
        for i, m in enumerate(messages):
            if m["role"] == "assistant" and m.get("tool_calls"):
                calls = [{**c, "id": place_id(f"{i}.{j}")} for j, c in enumerate(m["tool_calls"])]
                if m.get("content"):  # the template renders a calling turn's calls only: its text as a turn before
                    out.append({"role": "assistant", "content": m["content"]})
                out.append({"role": "assistant", "content": "", "tool_calls": calls})
                waiting = [c["id"] for c in calls]
            elif m["role"] == "tool":
                out.append({**m, "tool_call_id": waiting.pop(0) if waiting else place_id(str(i))})
            else:
                out.append(m)
        return out

    def render(self, messages: list[dict[str, Any]], tools: Tools) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        return messages, {"tools": [{"type": "function", "function": f} for f in tools.offered()]}

    def grammar(self, tools: Tools) -> ResponseFormat:
        """`[TOOL_CALLS]` and a JSON array of calls of offered functions (`%json`, in the template's style), one
        unless parallel calls are allowed. Under "auto" the reply may instead be text that never opens a call, or
        text and then the calls; otherwise it begins with them."""
        calls, defs = tools.call_schemas()
        calls = [{**c, "properties": {**c["properties"], "id": {"type": "string", "pattern": ID_PATTERN}}}
                 for c in calls]
        array: dict[str, Any] = {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
                                 "minItems": 1}
        if not tools.many:
            array["maxItems"] = 1
        body = json.dumps({**array, **({"$defs": defs} if defs else {}), "x-guidance": CALL_JSON})
        rules = [f"calls: %json {body}", f"open: {marker(CALLS, self.calls_id)}"]
        after = f'"{self.space}" calls' if self.space else "calls"
        if tools.choice == "auto":
            rules += text_or_calls(CALLS, self.calls_id, after)
        else:
            rules.append(f"start: open {after}")
        return ResponseFormat("lark", grammar="\n".join(rules))

    def parse(self, text: str, tools: Tools | None = None) -> tuple[str | None, list[dict[str, Any]] | None]:
        start = text.find(CALLS)
        if start < 0:
            return text, None
        try:
            value = json.loads(text[start + len(CALLS):])
        except ValueError:  # cut short, or more after the array
            return text, None
        if not isinstance(value, list) or not value or not all(
                isinstance(c, dict) and isinstance(c.get("name"), str) and "arguments" in c for c in value):
            return text, None
        return text[:start].rstrip() or None, [mistral_call(c["name"], c["arguments"]) for c in value]

    def stream(self, tools: Tools | None = None) -> ToolStream:
        return _MistralStream()


def mistral_call(name: str, arguments: Any) -> dict[str, Any]:
    """`openai_call` with a fresh id of 9 alphanumeric characters, which Mistral's templates accept back."""
    return {**openai_call(name, arguments), "id": "".join(secrets.choice(_ALPHANUMERIC) for _ in range(9))}


def place_id(place: str) -> str:
    """A call's id for the template from its place in the conversation: 9 alphanumeric characters, always the
    same for the same place."""
    n = int.from_bytes(hashlib.sha256(place.encode()).digest()[:8], "big")
    out = []
    for _ in range(9):
        n, r = divmod(n, len(_ALPHANUMERIC))
        out.append(_ALPHANUMERIC[r])
    return "".join(out)


class _MistralStream:
    """Text streams as it comes, but for a tail that may be the start of `[TOOL_CALLS]` and whitespace before it.
    After the marker, each call of the array streams as its id and name once its head is read, then its arguments'
    JSON text. A reply cut short before its first call's head is its text at the end, as `parse` gives it."""

    def __init__(self) -> None:
        self.buf = ""
        self.mode = "text"  # text | array | head | arguments | tail | done | plain
        self.called = False
        self.index = -1
        self.text = HeldText()
        self.raw = ""  # what followed the marker, until the first call's head: the reply's text if none comes
        self.value = ValueEnd()

    def feed(self, text: str) -> list[Delta]:
        self.buf += text
        return self._run(False)

    def finish(self) -> list[Delta]:
        return self._run(True)

    def _run(self, final: bool) -> list[Delta]:
        out: list[Delta] = []
        while True:
            if self.mode == "text":
                i = self.buf.find(CALLS)
                if i < 0:
                    keep = 0 if final else partial(self.buf, CALLS)
                    self.text.emit(self.buf[:len(self.buf) - keep], out, final)
                    self.buf = self.buf[len(self.buf) - keep:]
                    return out
                self.text.emit(self.buf[:i], out, False)
                self.raw, self.text.held = self.text.held + CALLS, ""
                self.buf, self.mode = self.buf[i + len(CALLS):], "array"
            elif self.mode == "array":
                lead = self.buf.lstrip()
                if lead[:1] != "[":
                    if final or lead:  # not a call after all: the rest is text, as `parse` reads it
                        self.buf, self.mode = self.raw + self.buf, "plain"
                        continue
                    return out
                self.raw += self.buf[:len(self.buf) - len(lead) + 1]
                self.buf, self.mode = lead[1:], "head"
            elif self.mode == "head":
                m = _HEAD.match(self.buf)
                if m is None:
                    if final and self.index < 0:
                        out.append(Delta(content=self.raw + self.buf))
                    return out
                self.index += 1
                self.called = True
                out.append(Delta(call={**mistral_call(json.loads(f'"{m.group(1)}"'), ""), "index": self.index}))
                self.buf, self.mode, self.value = self.buf[m.end():], "arguments", ValueEnd()
            elif self.mode == "arguments":
                end = self.value.scan(self.buf)
                piece = self.buf if end is None else self.buf[:end]
                if piece:
                    out.append(Delta(call={"index": self.index, "function": {"arguments": piece}}))
                self.buf = "" if end is None else self.buf[end:]
                if end is None:
                    return out
                self.mode = "tail"
            elif self.mode == "tail":
                m = _TAIL.match(self.buf)
                if m is None:
                    return out
                self.buf, self.mode = self.buf[m.end():], "head" if m.group(1) == "," else "done"
            elif self.mode == "plain":
                if self.buf:
                    out.append(Delta(content=self.buf))
                self.buf = ""
                return out
            else:
                return out
