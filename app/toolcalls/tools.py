"""Tool calling: the functions offered (`Tools`, each checked by `function_spec`; the server reads them from OpenAI's
`tools`, `tool_choice` and `parallel_tool_calls`, the chat app from MCP servers), and the JSON
format for models whose chat template has no tool markup (llama.cpp's "generic" tool-call format; `JsonTools` in
`tool_formats.py`, beside the models' own formats).

A system message tells the model which functions it may call and that it answers with one JSON object:
`{"tool_calls": [{"name": ..., "arguments": {...}}]}` to call functions, or `{"response": "..."}` to reply. The
engine's structured output holds the reply to that shape (a JSON Schema built from the tools' parameter schemas),
so every call names a declared function and its arguments are valid against that function's schema, even from a
135M model. The server turns the JSON back into OpenAI's message: `tool_calls` with finish_reason "tool_calls", or
`content`.

Earlier turns go back to the model in the same JSON: an assistant message's `tool_calls` become its content; tool
results keep the role "tool" (the chat template renders them). Streamed, a plain reply's text goes out as it is
generated (`ReplyStream`); calls go out whole once their JSON is complete.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from app.toolcalls.schemas import closed, has_local_refs, rebased, schema_error

NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class Tools:
    """The functions a request offers, and what it asks: `choice` is "auto" (call or reply), "required" (call at
    least one) or the name of the one function to call."""

    functions: tuple[dict[str, Any], ...]  # {"name", "description", "parameters"}
    choice: str = "auto"
    parallel: bool = False

    def offered(self) -> list[dict[str, Any]]:
        """The functions the model may call: all of them, or the one `choice` names."""
        if self.choice in ("auto", "required"):
            return list(self.functions)
        return [f for f in self.functions if f["name"] == self.choice]

    @property
    def many(self) -> bool:
        """Whether a reply may hold several calls."""
        return self.parallel and self.choice in ("auto", "required")

    def call_schemas(self) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """One JSON Schema per offered function for one call, `{"name": <it>, "arguments": {...}}`, and the `$defs`
        they refer to, for the root of the schema that holds them. A function whose parameters refer into themselves
        (pydantic's `$defs` and `"$ref": "#/$defs/Address"`, or "#" for recursion) has them under those `$defs`,
        named after the function, its references rewritten to point there: inline, they would resolve against the
        bigger schema's root."""
        calls, defs = [], {}
        for f in self.offered():
            arguments = f["parameters"]
            if has_local_refs(arguments):
                defs[f["name"]] = rebased(arguments, f"#/$defs/{f['name']}")  # a NAME needs no escaping in a pointer
                arguments = {"$ref": f"#/$defs/{f['name']}"}
            calls.append({"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": arguments},
                          "required": ["name", "arguments"], "additionalProperties": False})
        return calls, defs

    def schema(self) -> dict[str, Any]:
        """The JSON Schema a reply in the JSON format is held to: `{"tool_calls": [...]}`, or under "auto"
        `{"response": "..."}` too."""
        calls, defs = self.call_schemas()
        array: dict[str, Any] = {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
                                 "minItems": 1}
        if not self.many:
            array["maxItems"] = 1
        call = {"type": "object", "properties": {"tool_calls": array}, "required": ["tool_calls"],
                "additionalProperties": False}
        reply = {"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"],
                 "additionalProperties": False}
        schema = call if self.choice != "auto" else {"anyOf": [call, reply]}
        return {**schema, "$defs": defs} if defs else schema

    def system_prompt(self) -> str:
        listed = json.dumps([{k: f[k] for k in ("name", "description", "parameters") if k in f}
                             for f in self.offered()], ensure_ascii=False)
        call = '{"tool_calls": [{"name": "<function name>", "arguments": {<its arguments>}}]}'
        lines = [f"You can call these functions (their arguments as JSON Schema): {listed}",
                 "Answer with one JSON object only."]
        if self.choice == "auto":
            lines.append(f'To call functions, answer {call}. To reply to the user directly, answer '
                         '{"response": "<your reply>"}.')
        else:
            lines.append(f"Call {'a function' if self.choice == 'required' else self.choice}: answer {call}.")
        return "\n".join(lines)


class ToolSpecError(ValueError):
    """A function's declaration that cannot be offered: `message` names the field (`param`); `code` is OpenAI's."""

    def __init__(self, message: str, param: str, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


def function_spec(fn: dict[str, Any], where: str) -> dict[str, Any]:
    """One declared function ({"name", "description", "parameters", "strict"}) -> {"name", "description",
    "parameters"} as offered: its objects closed, its schema checked against the grammar. `where` names it in errors
    ("tools[0].function"). Raises ToolSpecError."""
    name = fn.get("name")
    if not isinstance(name, str) or not NAME.match(name):
        raise ToolSpecError(f"'{where}.name' must be 1-64 letters, digits, '_', '-' or '.', got {name!r}",
                            f"{where}.name")
    description = fn.get("description")
    if description is not None and not isinstance(description, str):
        raise ToolSpecError(f"'{where}.description' must be a string", f"{where}.description")
    parameters = fn.get("parameters", EMPTY_PARAMETERS)
    if not isinstance(parameters, dict):
        raise ToolSpecError(f"'{where}.parameters' must be a JSON Schema object", f"{where}.parameters")
    strict = fn.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise ToolSpecError(f"'{where}.strict' must be a boolean", f"{where}.strict")
    parameters = closed(parameters or EMPTY_PARAMETERS, require_all=bool(strict))
    error = schema_error(parameters)
    if error is not None:
        raise ToolSpecError(f"'{where}.parameters' is not a JSON Schema a reply can be held to: {error}",
                            f"{where}.parameters", "invalid_schema")
    return {"name": name, **({"description": description} if description else {}), "parameters": parameters}


# Follows the last of a run of tool results when the model may reply ("auto"). Without it a small model copies the
# turn before, its call, at temperature 0, and an agent loop never ends (docs/server.md has the measurements).
AFTER_RESULTS = "The function{s} {verb} answered. Tell the user the answer, or call another function if you still need one."


def with_tools(messages: list[dict[str, str]], tools: Tools) -> list[dict[str, str]]:
    """The conversation with the tools' instructions in its system message (added first where it has none), and
    under "auto" a line after each run of tool results saying the model may now answer (`AFTER_RESULTS`)."""
    prompt = tools.system_prompt()
    if messages and messages[0]["role"] == "system":
        out = [{"role": "system", "content": f"{messages[0]['content']}\n\n{prompt}"}, *messages[1:]]
    else:
        out = [{"role": "system", "content": prompt}, *messages]
    if tools.choice != "auto":
        return out
    run = 0
    for i, m in enumerate(out):
        run = run + 1 if m["role"] == "tool" else 0
        if run and (i + 1 == len(out) or out[i + 1]["role"] != "tool"):
            line = AFTER_RESULTS.format(s="s" if run > 1 else "", verb="have" if run > 1 else "has")
            out[i] = {**m, "content": f"{m['content']}\n\n{line}"}
    return out


def calls_as_text(content: str, calls: list[dict[str, Any]]) -> str:
    """Calls ([{"name", "arguments"}]) as the JSON the model answers with, after any text."""
    text = json.dumps({"tool_calls": calls}, ensure_ascii=False)
    return f"{content}\n{text}" if content else text


def openai_call(name: str, arguments: Any) -> dict[str, Any]:
    """One call as OpenAI's message carries it: a fresh id, `arguments` as JSON text (a string stays as it is)."""
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function", "function": {"name": name, "arguments": text}}


def reply(text: str) -> tuple[str | None, list[dict[str, Any]] | None]:
    """A grammar-held reply -> (content, None) or (None, OpenAI tool_calls with fresh ids). A reply cut short (by
    max_tokens or a stop string) is not whole JSON: a plain reply's text so far, or else the raw text."""
    try:
        value = json.loads(text)
    except ValueError:
        partial = ReplyStream()
        content = partial.feed(text)
        return (content if partial.mode in ("text", "done") else text), None
    if "tool_calls" in value:
        return None, [openai_call(c["name"], c["arguments"]) for c in value["tool_calls"]]
    return value["response"], None


_OPENING = re.compile(r'\{\s*"(response|tool_calls)"\s*:\s*("?)')


class ReplyStream:
    """A tool-calling reply as it is generated: once it is plainly `{"response": "...`, the string's text is
    streamed as it comes (JSON escapes decoded, a split escape held back); a call is left for the end. `mode`:
    None (undecided), "text", "done" (the string closed) or "calls"."""

    def __init__(self) -> None:
        self.buf = ""
        self.mode: str | None = None
        self.pos = 0

    def feed(self, text: str) -> str:
        """More of the reply -> the reply's text that is now complete (often "")."""
        self.buf += text
        if self.mode is None:
            m = _OPENING.match(self.buf)
            if m is None:  # its key is still to come (the grammar bounds the whitespace before it)
                if len(self.buf) > 128:
                    self.mode = "calls"  # not the tool-call JSON after all: left whole for the end
                return ""
            if m.group(1) == "tool_calls":
                self.mode = "calls"
                return ""
            if not m.group(2):  # the string's quote has not come yet
                return ""
            self.mode, self.pos = "text", m.end()
        if self.mode != "text":
            return ""
        i, buf = self.pos, self.buf
        while i < len(buf):
            c = buf[i]
            if c == '"':
                self.mode = "done"
                break
            if c == "\\":
                if i + 1 >= len(buf):
                    break
                if buf[i + 1] != "u":
                    i += 2
                    continue
                if i + 6 > len(buf):
                    break
                high = 0xD800 <= int(buf[i + 2:i + 6], 16) < 0xDC00
                if high and i + 12 > len(buf):  # the low half of a surrogate pair is still to come
                    break
                i += 12 if high and buf[i + 6:i + 8] == "\\u" else 6
                continue
            i += 1
        out = json.loads('"' + buf[self.pos:i] + '"') if i > self.pos else ""
        self.pos = i
        return out.encode("utf-8", "replace").decode("utf-8")  # a lone surrogate escape: not valid text
