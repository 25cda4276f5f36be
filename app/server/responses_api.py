"""OpenAI's Responses API (`POST /v1/responses`) over the same engine path as chat completions.

A Responses body is translated to a chat-completions body (`instructions` and `input` items -> messages,
`max_output_tokens` -> max_tokens, `text.format` -> response_format, flat function tools -> chat tools) and
validated by `parse_job`, so every rule, default and error of chat holds; errors name the Responses field. The
reply comes back as a `response` object with `output` items (an assistant `message` of `output_text`, or
`function_call`s), or as Responses' typed SSE events (`response.created` ... `response.completed`). A reasoning
model's thinking comes first, as a `reasoning` item whose summary is the reasoning text (streamed as
`response.reasoning_summary_text.delta` events); `reasoning.effort` is the chat's `reasoning_effort`.

Stateless: nothing is stored, so `previous_response_id` and `conversation` are refused (send the whole
conversation in `input`), and every response says `"store": false`. Built-in tools (web search, file search,
code interpreter, ...) are refused: only function tools run here.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from mlx_engine.api import GenerationEvent, ToolCall, Usage

from app.server.errors import APIError, invalid
from app.server.harmony_tools import tool_reply
from app.server.protocol import Job, content_parts, parse_job
from app.toolcalls.tool_formats import JSON, ToolFormat

_TEXT_PARTS = ("input_text", "output_text", "text")


def _param(p: str | None, first_input: int) -> str | None:
    """A chat field named in a parse_job error -> the Responses field it came from."""
    if p is None:
        return None
    p = re.sub(r"^max_tokens$", "max_output_tokens", p)
    p = re.sub(r"^reasoning_effort$", "reasoning.effort", p)
    p = re.sub(r"^response_format(\.json_schema)?", "text.format", p)
    p = re.sub(r"^tools\[(\d+)\]\.function", r"tools[\1]", p)
    m = re.match(r"^messages\[(\d+)\]", p)
    if m:  # chat message i came from input item i - first_input (or from instructions)
        i = int(m.group(1)) - first_input
        return "instructions" if i < 0 else f"input[{i}]"
    return "input" if p == "messages" else p


def _parts_text(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"'{param}' must be a string or an array of input_text parts", param)
    return content_parts(content, param, _TEXT_PARTS)


def _messages(body: dict[str, Any]) -> tuple[list[dict[str, Any]], int]:
    """`instructions` + `input` -> chat messages, and how many messages come before input item 0."""
    out: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise invalid("'instructions' must be a string", "instructions")
        out.append({"role": "system", "content": instructions})
    first = len(out)
    items = body.get("input")
    if items is None:
        raise invalid("'input' is required: a string, or an array of messages and function call items", "input",
                      "missing_required_parameter")
    if isinstance(items, str):
        return [*out, {"role": "user", "content": items}], first
    if not isinstance(items, list) or not items:
        raise invalid("'input' must be a string or a non-empty array of items", "input")
    for i, item in enumerate(items):
        p = f"input[{i}]"
        if not isinstance(item, dict):
            raise invalid(f"'{p}' must be an object (a message or a function call item)", p)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise invalid(f"'{p}.role' must be one of user, system, developer, assistant, got {role!r}",
                              f"{p}.role")
            out.append({"role": role, "content": _parts_text(item.get("content"), f"{p}.content")})
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise invalid(f"'{p}' (function_call) needs string 'call_id', 'name' and 'arguments'", p)
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls"):
                out[-1]["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str) or not isinstance(item.get("output"), (str, list)):
                raise invalid(f"'{p}' (function_call_output) needs a string 'call_id' and 'output'", p)
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": _parts_text(item["output"], f"{p}.output")})
        elif kind == "reasoning":
            continue  # a reasoning model's summary: nothing this model reads
        else:
            raise invalid(f"'{p}.type' {kind!r} is not supported here: messages, function_call and "
                          "function_call_output items are", f"{p}.type", "unsupported_value")
    return out, first


def _tools(body: dict[str, Any], chat: dict[str, Any]) -> None:
    ts = body.get("tools")
    if ts is not None:
        if not isinstance(ts, list):
            raise invalid("'tools' must be an array of function tools", "tools")
        chat["tools"] = []
        for i, t in enumerate(ts):
            if not isinstance(t, dict) or t.get("type") != "function":
                kind = t.get("type") if isinstance(t, dict) else None
                raise invalid(f"'tools[{i}]' of type {kind!r} is not available: this server runs a local model and "
                              "offers function tools only", f"tools[{i}].type", "unsupported_value")
            chat["tools"].append({"type": "function", "function": {k: v for k, v in t.items() if k != "type"}})
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function":
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    if choice is not None:
        chat["tool_choice"] = choice
    if body.get("parallel_tool_calls") is not None:
        chat["parallel_tool_calls"] = body["parallel_tool_calls"]


def parse_responses(body: dict[str, Any], model_names: set[str], served_id: str, context_length: int,
                    vocab_size: int, tool_format: ToolFormat = JSON) -> Job:
    """A Responses body -> the chat Job that serves it (tools in the model's `tool_format`). Raises APIError naming
    the Responses field."""
    for name, why in (("previous_response_id", "this server stores no responses: send the whole conversation in "
                                               "'input'"),
                      ("conversation", "this server stores no conversations: send the whole conversation in 'input'")):
        if body.get(name) is not None:
            raise invalid(f"'{name}' is not supported: {why}", name, "unsupported_value")
    if body.get("background"):
        raise invalid("'background' is not supported: responses are streamed or returned directly", "background",
                      "unsupported_value")
    messages, first = _messages(body)
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages}
    for name in ("temperature", "top_p", "stream", "seed", "top_k", "min_p", "repetition_penalty"):
        if body.get(name) is not None:
            chat[name] = body[name]
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    text = body.get("text")
    if text is not None:
        fmt = text.get("format") if isinstance(text, dict) else None
        if not isinstance(text, dict) or (fmt is not None and not isinstance(fmt, dict)):
            raise invalid("'text' must be an object like {'format': {'type': 'json_schema', ...}}", "text")
        if fmt is not None and fmt.get("type") == "json_schema":
            chat["response_format"] = {"type": "json_schema", "json_schema": {
                k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}}
        elif fmt is not None:
            chat["response_format"] = fmt
    _tools(body, chat)
    reasoning = body.get("reasoning")
    if reasoning is not None:
        if not isinstance(reasoning, dict):
            raise invalid("'reasoning' must be an object like {'effort': 'low'}", "reasoning")
        chat["reasoning_effort"] = reasoning.get("effort")
    chat["chat_template_kwargs"] = body.get("chat_template_kwargs")
    try:
        return parse_job(chat, "chat", model_names, served_id, context_length, vocab_size, tool_format)
    except APIError as e:
        e.param = _param(e.param, first)
        for old, new in (("'max_tokens'", "'max_output_tokens'"), ("'response_format'", "'text.format'"),
                         ("'reasoning_effort'", "'reasoning.effort'"), ("'response_format.json_schema.", "'text.format.")):
            e.message = e.message.replace(old, new)
        e.message = re.sub(r"'tools\[(\d+)\]\.function\.", r"'tools[\1].", e.message)
        raise


class ResponsesFormatter:
    """A `response` object and its SSE events for one Job (n = 1), echoing the request's settings."""

    def __init__(self, job: Job, model_id: str, body: dict[str, Any]):
        self.job = job
        self.id = "resp_" + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.model = model_id
        self.body = body
        self.seq = 0
        self.indexes: dict[str, int] = {}  # output item id -> its output_index, in the order the items open

    def _place(self, item: dict[str, Any]) -> int:
        return self.indexes.setdefault(item["id"], len(self.indexes))

    # ---- the response object -----------------------------------------------------------------------------

    def shell(self, status: str, output: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        b = self.body
        text = b.get("text") if isinstance(b.get("text"), dict) else {"format": {"type": "text"}}
        asked = b.get("reasoning") if isinstance(b.get("reasoning"), dict) else {}
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status, "error": None,
                "incomplete_details": None, "instructions": b.get("instructions"),
                "max_output_tokens": b.get("max_output_tokens"), "model": self.model, "output": output or [],
                "parallel_tool_calls": bool(b.get("parallel_tool_calls")), "previous_response_id": None,
                "temperature": self.job.sampling.get("temperature"), "top_p": self.job.sampling.get("top_p"),
                "tool_choice": b.get("tool_choice", "auto"), "tools": b.get("tools") or [], "text": text,
                "truncation": "disabled", "store": False, "metadata": b.get("metadata") or {}, "usage": None,
                "reasoning": {"effort": asked.get("effort"), "summary": asked.get("summary")}}

    @staticmethod
    def message_item(text: str, status: str = "completed") -> dict[str, Any]:
        return {"type": "message", "id": "msg_" + uuid.uuid4().hex[:24], "status": status, "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}

    @staticmethod
    def reasoning_item(text: str) -> dict[str, Any]:
        return {"type": "reasoning", "id": "rs_" + uuid.uuid4().hex[:24],
                "summary": [{"type": "summary_text", "text": text}]}

    @staticmethod
    def call_item(call: dict[str, Any]) -> dict[str, Any]:
        fn = call["function"]
        return {"type": "function_call", "id": "fc_" + uuid.uuid4().hex[:24], "call_id": call["id"],
                "name": fn["name"], "arguments": fn["arguments"], "status": "completed"}

    def output(self, text: str, finish_reason: str, engine_calls: tuple[ToolCall, ...] = ()) -> list[dict[str, Any]]:
        """The output items of a finished reply: a message, or a tool-calling one's calls (after its text, where it
        wrote some first), parsed in the model's tool-call format (or read by the engine: `engine_calls`)."""
        if self.job.tools is not None:
            content, calls = tool_reply(self.job.tool_format, text, engine_calls, self.job.tools)
            if calls:
                return ([self.message_item(content)] if content else []) + [self.call_item(c) for c in calls]
            text = content or ""
        return [self.message_item(text, "completed" if finish_reason == "stop" else "incomplete")]

    def finished(self, output: list[dict[str, Any]], finish_reason: str, usage: Usage) -> dict[str, Any]:
        obj = self.shell("completed" if finish_reason == "stop" else "incomplete", output)
        if finish_reason == "length":
            obj["incomplete_details"] = {"reason": "max_output_tokens"}
        obj["usage"] = {"input_tokens": usage.prompt_tokens,
                        "input_tokens_details": {"cached_tokens": usage.cached_prompt_tokens},
                        "output_tokens": usage.completion_tokens,
                        "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
                        "total_tokens": usage.prompt_tokens + usage.completion_tokens}
        return obj

    def response(self, choices: list[Any], usage: Usage, accepted_draft_tokens: int | None = None) -> dict[str, Any]:
        """The whole body (what `Server._collect` returns for a request that does not stream)."""
        c = choices[0]
        thought = [self.reasoning_item(c.reasoning)] if c.reasoning else []
        return self.finished(thought + self.output(c.text, c.finish_reason, c.tool_calls), c.finish_reason, usage)

    # ---- events -------------------------------------------------------------------------------------------

    def event(self, kind: str, **fields: Any) -> bytes:
        obj = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return (f"event: {kind}\ndata: ".encode() + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()
                + b"\n\n")

    def open_reasoning(self, item: dict[str, Any]) -> list[bytes]:
        k = self._place(item)
        return [self.event("response.output_item.added", output_index=k, item={**item, "summary": []}),
                self.event("response.reasoning_summary_part.added", item_id=item["id"], output_index=k,
                           summary_index=0, part={"type": "summary_text", "text": ""})]

    def reasoning_delta(self, item_id: str, delta: str) -> bytes:
        return self.event("response.reasoning_summary_text.delta", item_id=item_id, output_index=self.indexes[item_id],
                          summary_index=0, delta=delta)

    def close_reasoning(self, item: dict[str, Any]) -> list[bytes]:
        k, part = self.indexes[item["id"]], item["summary"][0]
        return [self.event("response.reasoning_summary_text.done", item_id=item["id"], output_index=k,
                           summary_index=0, text=part["text"]),
                self.event("response.reasoning_summary_part.done", item_id=item["id"], output_index=k,
                           summary_index=0, part=part),
                self.event("response.output_item.done", output_index=k, item=item)]

    def open_message(self, item: dict[str, Any]) -> list[bytes]:
        k = self._place(item)
        opened = {**item, "status": "in_progress", "content": []}
        return [self.event("response.output_item.added", output_index=k, item=opened),
                self.event("response.content_part.added", item_id=item["id"], output_index=k, content_index=0,
                           part={"type": "output_text", "text": "", "annotations": []})]

    def text_delta(self, item_id: str, delta: str) -> bytes:
        return self.event("response.output_text.delta", item_id=item_id, output_index=self.indexes[item_id],
                          content_index=0, delta=delta, logprobs=[])

    def close_message(self, item: dict[str, Any]) -> list[bytes]:
        k, part = self.indexes[item["id"]], item["content"][0]
        return [self.event("response.output_text.done", item_id=item["id"], output_index=k, content_index=0,
                           text=part["text"], logprobs=[]),
                self.event("response.content_part.done", item_id=item["id"], output_index=k, content_index=0,
                           part=part),
                self.event("response.output_item.done", output_index=k, item=item)]

    def calls(self, items: list[dict[str, Any]]) -> list[bytes]:
        """The events of function-call items, whole, each at the next output index."""
        out = []
        for item in items:
            k = self._place(item)
            out += [self.event("response.output_item.added", output_index=k,
                               item={**item, "arguments": "", "status": "in_progress"}),
                    self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=k,
                               delta=item["arguments"]),
                    self.event("response.function_call_arguments.done", item_id=item["id"], output_index=k,
                               name=item["name"], arguments=item["arguments"]),
                    self.event("response.output_item.done", output_index=k, item=item)]
        return out


async def response_events(events: AsyncIterator[GenerationEvent], fmt: ResponsesFormatter, reasons: bool,
                          cancelled_message: Callable[[], str]) -> AsyncIterator[bytes]:
    """A Responses stream over one generation's events: created, in progress, the output item(s) with their deltas,
    then completed (or incomplete at max_output_tokens; failed after an error). Text streams as it comes (with tools,
    as the model's tool-call format shows it); function calls arrive whole once the reply is complete. On a reasoning
    model (`reasons`) the reasoning item streams first and the message opens at the answer's first text."""
    yield fmt.event("response.created", response=fmt.shell("in_progress"))
    yield fmt.event("response.in_progress", response=fmt.shell("in_progress"))
    item = fmt.message_item("", "in_progress") if fmt.job.tools is None and not reasons else None
    if item is not None:
        for b in fmt.open_message(item):
            yield b
    reader = fmt.job.tool_format.stream(fmt.job.tools) if fmt.job.tools is not None else None
    parts: list[str] = []
    thought: dict[str, Any] | None = None  # the reasoning item
    thinking: list[str] = []
    thought_open = False
    final: GenerationEvent | None = None
    async for event in events:
        if event.reasoning:
            if thought is None:
                thought, thought_open = fmt.reasoning_item(""), True
                for b in fmt.open_reasoning(thought):
                    yield b
            thinking.append(event.reasoning)
            yield fmt.reasoning_delta(thought["id"], event.reasoning)
        if event.text:
            if thought_open:  # the answer began: the reasoning is done
                assert thought is not None
                thought["summary"][0]["text"], thought_open = "".join(thinking), False
                for b in fmt.close_reasoning(thought):
                    yield b
            parts.append(event.text)
            texts = [event.text] if reader is None else [d.content for d in reader.feed(event.text) if d.content]
            for delta in texts:
                if item is None:
                    item = fmt.message_item("", "in_progress")
                    for b in fmt.open_message(item):
                        yield b
                yield fmt.text_delta(item["id"], delta)
        final = event
    assert final is not None and final.finish_reason is not None
    reason = final.finish_reason
    if reason in ("error", "cancelled"):
        message = f"the generation failed: {final.error}" if reason == "error" else cancelled_message()
        code = "generation_failed" if reason == "error" else "cancelled"
        failed = fmt.shell("failed")
        failed["error"] = {"code": code, "message": message}
        yield fmt.event("error", code=code, message=message, param=None)
        yield fmt.event("response.failed", response=failed)
        return
    if thought_open:  # no answer text came after it
        assert thought is not None
        thought["summary"][0]["text"] = "".join(thinking)
        for b in fmt.close_reasoning(thought):
            yield b
    for delta in [d.content for d in reader.finish() if d.content] if reader is not None else []:
        if item is None:
            item = fmt.message_item("", "in_progress")
            for b in fmt.open_message(item):
                yield b
        yield fmt.text_delta(item["id"], delta)
    output = fmt.output("".join(parts), reason, final.tool_calls)
    said = next((o for o in output if o["type"] == "message"), None)
    calls = [o for o in output if o["type"] == "function_call"]
    if item is not None:  # its text streamed: the same item, with the reply's text as parsed
        item["content"][0]["text"] = said["content"][0]["text"] if said is not None else ""
        item["status"] = said["status"] if said is not None else "completed"
        for b in fmt.close_message(item):
            yield b
    elif said is not None:
        item = said
        for b in [*fmt.open_message(item), fmt.text_delta(item["id"], item["content"][0]["text"]),
                  *fmt.close_message(item)]:
            yield b
    for b in fmt.calls(calls):
        yield b
    output = ([thought] if thought is not None else []) + ([item] if item is not None else []) + calls
    done = "response.completed" if reason == "stop" else "response.incomplete"
    yield fmt.event(done, response=fmt.finished(output, reason, final.usage or Usage(0, 0)))
