"""Llama 3.1 / 3.2 / 3.3's JSON tool calls, for templates that list tools for an `ipython` environment and ask for
`{"name": function name, "parameters": dictionary of argument name and its value}`.

The template renders the offered tools (its `tools` variable, by default in the first user message:
`tools_in_user_message`), an earlier call (`message.tool_calls`, one a turn: the template raises on more) and results
(`tool` messages, rendered as `ipython` turns). The model answers a call as the whole reply, `{"name": ...,
"parameters": {...}}`, ended by `<|eot_id|>` (or `<|eom_id|>` in Llama 3.1's built-in-tool mode), sometimes after
`<|python_tag|>`. Built-in tools (`brave_search.call(query=...)` after `<|python_tag|>`) are not offered here.
"""

from __future__ import annotations

import json
import re
from typing import Any

from mlx_engine.api import ResponseFormat

from app.toolcalls.formats.base import CALL_JSON, Delta, ToolStream, ValueEnd, partial
from app.toolcalls.tools import Tools, openai_call

PYTHON_TAG = "<|python_tag|>"
# a call's head, up to its parameters' first character, once that has come (the grammar puts "name" first)
_HEAD = re.compile(r'\s*(?:<\|python_tag\|>)?\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,'
                   r'\s*"(?:parameters|arguments)"\s*:\s*(?=\S)')
# how long a reply that opens with "{" may be before its head is read: longer, it is not a call's (names are <= 64)
_HEAD_MAX = 160


class LlamaTools:
    """`tag_id`: the token `<|python_tag|>` is, where it is one (Llama 3's special tokens); the grammar lets a call
    begin with it, as Llama 3.1 sometimes writes, by id only (spelled out it is text the model never writes)."""

    name = "llama3"

    def __init__(self, tag_id: int | None = None):
        self.tag_id = tag_id

    def history(self, content: str, calls: list[dict[str, Any]]) -> dict[str, Any]:
        return {"role": "assistant", "content": content,
                "tool_calls": [{"type": "function", "function": c} for c in calls]}

    def conversation(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for m in messages:
            if m["role"] == "assistant" and m.get("tool_calls"):
                # the template renders a calling turn's one call and nothing else: text first as its own turn,
                # parallel calls as a turn each
                if m.get("content"):
                    out.append({"role": "assistant", "content": m["content"]})
                out += [{"role": "assistant", "content": "", "tool_calls": [c]} for c in m["tool_calls"]]
            elif m["role"] == "tool":
                out.append({**m, "content": _result(m["content"])})
            else:
                out.append(m)
        return out

    def render(self, messages: list[dict[str, Any]], tools: Tools) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        return messages, {"tools": [{"type": "function", "function": f} for f in tools.offered()]}

    def grammar(self, tools: Tools) -> ResponseFormat:
        """One offered function's call as the template writes one (`{"name": ..., "parameters": ...}`, its schema
        via `%json`), perhaps after `<|python_tag|>`; one call a reply whatever `parallel_tool_calls` says (the
        template renders one call a turn). Under "auto" the reply may instead be text that does not open with "{"."""
        calls, defs = tools.call_schemas()
        calls = [{**c, "properties": {"name": c["properties"]["name"], "parameters": c["properties"]["arguments"]},
                  "required": ["name", "parameters"]} for c in calls]
        one = calls[0] if len(calls) == 1 else {"anyOf": calls}
        body = json.dumps({**one, **({"$defs": defs} if defs else {}), "x-guidance": CALL_JSON})
        rules = [f"call: %json {body}"]
        call = f"<[{self.tag_id}]>? call" if self.tag_id is not None else "call"
        if tools.choice == "auto":
            rules += [f"start: TEXT | {call}", r"TEXT: /(?s:.+)/ & ~/\s*\{(?s:.*)/"]
        else:
            rules.append(f"start: {call}")
        return ResponseFormat("lark", grammar="\n".join(rules))

    def parse(self, text: str, tools: Tools | None = None) -> tuple[str | None, list[dict[str, Any]] | None]:
        body = text.strip()
        if body.startswith(PYTHON_TAG):
            body = body[len(PYTHON_TAG):].lstrip()
        if not body.startswith("{"):
            return text, None
        try:
            call = json.loads(body)
        except ValueError:
            return text, None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return text, None
        # "arguments": what Llama 3.2 writes at times, and what vLLM's reader takes too
        key = "parameters" if "parameters" in call else "arguments" if "arguments" in call else None
        if key is None:
            return text, None
        return None, [openai_call(call["name"], call[key])]

    def stream(self, tools: Tools | None = None) -> ToolStream:
        return _LlamaStream()


def _result(content: Any) -> Any:
    """A tool's result for the template: one that is a JSON object or array as its value. The template quotes any
    string as JSON (a string is iterable to Jinja), so a JSON result would reach the model escaped; Meta's examples
    show the object."""
    if isinstance(content, str) and content.lstrip()[:1] in ("{", "["):
        try:
            return json.loads(content)
        except ValueError:
            pass
    return content


class _LlamaStream:
    """A reply is a call or text, told by its start: text streams as it comes once its first character is not "{"
    (or `<|python_tag|>`); a call streams its id and name once its head is read, then its parameters' JSON text.
    A reply that opens like a call but never reads as one is its text at the end, as `parse` gives it."""

    def __init__(self) -> None:
        self.buf = ""
        self.mode = "start"  # start | text | arguments | done
        self.called = False
        self.value = ValueEnd()

    def feed(self, text: str) -> list[Delta]:
        self.buf += text
        return self._run(False)

    def finish(self) -> list[Delta]:
        return self._run(True)

    def _run(self, final: bool) -> list[Delta]:
        out: list[Delta] = []
        if self.mode == "start":
            lead = self.buf.lstrip()
            opens = lead.startswith(("{", PYTHON_TAG)) or (lead and partial(lead, PYTHON_TAG) == len(lead))
            if lead and not opens:
                self.mode = "text"
            elif (m := _HEAD.match(self.buf)) is not None:
                self.called = True
                out.append(Delta(call={**openai_call(json.loads(f'"{m.group(1)}"'), ""), "index": 0}))
                self.buf, self.mode = self.buf[m.end():], "arguments"
            elif final or len(self.buf) > _HEAD_MAX:
                self.mode = "text"
            else:
                return out
        if self.mode == "text":
            if self.buf:
                out.append(Delta(content=self.buf))
            self.buf = ""
        elif self.mode == "arguments":
            end = self.value.scan(self.buf)
            piece = self.buf if end is None else self.buf[:end]
            if piece:
                out.append(Delta(call={"index": 0, "function": {"arguments": piece}}))
            self.buf = ""
            if end is not None:
                self.mode = "done"  # the call's "}" and the end of the reply
        return out
