"""What every tool-call format shares: the `ToolFormat` protocol, the streamed pieces (`Delta`), and the small
readers and grammar pieces several formats use (a marker as a token or text, text that never opens a call, where a
JSON value ends)."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from mlx_engine.api import ResponseFormat

from app.toolcalls.tools import Tools

# A call's JSON exactly as templates write earlier calls (`tojson`: ", " and ": ", nothing else between tokens): the
# model's own style, and no room to pad. oneOf is read as anyOf, as in response formats.
CALL_JSON = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False, "coerce_one_of": True}


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

    def conversation(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The whole conversation (its calling turns from `history`, results as `tool` messages) as the template
        needs it, tools offered or not: Mistral's ties each result to its call by an id, Llama's renders one call a
        turn."""
        ...

    def render(self, messages: list[dict[str, Any]], tools: Tools) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The conversation offering `tools`, and the chat template's extra variables."""
        ...

    def grammar(self, tools: Tools) -> ResponseFormat | None:
        """What the reply is held to (None: nothing; the model writes its own format)."""
        ...

    def parse(self, text: str, tools: Tools | None = None) -> tuple[str | None, list[dict[str, Any]] | None]:
        """A whole reply -> (content, None) or (content or None, OpenAI tool_calls with fresh ids). A reply cut
        short is its text. `tools`: what was offered, for a format whose text does not say a value's type."""
        ...

    def stream(self, tools: Tools | None = None) -> ToolStream:
        """A reader for one reply as it streams."""
        ...


def token(encode: Callable[[str], list[int]] | None, text: str) -> int | None:
    """The id of the one token that is `text`, or None where it is spelled in several."""
    ids = encode(text) if encode is not None else []
    return ids[0] if len(ids) == 1 else None


def marker(text: str, token_id: int | None) -> str:
    """A Lark rule's body for a marker: its token, or its text. llguidance reads an added token as special, never as
    its text, so where the marker is a token the grammar names it by id beside the text spelled out."""
    return f'<[{token_id}]> | {lark_string(text)}' if token_id is not None else lark_string(text)


def lark_string(text: str) -> str:
    """`text` as a Lark string literal."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def text_or_calls(open_text: str, open_id: int | None, calls: str) -> list[str]:
    """Rules for "auto": the reply is text that never opens a call, or text and then `calls` (a rule body that
    follows the opening marker). Text ends where the marker's token comes; spelled out, the marker ends the lazy
    `opening`."""
    escaped = re.escape(open_text).replace("/", "\\/")
    starts = ["TEXT", f"opening {calls}"]
    if open_id is not None:
        starts.append(f"TEXT? <[{open_id}]> {calls}")
    return ["start: " + " | ".join(starts), f"opening[lazy]: /(?s:.*?){escaped}/",
            f"TEXT: /(?s:.+)/ & ~/(?s:.*){escaped}(?s:.*)/"]  # llguidance's `&` and `~` on terminals


def partial(text: str, mark: str) -> int:
    """The length of the longest end of `text` that `mark` begins with."""
    for n in range(min(len(mark) - 1, len(text)), 0, -1):
        if mark.startswith(text[-n:]):
            return n
    return 0


class ThroughTemplate:
    """What a format whose chat template renders tools itself shares: earlier calls as `message.tool_calls`, the
    offered tools as the template's `tools` variable, the conversation as it is."""

    def history(self, content: str, calls: list[dict[str, Any]]) -> dict[str, Any]:
        return {"role": "assistant", "content": content,
                "tool_calls": [{"type": "function", "function": c} for c in calls]}

    def conversation(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return messages

    def render(self, messages: list[dict[str, Any]], tools: Tools) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        return messages, {"tools": [{"type": "function", "function": f} for f in tools.offered()]}


class HeldText:
    """Text as it streams, but for its trailing whitespace (dropped where a call follows, as `parse` strips it)."""

    def __init__(self) -> None:
        self.held = ""

    def emit(self, text: str, out: list[Delta], final: bool) -> None:
        text = self.held + text
        self.held = ""
        if not final:
            stripped = text.rstrip()
            self.held, text = text[len(stripped):], stripped
        if text:
            out.append(Delta(content=text))


class ValueEnd:
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
                if self.depth <= 0:  # the value's own close, or (a scalar before it) the enclosing object's
                    return i + 1 if self.depth == 0 else i
            elif self.depth == 0 and self.begun and c in ", \t\r\n":
                return i
            else:
                self.begun = True
        return None
