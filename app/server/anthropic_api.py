"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`): request bodies -> the chat Job
that serves them, on the same engine path as chat completions.

As the Responses API does, a Messages body is translated to a chat-completions body and validated by `parse_job`, so
chat's rules, defaults, tool grammar and batching hold; errors name the Messages field. `system` becomes a system
message; a turn's content blocks become chat messages: text blocks the turn's text, `tool_use` blocks the assistant's
tool calls (in the model's tool-call format, as chat's: `tool_formats.py`), `tool_result` blocks tool messages (the chat
template renders them). `thinking` and `redacted_thinking` blocks are dropped: chat templates show earlier turns
without their reasoning. `tools` (`input_schema`) and `tool_choice` become chat tools, so a call is held to its
schema by the same grammar (tools.py). `thinking` maps onto the engine's reasoning contract: a budget is
`SamplingParams.reasoning_budget`, "disabled" the template's `enable_thinking: false`.

The model reads text only: image and document blocks are refused, naming the block. `thread` (a conversation held on
the server) is refused with the `error_code` on which the anthropic SDK sends the whole conversation instead.
`cache_control`, `metadata` and Anthropic's service fields are accepted and ignored (the engine's prefix cache reuses
every shared prefix anyway).
"""

from __future__ import annotations

import json
import re
from typing import Any

from app.server.errors import APIError, invalid
from app.server.fields import checked_text, kind_of
from app.server.protocol import Job, content_parts, parse_job
from app.toolcalls.tool_formats import JSON, ToolFormat

ROLES = ("user", "assistant")
THINKING_TYPES = ("enabled", "disabled", "adaptive")
TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}  # Anthropic's -> chat's; "tool" names one


class _Turns:
    """`system` and `messages` -> chat messages, with the Messages field each came from (`origin`, for errors)."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.origin: list[str] = []
        self.tool_use_ids: set[str] = set()

    def add(self, message: dict[str, Any], origin: str) -> None:
        self.messages.append(message)
        self.origin.append(origin)

    def system(self, system: Any) -> None:
        if isinstance(system, list):
            system = content_parts(system, "system")
        elif not isinstance(system, str):
            raise invalid(f"'system' must be a string or an array of text blocks, got {kind_of(system)}", "system")
        self.add({"role": "system", "content": system}, "system")

    def turn(self, m: Any, p: str, last: bool) -> None:
        if not isinstance(m, dict):
            raise invalid(f"'{p}' must be an object with 'role' and 'content', got {kind_of(m)}", p)
        role = m.get("role")
        if role not in ROLES:
            raise invalid(f"'{p}.role' must be 'user' or 'assistant', got {json.dumps(role)}", f"{p}.role")
        if role == "assistant" and last:
            raise invalid(f"'{p}': the conversation ends with an assistant turn, which Anthropic's API continues "
                          "(prefill); this server does not: end with a user turn", p, "unsupported_value")
        content = m.get("content")
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
        elif not isinstance(content, list):
            raise invalid(f"'{p}.content' must be a string or an array of content blocks, got {kind_of(content)}",
                          f"{p}.content")
        for j, block in enumerate(content):
            if not isinstance(block, dict) or not isinstance(block.get("type"), str):
                raise invalid(f"'{p}.content[{j}]' must be a content block like {{'type': 'text', 'text': ...}}",
                              f"{p}.content[{j}]")
        if role == "assistant":
            self._assistant(content, p)
        else:
            self._user(content, p)

    def _assistant(self, blocks: list[dict[str, Any]], p: str) -> None:
        texts, calls = [], []
        for j, block in enumerate(blocks):
            q, kind = f"{p}.content[{j}]", block["type"]
            if kind == "text":
                texts.append(_block_text(block, q))
            elif kind in ("thinking", "redacted_thinking"):
                continue  # earlier reasoning: templates render past turns without it
            elif kind == "tool_use":
                tool_id, name, arguments = block.get("id"), block.get("name"), block.get("input", {})
                if not isinstance(tool_id, str) or not tool_id or not isinstance(name, str):
                    raise invalid(f"'{q}' (tool_use) needs a string 'id' and 'name'", q)
                if not isinstance(arguments, dict):
                    raise invalid(f"'{q}.input' must be an object, got {kind_of(arguments)}", f"{q}.input")
                self.tool_use_ids.add(tool_id)
                calls.append({"id": tool_id, "type": "function",
                              "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}})
            else:
                raise _unsupported(kind, q, "an assistant turn", "text, thinking and tool_use")
        message: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
        if calls:
            message["tool_calls"] = calls
        self.add(message, p)

    def _user(self, blocks: list[dict[str, Any]], p: str) -> None:
        texts: list[str] = []
        for j, block in enumerate(blocks):
            q, kind = f"{p}.content[{j}]", block["type"]
            if kind == "text":
                texts.append(_block_text(block, q))
            elif kind == "tool_result":
                if texts:  # text before a result: its own turn, in order
                    self.add({"role": "user", "content": "\n".join(texts)}, p)
                    texts = []
                self.add(self._tool_result(block, q), q)
            else:
                raise _unsupported(kind, q, "a user turn", "text and tool_result")
        if texts:
            self.add({"role": "user", "content": "\n".join(texts)}, p)

    def _tool_result(self, block: dict[str, Any], q: str) -> dict[str, Any]:
        tool_id = block.get("tool_use_id")
        if not isinstance(tool_id, str):
            raise invalid(f"'{q}.tool_use_id' is required: the id of the tool_use block this result answers",
                          f"{q}.tool_use_id")
        if tool_id not in self.tool_use_ids:
            raise invalid(f"'{q}.tool_use_id' {json.dumps(tool_id)} answers no tool_use block of an earlier "
                          "assistant turn", f"{q}.tool_use_id")
        content = block.get("content", "")
        if isinstance(content, list):
            content = content_parts(content, f"{q}.content")
        elif not isinstance(content, str):
            raise invalid(f"'{q}.content' must be a string or an array of text blocks, got {kind_of(content)}",
                          f"{q}.content")
        is_error = block.get("is_error")
        if is_error is not None and not isinstance(is_error, bool):
            raise invalid(f"'{q}.is_error' must be a boolean, got {kind_of(is_error)}", f"{q}.is_error")
        return {"role": "tool", "tool_call_id": tool_id, "content": f"Error: {content}" if is_error else content}


def _block_text(block: dict[str, Any], q: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise invalid(f"'{q}.text' must be a string, got {kind_of(text)}", f"{q}.text")
    return text


def _unsupported(kind: str, q: str, where: str, allowed: str) -> APIError:
    if kind in ("image", "document"):
        return invalid(f"'{q}.type' is {kind!r}: this model reads text only; send the {kind}'s content as text",
                       f"{q}.type", "unsupported_content")
    return invalid(f"'{q}.type' {kind!r} is not supported in {where} (only {allowed} blocks are)", f"{q}.type",
                   "unsupported_content")


def _tools(body: dict[str, Any], chat: dict[str, Any]) -> None:
    """Anthropic's client tools and tool_choice -> chat's. One call a reply unless the client says
    `disable_parallel_tool_use: false` (chat's rule: a small model otherwise keeps appending calls)."""
    ts = body.get("tools")
    if ts is not None:
        if not isinstance(ts, list):
            raise invalid("'tools' must be an array of {'name', 'description', 'input_schema'}", "tools")
        chat["tools"] = []
        for i, t in enumerate(ts):
            p = f"tools[{i}]"
            if not isinstance(t, dict):
                raise invalid(f"'{p}' must be an object like {{'name': ..., 'input_schema': {{...}}}}", p)
            if t.get("type") not in (None, "custom"):
                raise invalid(f"'{p}.type' {t['type']!r} is not available: this server runs a local model and offers "
                              "client tools only ({'name', 'description', 'input_schema'})", f"{p}.type",
                              "unsupported_value")
            if t.get("input_schema") is None:
                raise invalid(f"'{p}.input_schema' is required: the tool's input as a JSON Schema object",
                              f"{p}.input_schema", "missing_required_parameter")
            fn = {"name": t.get("name"), "parameters": t["input_schema"]}
            fn.update({k: t[k] for k in ("description", "strict") if t.get(k) is not None})
            chat["tools"].append({"type": "function", "function": fn})
    choice = body.get("tool_choice")
    if choice is None:
        return
    if not isinstance(choice, dict) or choice.get("type") not in (*TOOL_CHOICES, "tool"):
        raise invalid("'tool_choice' must be {'type': 'auto'}, {'type': 'any'}, {'type': 'tool', 'name': ...} or "
                      "{'type': 'none'}", "tool_choice")
    if choice["type"] == "tool":
        if not isinstance(choice.get("name"), str):
            raise invalid("'tool_choice.name' is required with type 'tool': the name of the tool to call",
                          "tool_choice.name")
        chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    else:
        chat["tool_choice"] = TOOL_CHOICES[choice["type"]]
    disable = choice.get("disable_parallel_tool_use")
    if disable is not None and not isinstance(disable, bool):
        raise invalid(f"'tool_choice.disable_parallel_tool_use' must be a boolean, got {kind_of(disable)}",
                      "tool_choice.disable_parallel_tool_use")
    if disable is False:
        chat["parallel_tool_calls"] = True


def _output_format(body: dict[str, Any], chat: dict[str, Any]) -> None:
    """`output_config.format` ({"type": "json_schema", "schema"}) -> chat's response_format."""
    config = body.get("output_config")
    if config is None:
        return
    if not isinstance(config, dict):
        raise invalid(f"'output_config' must be an object, got {kind_of(config)}", "output_config")
    fmt = config.get("format")
    if fmt is None:
        return
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise invalid("'output_config.format' must be {'type': 'json_schema', 'schema': {...}}", "output_config.format")
    chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def _param(p: str | None, origin: list[str]) -> str | None:
    """A chat field named in a parse_job error -> the Messages field it came from."""
    if p is None:
        return None
    m = re.match(r"^messages\[(\d+)\]", p)
    if m:
        return origin[int(m.group(1))]
    p = re.sub(r"^tools\[(\d+)\]\.function\.parameters", r"tools[\1].input_schema", p)
    p = re.sub(r"^tools\[(\d+)\]\.function", r"tools[\1]", p)
    return re.sub(r"^response_format(\.json_schema)?(\.schema)?", "output_config.format", p)


def _stop_sequences(body: dict[str, Any]) -> tuple[str, ...]:
    v = body.get("stop_sequences")
    if v is None:
        return ()
    if not isinstance(v, list) or not all(isinstance(s, str) and s for s in v):
        raise invalid("'stop_sequences' must be an array of non-empty strings", "stop_sequences")
    return tuple(checked_text(s, "stop_sequences") for s in v)


def _thinking(body: dict[str, Any], job: Job, reasoning: str | None, max_tokens: int | None) -> None:
    """`thinking` -> the engine's reasoning contract. "enabled": at most `budget_tokens` of thinking (a model with
    reasoning only, and fewer than max_tokens, which counts them); "disabled": the template's thinking switched off;
    "adaptive" (or absent): the model's own default."""
    t = body.get("thinking")
    if t is None:
        return
    if not isinstance(t, dict) or t.get("type") not in THINKING_TYPES:
        raise invalid("'thinking' must be {'type': 'enabled', 'budget_tokens': N}, {'type': 'disabled'} or "
                      "{'type': 'adaptive'}", "thinking.type" if isinstance(t, dict) else "thinking")
    if t["type"] == "disabled":
        job.chat_template_kwargs = {"enable_thinking": False}
    if t["type"] != "enabled":
        return
    budget = t.get("budget_tokens")
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise invalid(f"'thinking.budget_tokens' must be an integer >= 1, got {json.dumps(budget)}",
                      "thinking.budget_tokens")
    if reasoning is None:
        raise invalid("'thinking.budget_tokens': this model does not reason (it has no thinking to budget); send "
                      "{'type': 'disabled'} or leave 'thinking' out", "thinking.budget_tokens", "unsupported_value")
    if max_tokens is not None and budget >= max_tokens:
        raise invalid(f"'thinking.budget_tokens' ({budget}) must be less than 'max_tokens' ({max_tokens}), which "
                      "counts the thinking too", "thinking.budget_tokens")
    job.sampling["reasoning_budget"] = budget


def parse_messages(body: dict[str, Any], model_names: set[str], served_id: str, context_length: int,
                   vocab_size: int, reasoning: str | None, tool_format: ToolFormat = JSON, count_only: bool = False
                   ) -> Job:
    """A Messages body -> the chat Job that serves it (`count_only`: a count_tokens body, without max_tokens).
    `reasoning` is the model's reasoning family (`ModelInfo.reasoning`); tools and earlier calls take the model's
    `tool_format`. Raises APIError naming the Messages field."""
    if body.get("thread") is not None:
        # A Thread keeps the conversation on the server, and a `continue` sends only the new turn (the anthropic SDK's
        # tool runner does by default): this server stores nothing, so it would see a tool_result with no tool_use
        # before it. Refused with the code the SDK reads as "send the whole conversation without `thread`".
        raise APIError(400, "'thread' is not supported: this server stores no conversations; send the whole "
                       "conversation in 'messages', without 'thread'", "thread", "unsupported_value",
                       details={"error_code": "thread_unsupported_request"})
    turns = _Turns()
    if body.get("system") is not None:
        turns.system(body["system"])
    msgs = body.get("messages")
    if msgs is None:
        raise invalid("'messages' is required: an array of {'role': 'user' | 'assistant', 'content': ...}",
                      "messages", "missing_required_parameter")
    if not isinstance(msgs, list) or not msgs:
        raise invalid(f"'messages' must be a non-empty array of turns, got {kind_of(msgs) if msgs != [] else '[]'}",
                      "messages")
    for i, m in enumerate(msgs):
        turns.turn(m, f"messages[{i}]", i == len(msgs) - 1)
    chat: dict[str, Any] = {"model": body.get("model"), "messages": turns.messages}
    if not count_only:
        if body.get("max_tokens") is None:
            raise invalid("'max_tokens' is required: the most tokens to generate, an integer >= 1", "max_tokens",
                          "missing_required_parameter")
        chat["max_tokens"] = body["max_tokens"]
        for name in ("temperature", "top_p", "top_k", "stream"):
            if body.get(name) is not None:
                chat[name] = body[name]
    t = body.get("temperature")
    if isinstance(t, (int, float)) and not isinstance(t, bool) and not 0 <= t <= 1:  # Anthropic's range, not chat's
        raise invalid(f"'temperature' must be in [0, 1], got {t}", "temperature")
    _tools(body, chat)
    _output_format(body, chat)
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise invalid(f"'metadata' must be an object, got {kind_of(metadata)}", "metadata")
    try:
        job = parse_job(chat, "chat", model_names, served_id, context_length, vocab_size, tool_format)
    except APIError as e:
        old, e.param = e.param, _param(e.param, turns.origin)
        if old and e.param:
            e.message = e.message.replace(old, e.param)
        raise
    if job.format_param == "response_format":
        job.format_param = "output_config.format"
    job.sampling["stop"] = _stop_sequences(body)
    _thinking(body, job, reasoning, job.max_tokens)
    return job
