"""Tool-call formats: how the offered tools and earlier calls reach the model, what grammar its reply is held to, and
how the reply is read back, whole or as it streams. One class per format behind `ToolFormat`; `detect` picks one
from the chat template's text.

- `HermesTools`: Hermes and Qwen 2.5 / Qwen 3's own format, for templates that show `<tool_call>`. The template
  renders the tools (its `tools` variable) and earlier calls (`message.tool_calls`); the model answers
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, held to the tools' schemas by a Lark grammar
  that embeds them (`%json`), and under "auto" may write text instead, or text and then calls.
- `JsonTools`: llama.cpp's "generic" format (`tools.py`), for templates with no tool markup (the embedded
  SmolLM2): a system message describes the tools, and the reply is one JSON object.

The other families' formats (`formats/`): Llama 3.x's JSON (`LlamaTools`), Mistral's `[TOOL_CALLS]` (`MistralTools`),
Qwen3-Coder's XML (`QwenCoderTools`). The protocol and what formats share are `formats/base.py`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from mlx_engine.api import ResponseFormat

from app.toolcalls.formats.base import (CALL_JSON, Delta, HeldText, ThroughTemplate, ToolFormat, ToolStream, ValueEnd,
                                        marker, partial, text_or_calls, token)
from app.toolcalls.formats.llama import PYTHON_TAG, LlamaTools
from app.toolcalls.formats.mistral import CALLS, MistralTools
from app.toolcalls.formats.qwen_coder import QwenCoderTools
from app.toolcalls.tools import ReplyStream, Tools, calls_as_text, openai_call, reply, with_tools

__all__ = ["Delta", "ToolFormat", "ToolStream", "JSON", "JsonTools", "HermesTools", "LlamaTools", "MistralTools",
           "QwenCoderTools", "detect"]


def detect(chat_template: str | None, encode: Callable[[str], list[int]] | None = None) -> ToolFormat:
    """The format a chat template's tool markup shows, else the JSON format. `encode` (the tokenizer's, without BOS)
    tells whether the markers are tokens of their own. Each test asks for markup only that family's templates write,
    so a template that merely mentions one marker gets the JSON format, which every model can follow."""
    t = chat_template or ""
    if OPEN in t and "<function=" in t and "<parameter=" in t:  # Qwen3-Coder's XML inside <tool_call>
        return QwenCoderTools(token(encode, OPEN), token(encode, CLOSE))
    # `"arguments"` tells Hermes' JSON blocks from other families' `<tool_call>` (GLM's `<arg_key>`), which this
    # format would hold to the wrong shape
    if OPEN in t and '"arguments"' in t:
        return HermesTools(token(encode, OPEN), token(encode, CLOSE))
    # the array after the marker: v3 (SentencePiece) templates write "[TOOL_CALLS] [", tekken ones "[TOOL_CALLS][";
    # newer ones (`[TOOL_CALLS]name[ARGS]{...}`, Mistral Small 3.2, Devstral) are another format
    if "[AVAILABLE_TOOLS]" in t and (CALLS + "[" in t or CALLS + " [" in t):
        return MistralTools(token(encode, CALLS), " " if CALLS + " [" in t else "")
    if "<|start_header_id|>" in t and "ipython" in t and '"parameters"' in t:
        return LlamaTools(token(encode, PYTHON_TAG))
    return JSON


# ---- the JSON format (templates with no tool markup) -------------------------------------------------------


class JsonTools:
    name = "json"

    def history(self, content: str, calls: list[dict[str, Any]]) -> dict[str, Any]:
        return {"role": "assistant", "content": calls_as_text(content, calls)}

    def conversation(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return messages

    def render(self, messages: list[dict[str, Any]], tools: Tools) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        return with_tools(messages, tools), {}

    def grammar(self, tools: Tools) -> ResponseFormat:
        return ResponseFormat("json_schema", schema=tools.schema())

    def parse(self, text: str, tools: Tools | None = None) -> tuple[str | None, list[dict[str, Any]] | None]:
        return reply(text)

    def stream(self, tools: Tools | None = None) -> ToolStream:
        return _JsonStream()


class _JsonStream:
    """A plain reply's text as it comes (`ReplyStream`); calls whole at the end."""

    def __init__(self) -> None:
        self.reply = ReplyStream()
        self.called = False

    def feed(self, text: str) -> list[Delta]:
        out = self.reply.feed(text)
        return [Delta(content=out)] if out else []

    def finish(self) -> list[Delta]:
        if self.reply.mode in ("text", "done"):
            return []
        content, calls = reply(self.reply.buf)
        if calls:
            self.called = True
            return [Delta(call={"index": j, **c}) for j, c in enumerate(calls)]
        return [Delta(content=content)] if content else []


# ---- Hermes / Qwen: <tool_call> blocks -------------------------------------------------------------------------

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALLS = re.compile(r"\s*<tool_call>\s*(.*?)\s*</tool_call>", re.S)
# a call's head, up to its arguments' first character, once that has come (the grammar puts "name" first)
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\S)')


class HermesTools(ThroughTemplate):
    """`open_id`, `close_id`: the tokens `<tool_call>` and `</tool_call>` are, where each is one (Qwen's added
    tokens); llguidance reads an added token as special, never as its text, so the grammar names it by id, beside
    the text spelled out."""

    name = "hermes"

    def __init__(self, open_id: int | None = None, close_id: int | None = None):
        self.open_id = open_id
        self.close_id = close_id

    def grammar(self, tools: Tools) -> ResponseFormat:
        """`<tool_call>\\n` + one offered function's call as JSON (its schema via `%json`, in the template's own
        style) + `\\n</tool_call>`, more such blocks (newline-separated) when parallel calls are allowed. Under
        "auto" the reply may instead be text that never opens a call, or text and then calls; otherwise it begins
        with the call."""
        calls, defs = tools.call_schemas()
        one = calls[0] if len(calls) == 1 else {"anyOf": calls}
        body = json.dumps({**one, **({"$defs": defs} if defs else {}), "x-guidance": CALL_JSON})
        rules = [f"call: %json {body}", f"open: {marker(OPEN, self.open_id)}",
                 f"close: {marker(CLOSE, self.close_id)}", r'block: "\n" call "\n" close']
        more = r' ("\n" open block)*' if tools.many else ""
        if tools.choice == "auto":
            rules += text_or_calls(OPEN, self.open_id, f"block{more}")
        else:
            rules.append(f"start: open block{more}")
        return ResponseFormat("lark", grammar="\n".join(rules))

    def parse(self, text: str, tools: Tools | None = None) -> tuple[str | None, list[dict[str, Any]] | None]:
        start = text.find(OPEN)
        if start < 0:
            return text, None
        calls, at = [], start
        while (m := _CALLS.match(text, at)) is not None:
            try:
                call = json.loads(m.group(1))
            except ValueError:
                return text, None
            if not isinstance(call, dict) or not isinstance(call.get("name"), str) or "arguments" not in call:
                return text, None
            calls.append(openai_call(call["name"], call["arguments"]))
            at = m.end()
        if not calls or text[at:].strip():  # cut short inside a call
            return text, None
        return text[:start].rstrip() or None, calls

    def stream(self, tools: Tools | None = None) -> ToolStream:
        return _HermesStream()


class _HermesStream:
    """Text streams as it comes, but for a tail that may be the start of `<tool_call>` (and whitespace that may come
    before one: a call's content loses its trailing whitespace, as `parse` gives it). A call streams as its first
    piece (id and name) once its head is read, then its arguments' JSON text as it is generated. A reply cut short
    before its first call's head is whole is its text at the end, as `parse` gives it; cut later, what went out
    stays out."""

    def __init__(self) -> None:
        self.buf = ""
        self.mode = "text"  # text | head | arguments | close
        self.called = False
        self.index = -1
        self.text = HeldText()
        self.before = ""  # the whitespace held when the first call opened
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
                i = self.buf.find(OPEN)
                if i < 0:
                    keep = 0 if final else partial(self.buf, OPEN)
                    self.text.emit(self.buf[:len(self.buf) - keep], out, final)
                    self.buf = self.buf[len(self.buf) - keep:]
                    return out
                self.text.emit(self.buf[:i], out, False)
                self.before, self.text.held, self.buf, self.mode = self.text.held, "", self.buf[i + len(OPEN):], "head"
            elif self.mode == "head":
                m = _HEAD.match(self.buf)
                if m is None:
                    if final and self.index < 0:
                        out.append(Delta(content=self.before + OPEN + self.buf))
                    return out
                self.index += 1
                self.called = True
                out.append(Delta(call={**openai_call(json.loads(f'"{m.group(1)}"'), ""), "index": self.index}))
                self.buf, self.mode, self.value = self.buf[m.end():], "arguments", ValueEnd()
            elif self.mode == "arguments":
                end = self.value.scan(self.buf)
                piece = self.buf if end is None else self.buf[:end]
                if piece:
                    out.append(Delta(call={"index": self.index, "function": {"arguments": piece}}))
                self.buf = "" if end is None else self.buf[end:]
                if end is None:
                    return out
                self.mode = "close"
            else:  # after the arguments: the call's "}", then </tool_call>, then another call or nothing
                i = self.buf.find(CLOSE)
                if i < 0:
                    return out
                rest = self.buf[i + len(CLOSE):].lstrip()
                if rest.startswith(OPEN):
                    self.buf, self.mode = rest[len(OPEN):], "head"
                elif final or (rest and not OPEN.startswith(rest)):
                    self.buf, self.mode = rest, "text"  # what the grammar allows no more: text, as it came
                else:
                    return out


JSON = JsonTools()
