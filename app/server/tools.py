"""Tool calling: OpenAI's `tools`, `tool_choice` and `parallel_tool_calls` (`parse_tools` -> `Tools`), and the JSON
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

from app.server.errors import invalid
from app.server.schemas import closed, has_local_refs, rebased, schema_error

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


def parse_tools(body: dict[str, Any]) -> Tools | None:
    """`tools`, `tool_choice` and `parallel_tool_calls` of a chat request -> Tools, or None when none are offered
    (no tools, or tool_choice "none": the model replies in plain text). Raises APIError (400)."""
    for name in ("functions", "function_call"):
        if body.get(name) is not None:
            raise invalid(f"'{name}' (deprecated by OpenAI) is not supported: send 'tools' and 'tool_choice'", name,
                          "unsupported_value")
    tools, choice, parallel = body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise invalid(f"'parallel_tool_calls' must be a boolean, got {type(parallel).__name__}", "parallel_tool_calls")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise invalid("'tool_choice' needs 'tools': no function is offered", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise invalid("'tools' must be an array of {'type': 'function', 'function': {...}}", "tools")
    functions = []
    for i, t in enumerate(tools):
        p = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise invalid(f"'{p}' must be an object like {{'type': 'function', 'function': {{'name': ...}}}}", p)
        fn = t["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            raise invalid(f"'{p}.function.name' must be 1-64 letters, digits, '_', '-' or '.', got {name!r}",
                          f"{p}.function.name")
        if any(f["name"] == name for f in functions):
            raise invalid(f"'{p}.function.name': {name!r} is offered twice", f"{p}.function.name")
        description = fn.get("description")
        if description is not None and not isinstance(description, str):
            raise invalid(f"'{p}.function.description' must be a string", f"{p}.function.description")
        parameters = fn.get("parameters", EMPTY_PARAMETERS)
        if not isinstance(parameters, dict):
            raise invalid(f"'{p}.function.parameters' must be a JSON Schema object", f"{p}.function.parameters")
        strict = fn.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise invalid(f"'{p}.function.strict' must be a boolean", f"{p}.function.strict")
        parameters = closed(parameters or EMPTY_PARAMETERS, require_all=bool(strict))
        error = schema_error(parameters)
        if error is not None:
            raise invalid(f"'{p}.function.parameters' is not a JSON Schema a reply can be held to: {error}",
                          f"{p}.function.parameters", "invalid_schema")
        functions.append({"name": name, **({"description": description} if description else {}),
                          "parameters": parameters})
    if choice is None or choice == "auto":
        mode = "auto"
    elif choice == "none":
        return None
    elif choice == "required":
        mode = "required"
    elif (isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict)
          and isinstance(choice["function"].get("name"), str)):
        mode = choice["function"]["name"]
        if not any(f["name"] == mode for f in functions):
            raise invalid(f"'tool_choice' names {mode!r}, which is not among the tools", "tool_choice")
    else:
        raise invalid("'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', 'function': "
                      "{'name': ...}}", "tool_choice")
    return Tools(tuple(functions), mode, bool(parallel))  # one call a reply unless asked (llama.cpp's default)


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


def history_calls(tool_calls: Any, param: str) -> list[dict[str, Any]]:
    """An assistant message's `tool_calls` (OpenAI's shape) -> [{"name", "arguments"}], the arguments parsed (or, not
    being JSON, the text the client sent). Raises APIError naming `param`."""
    if not isinstance(tool_calls, list) or not tool_calls:
        raise invalid(f"'{param}' must be a non-empty array of tool calls", param)
    calls = []
    for j, c in enumerate(tool_calls):
        q = f"{param}[{j}]"
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments"), str):
            raise invalid(f"'{q}' must be like {{'id': ..., 'type': 'function', 'function': {{'name': ..., "
                          "'arguments': '<JSON text>'}}", q)
        try:
            arguments = json.loads(fn["arguments"]) if fn["arguments"].strip() else {}
        except ValueError:
            arguments = fn["arguments"]  # as the client sent it
        calls.append({"name": fn["name"], "arguments": arguments})
    return calls


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
