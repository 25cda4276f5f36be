"""OpenAI's tool fields of a chat request: `tools`, `tool_choice` and `parallel_tool_calls` -> `Tools`, and the
`tool_calls` of earlier assistant messages; errors as 400s naming the field. What the tools become (the model's
tool-call format, the grammar) is `app.toolcalls`', shared with the chat app."""

from __future__ import annotations

import json
from typing import Any

from app.server.errors import invalid
from app.toolcalls.tools import Tools, ToolSpecError, function_spec


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
        if any(f["name"] == name for f in functions):
            raise invalid(f"'{p}.function.name': {name!r} is offered twice", f"{p}.function.name")
        try:
            functions.append(function_spec(fn, f"{p}.function"))
        except ToolSpecError as e:
            raise invalid(e.message, e.param, e.code) from None
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
