"""Qwen3-Coder's XML tool calls, for templates that write `<function=` and `<parameter=` inside `<tool_call>`.

The template lists the offered tools (its `tools` variable, as `<function><name>...` XML in the system message),
renders earlier calls (`message.tool_calls`, each argument as a `<parameter=NAME>` block: a string as it is, anything
else as JSON) and results (`tool` messages inside `<tool_response>` in a user turn). The model answers

    <tool_call>
    <function=NAME>
    <parameter=ARG>
    value
    </parameter>
    </function>
    </tool_call>

A value's type is the offered function's schema's: a string parameter's value is raw text (up to the first
`\\n</parameter>`), one with an enum or const of strings one of those strings, anything else JSON held to the
parameter's schema (`%json`). Reading a reply back, that schema says which values are text, so `parse` and `stream`
take the offered tools; without them a value that reads as JSON is taken as JSON.
"""

from __future__ import annotations

import json
import re
from typing import Any

from mlx_engine.api import ResponseFormat

from app.toolcalls.formats.base import (CALL_JSON, Delta, HeldText, ThroughTemplate, ToolStream, lark_string, marker,
                                        partial, text_or_calls)
from app.toolcalls.schemas import has_local_refs, rebased
from app.toolcalls.tools import Tools, openai_call

OPEN, CLOSE = "<tool_call>", "</tool_call>"
END = "\n</parameter>"
_CALL = re.compile(r"\s*<tool_call>\s*<function=([^>\n]+)>\n")
_CALL_END = re.compile(r"\s*</function>\s*</tool_call>")
_PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>\n(.*?)\n</parameter>", re.S)
_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>\n")
_NEXT = re.compile(r"\s*(?:<parameter=([^>\n]+)>\n|(</function>))")


class QwenCoderTools(ThroughTemplate):
    """`open_id`, `close_id`: the tokens `<tool_call>` and `</tool_call>` are, where each is one (Qwen's added
    tokens)."""

    name = "qwen3_coder"

    def __init__(self, open_id: int | None = None, close_id: int | None = None):
        self.open_id = open_id
        self.close_id = close_id

    def grammar(self, tools: Tools) -> ResponseFormat:
        """`<tool_call>`, one offered function's `<function=NAME>` block with its parameters in the schema's order
        (the required ones, each optional one or not), `</tool_call>`; more such blocks (newline-separated) when
        parallel calls are allowed. Under "auto" the reply may instead be text that never opens a call, or text and
        then calls; otherwise it begins with the call."""
        rules = [f"open: {marker(OPEN, self.open_id)}", f"close: {marker(CLOSE, self.close_id)}",
                 r"raw[lazy]: /(?s:.*?)\n<\/parameter>/"]  # text up to the first "\n</parameter>"
        names = []
        for i, f in enumerate(tools.offered()):
            body, extra = _parameters(f["parameters"], f"f{i}")
            rules += extra
            head = lark_string(f"<function={f['name']}>\n")
            rules.append(f'f{i}: {head} {body} "</function>"')
            names.append(f"f{i}")
        rules.append(rf'block: "\n" ({" | ".join(names)}) "\n" close')
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
        while (m := _CALL.match(text, at)) is not None:
            name, arguments, at = m.group(1), {}, m.end()
            while (p := _PARAMETER.match(text, at)) is not None:  # a value ends at its first "\n</parameter>"
                arguments[p.group(1)] = value(p.group(2), _schema(tools, name, p.group(1)))
                at = p.end()
            if (end := _CALL_END.match(text, at)) is None:
                return text, None
            calls.append(openai_call(name, arguments))
            at = end.end()
        if not calls or text[at:].strip():  # cut short inside a call
            return text, None
        return text[:start].rstrip() or None, calls

    def stream(self, tools: Tools | None = None) -> ToolStream:
        return _CoderStream(tools)


def _parameters(schema: dict[str, Any], rule: str) -> tuple[str, list[str]]:
    """A function's parameters as a Lark rule body (each block in the schema's order, optional ones with `?`) and
    the rules it uses. A schema that leaves its object open (or names no properties but is not closed) takes any
    further parameter as raw text."""
    props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    required = set(schema.get("required") or [])
    parts, rules = [], []
    for j, (name, prop) in enumerate(props.items()):
        head = lark_string(f"<parameter={name}>\n")
        if _raw(prop):
            body = "raw"
        elif _strings(prop) is not None:
            body = "(" + " | ".join(lark_string(s) for s in _strings(prop)) + r') "\n</parameter>"'
        else:
            rules.append(f"{rule}_{j}: %json {json.dumps({**_alone(schema, name), 'x-guidance': CALL_JSON})}")
            body = rf'{rule}_{j} "\n</parameter>"'
        parts.append(f'({head} {body} "\\n")' + ("" if name in required else "?"))
    if schema.get("additionalProperties", True) is not False:
        parts.append(r'("<parameter=" /[A-Za-z0-9_.-]+/ ">\n" raw "\n")*')
    return " ".join(parts) or '""', rules


def _alone(schema: dict[str, Any], name: str) -> dict[str, Any]:
    """Parameter `name`'s schema as a schema of its own. One that refers into the parameters' schema (pydantic's
    `$defs`, or "#" for recursion) points into a copy of that schema under `$defs`, its references rebased there:
    on its own, "#" would be the parameter and "#/$defs/..." would not exist."""
    prop = schema["properties"][name]
    if not has_local_refs(prop):
        return prop
    pointer = name.replace("~", "~0").replace("/", "~1")
    return {"$ref": f"#/$defs/p/properties/{pointer}", "$defs": {"p": rebased(schema, "#/$defs/p")}}


def _strings(schema: Any) -> list[str] | None:
    """The strings a schema allows where it lists them (an enum or const of strings only), else None."""
    if not isinstance(schema, dict):
        return None
    options = schema["enum"] if isinstance(schema.get("enum"), list) else [schema["const"]] if "const" in schema \
        else None
    return options if options and all(isinstance(o, str) for o in options) else None


def _raw(schema: Any) -> bool:
    """Whether a parameter's value is written as raw text: a string, not one of listed strings."""
    return isinstance(schema, dict) and schema.get("type") == "string" and _strings(schema) is None


def _schema(tools: Tools | None, function: str, parameter: str) -> Any:
    """The offered schema of `function`'s `parameter`: None where the tools are not known, {} where it has none."""
    if tools is None:
        return None
    for f in tools.functions:
        if f["name"] == function:
            props = f["parameters"].get("properties")
            return props.get(parameter, {}) if isinstance(props, dict) else {}
    return {}


def value(text: str, schema: Any) -> Any:
    """A parameter's text as its value: text for a string parameter (or one of listed strings), else JSON (Python's
    True and False as the template's `string` filter writes booleans); text that is not JSON stays text."""
    if schema is not None and (_raw(schema) or _strings(schema) is not None):
        return text
    if schema is not None and text in ("True", "False"):
        return text == "True"
    try:
        return json.loads(text)
    except ValueError:
        return text


class _CoderStream:
    """Text streams as it comes, but for a tail that may be the start of `<tool_call>` and whitespace before it. A
    call streams its id and name once `<function=NAME>` is read, then its arguments as JSON text: each parameter's
    key when its block opens, a string value's text as it is generated (JSON-escaped, but for a tail that may be
    the start of `\\n</parameter>`), any other value once its block closes, "}" at `</function>`. The arguments add
    up to the JSON `parse` gives. A reply cut short before its first call's name is its text at the end."""

    def __init__(self, tools: Tools | None) -> None:
        self.tools = tools
        self.buf = ""
        self.mode = "text"  # text | function | next | value | close
        self.called = False
        self.index = -1
        self.text = HeldText()
        self.before = ""  # the whitespace held when the first call opened
        self.name = ""
        self.keys = 0  # parameters opened in the current call
        self.schema: Any = None  # the open parameter's

    def feed(self, text: str) -> list[Delta]:
        self.buf += text
        return self._run(False)

    def finish(self) -> list[Delta]:
        return self._run(True)

    def _arguments(self, out: list[Delta], piece: str) -> None:
        if piece:
            out.append(Delta(call={"index": self.index, "function": {"arguments": piece}}))

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
                self.before, self.text.held = self.text.held, ""
                self.buf, self.mode = self.buf[i + len(OPEN):], "function"
            elif self.mode == "function":
                m = _FUNCTION.match(self.buf)
                if m is None:
                    if final and self.index < 0:
                        out.append(Delta(content=self.before + OPEN + self.buf))
                    return out
                self.index += 1
                self.called = True
                self.name, self.keys = m.group(1), 0
                out.append(Delta(call={**openai_call(self.name, ""), "index": self.index}))
                self.buf, self.mode = self.buf[m.end():], "next"
            elif self.mode == "next":  # a parameter's block, or the function's end
                m = _NEXT.match(self.buf)
                if m is None:
                    return out
                self.buf = self.buf[m.end():]
                if m.group(2):
                    self._arguments(out, "}" if self.keys else "{}")
                    self.mode = "close"
                    continue
                self._arguments(out, ("{" if not self.keys else ", ") + json.dumps(m.group(1), ensure_ascii=False)
                                + ": " + ('"' if _raw(self._open(m.group(1))) else ""))
                self.keys += 1
                self.mode = "value"
            elif self.mode == "value":
                i = self.buf.find(END)
                raw = _raw(self.schema)
                if i < 0:
                    if raw:
                        keep = 0 if final else partial(self.buf, END)
                        self._arguments(out, json.dumps(self.buf[:len(self.buf) - keep], ensure_ascii=False)[1:-1])
                        self.buf = self.buf[len(self.buf) - keep:]
                    return out
                text, self.buf = self.buf[:i], self.buf[i + len(END):]
                whole = json.dumps(text if raw else value(text, self.schema), ensure_ascii=False)
                self._arguments(out, whole[1:] if raw else whole)
                self.mode = "next"
            else:  # after </function>: </tool_call>, then another call or nothing
                i = self.buf.find(CLOSE)
                if i < 0:
                    return out
                rest = self.buf[i + len(CLOSE):].lstrip()
                if rest.startswith(OPEN):
                    self.buf, self.mode = rest[len(OPEN):], "function"
                elif final or (rest and not OPEN.startswith(rest)):
                    self.buf, self.mode = rest, "text"  # what the grammar allows no more: text, as it came
                else:
                    return out

    def _open(self, parameter: str) -> Any:
        self.schema = _schema(self.tools, self.name, parameter)
        return self.schema
