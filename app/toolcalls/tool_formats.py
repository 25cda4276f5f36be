"""Tool-call formats: how the offered tools and earlier calls reach the model, what grammar its reply is held to, and
how the reply is read back, whole or as it streams. One class per format behind `ToolFormat`; `detect` picks one
from the chat template's text.

- `HermesTools`: Hermes and Qwen 2.5 / Qwen 3's own format, for templates that show `<tool_call>`. The template
  renders the tools (its `tools` variable) and earlier calls (`message.tool_calls`); the model answers
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, held to the tools' schemas by a Lark grammar
  that embeds them (`%json`), and under "auto" may write text instead, or text and then calls.
- `JsonTools`: llama.cpp's "generic" format (`tools.py`), for templates with no tool markup (the embedded
  SmolLM2): a system message describes the tools, and the reply is one JSON object.

Another family (Llama 3.x's JSON, Mistral's `[TOOL_CALLS]`, Qwen3-Coder's XML) is another class with the same five
members, and a line in `detect`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from collections.abc import Callable
from typing import Any, Protocol

from mlx_engine.api import ResponseFormat

from app.toolcalls.tools import ReplyStream, Tools, calls_as_text, openai_call, reply, with_tools


@dataclass(frozen=True)
class Delta:
    """A piece of a streamed reply: text, or one entry of OpenAI's `delta.tool_calls` (`index`; with the call's
    first piece its `id`, `type` and `function.name`; then `function.arguments` fragments)."""

    content: str | None = None
    call: dict[str, Any] | None = None


class ToolStream(Protocol):
    """One reply read as it is generated."""

    called: bool  # whether it has called a function (its finish reason is then "tool_calls")

    def feed(self, text: str) -> list[Delta]:
        """More of the reply -> what can be sent now."""
        ...

    def finish(self) -> list[Delta]:
        """At the end of the reply: what was held back."""
        ...


class ToolFormat(Protocol):
    """A model family's way of calling tools."""

    name: str

    def history(self, content: str, calls: list[dict[str, Any]]) -> dict[str, Any]:
        """An earlier assistant turn that called functions (`calls`: [{"name", "arguments"}]) as a chat message for
        the template."""
        ...

    def render(self, messages: list[dict[str, Any]], tools: Tools) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The conversation offering `tools`, and the chat template's extra variables."""
        ...

    def grammar(self, tools: Tools) -> ResponseFormat | None:
        """What the reply is held to (None: nothing; the model writes its own format)."""
        ...

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]] | None]:
        """A whole reply -> (content, None) or (content or None, OpenAI tool_calls with fresh ids). A reply cut
        short is its text."""
        ...

    def stream(self) -> ToolStream:
        """A reader for one reply as it streams."""
        ...


def detect(chat_template: str | None, encode: Callable[[str], list[int]] | None = None) -> ToolFormat:
    """The format a chat template shows: Hermes / Qwen's `<tool_call>` blocks of JSON, else the JSON format. `encode`
    (the tokenizer's, without BOS) tells whether the markers are tokens of their own."""
    # `"arguments"` tells Hermes' JSON blocks from other families' `<tool_call>` (Qwen3-Coder's `<function=...>`
    # XML, GLM's `<arg_key>`), which this format would hold to the wrong shape
    if chat_template and OPEN in chat_template and '"arguments"' in chat_template:
        return HermesTools(*(_token(encode, marker) for marker in (OPEN, CLOSE)))
    return JSON


def _token(encode: Callable[[str], list[int]] | None, text: str) -> int | None:
    """The id of the one token that is `text`, or None where it is spelled in several."""
    ids = encode(text) if encode is not None else []
    return ids[0] if len(ids) == 1 else None


# ---- the JSON format (templates with no tool markup) -------------------------------------------------------


class JsonTools:
    name = "json"

    def history(self, content: str, calls: list[dict[str, Any]]) -> dict[str, Any]:
        return {"role": "assistant", "content": calls_as_text(content, calls)}

    def render(self, messages: list[dict[str, Any]], tools: Tools) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        return with_tools(messages, tools), {}

    def grammar(self, tools: Tools) -> ResponseFormat:
        return ResponseFormat("json_schema", schema=tools.schema())

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]] | None]:
        return reply(text)

    def stream(self) -> ToolStream:
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
# free text: anything that never opens a call (llguidance's `&` and `~` on terminals)
_TEXT = r"TEXT: /(?s:.+)/ & ~/(?s:.*)<tool_call>(?s:.*)/"
_CALLS = re.compile(r"\s*<tool_call>\s*(.*?)\s*</tool_call>", re.S)
# a call's head, up to its arguments' first character, once that has come (the grammar puts "name" first)
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\S)')
# A call's JSON exactly as the template writes earlier calls (`tojson`: ", " and ": ", nothing else between
# tokens): the model's own style, and no room to pad. oneOf is read as anyOf, as in response formats.
_CALL_JSON = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False, "coerce_one_of": True}


class HermesTools:
    """`open_id`, `close_id`: the tokens `<tool_call>` and `</tool_call>` are, where each is one (Qwen's added
    tokens); llguidance reads an added token as special, never as its text, so the grammar names it by id, beside
    the text spelled out."""

    name = "hermes"

    def __init__(self, open_id: int | None = None, close_id: int | None = None):
        self.open_id = open_id
        self.close_id = close_id

    def history(self, content: str, calls: list[dict[str, Any]]) -> dict[str, Any]:
        return {"role": "assistant", "content": content,
                "tool_calls": [{"type": "function", "function": c} for c in calls]}

    def render(self, messages: list[dict[str, Any]], tools: Tools) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        return messages, {"tools": [{"type": "function", "function": f} for f in tools.offered()]}

    def grammar(self, tools: Tools) -> ResponseFormat:
        """`<tool_call>\\n` + one offered function's call as JSON (its schema via `%json`, in the template's own
        style) + `\\n</tool_call>`, more such blocks (newline-separated) when parallel calls are allowed. Under
        "auto" the reply may instead be text that never opens a call, or text and then calls; otherwise it begins
        with the call."""
        calls, defs = tools.call_schemas()
        one = calls[0] if len(calls) == 1 else {"anyOf": calls}
        body = json.dumps({**one, **({"$defs": defs} if defs else {}), "x-guidance": _CALL_JSON})
        rules = [f"call: %json {body}", f"open: {_marker(OPEN, self.open_id)}",
                 f"close: {_marker(CLOSE, self.close_id)}", r'block: "\n" call "\n" close']
        more = r' ("\n" open block)*' if tools.many else ""
        if tools.choice == "auto":
            # text ends where a call's token comes; spelled out, "<tool_call>" ends the lazy `opening`
            starts = ["TEXT", f"opening block{more}"]
            if self.open_id is not None:
                starts.append(f"TEXT? <[{self.open_id}]> block{more}")
            rules += ["start: " + " | ".join(starts), "opening[lazy]: /(?s:.*?)<tool_call>/", _TEXT]
        else:
            rules.append(f"start: open block{more}")
        return ResponseFormat("lark", grammar="\n".join(rules))

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]] | None]:
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

    def stream(self) -> ToolStream:
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
        self.held = ""  # text's trailing whitespace
        self.before = ""  # the whitespace held when the first call opened
        self.value = _ValueEnd()

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
                    keep = 0 if final else _partial(self.buf, OPEN)
                    self._text(self.buf[:len(self.buf) - keep], out, final)
                    self.buf = self.buf[len(self.buf) - keep:]
                    return out
                self._text(self.buf[:i], out, False)
                self.before, self.held, self.buf, self.mode = self.held, "", self.buf[i + len(OPEN):], "head"
            elif self.mode == "head":
                m = _HEAD.match(self.buf)
                if m is None:
                    if final and self.index < 0:
                        out.append(Delta(content=self.before + OPEN + self.buf))
                    return out
                self.index += 1
                self.called = True
                out.append(Delta(call={**openai_call(json.loads(f'"{m.group(1)}"'), ""), "index": self.index}))
                self.buf, self.mode, self.value = self.buf[m.end():], "arguments", _ValueEnd()
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

    def _text(self, text: str, out: list[Delta], final: bool) -> None:
        text = self.held + text
        self.held = ""
        if not final:
            stripped = text.rstrip()
            self.held, text = text[len(stripped):], stripped
        if text:
            out.append(Delta(content=text))


def _marker(text: str, token_id: int | None) -> str:
    """A Lark rule's body for a marker: its token, or its text."""
    return f'<[{token_id}]> | "{text}"' if token_id is not None else f'"{text}"'


def _partial(text: str, marker: str) -> int:
    """The length of the longest end of `text` that `marker` begins with."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class _ValueEnd:
    """Where one JSON value ends, read in pieces: strings and escapes, nesting depth."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.begun = False

    def scan(self, text: str) -> int | None:
        """The index in `text` just past the value's end, or None when it goes on past `text`."""
        for i, c in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
                    if self.depth == 0:
                        return i + 1
            elif c == '"':
                self.in_string = self.begun = True
            elif c in "{[":
                self.depth += 1
                self.begun = True
            elif c in "}]":
                self.depth -= 1
                if self.depth <= 0:  # the value's own close, or (a scalar before it) the call's
                    return i + 1 if self.depth == 0 else i
            elif self.depth == 0 and self.begun and c in ", \t\r\n":
                return i
            else:
                self.begun = True
        return None


JSON = JsonTools()
