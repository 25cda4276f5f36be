"""Anthropic Messages replies, built from GenerationEvents: the `message` body, its SSE event stream in Anthropic's
order, and the model list in Anthropic's shape.

A stream: `message_start` (the message, no content yet), then each content block as `content_block_start`, its
deltas and `content_block_stop` (a `ping` after the first start), then `message_delta` (stop reason, usage) and
`message_stop`. Blocks: `thinking` (the engine's `reasoning` text, as `thinking_delta`s, closed by a
`signature_delta`), `text` (`text_delta`s; under tools the text as the model's tool-call format shows it:
`tool_formats.ToolStream`), `tool_use` (whole once its JSON is complete: one `input_json_delta`). A failure after the
stream began is an `error` event, which ends it.
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from mlx_engine.api import GenerationEvent, ToolCall, Usage

from app.server.bridge import Generation
from app.server.harmony_tools import tool_reply
from app.server.protocol import Job
from app.server.responses import Choice


def model_card(model_id: str, display_name: str, created: int) -> dict[str, Any]:
    """The served model as Anthropic's models API lists it."""
    return {"type": "model", "id": model_id, "display_name": display_name,
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(created))}


def model_list(card: dict[str, Any]) -> dict[str, Any]:
    """Anthropic's page of models: this server's one."""
    return {"data": [card], "has_more": False, "first_id": card["id"], "last_id": card["id"]}


def signature(thinking: str) -> str:
    """A thinking block's signature: a digest of its text (Anthropic's is opaque, and clients send it back as is)."""
    return hashlib.sha256(thinking.encode("utf-8")).hexdigest()


def usage_dict(u: Usage) -> dict[str, Any]:
    """Anthropic's usage: the prompt's tokens split into those computed (`input_tokens`) and those the prefix cache
    served (`cache_read_input_tokens`), which add up to the prompt, as Anthropic counts them."""
    return {"input_tokens": u.prompt_tokens - u.cached_prompt_tokens, "output_tokens": u.completion_tokens,
            "cache_read_input_tokens": u.cached_prompt_tokens, "cache_creation_input_tokens": 0}


def stop_reason(finish_reason: str, stop_string: str | None, called: bool) -> tuple[str, str | None]:
    """The engine's finish -> Anthropic's (`stop_reason`, `stop_sequence`)."""
    if called:
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if stop_string is not None:
        return "stop_sequence", stop_string
    return "end_turn", None


class MessagesFormatter:
    """One Messages request's `message` body and SSE events (n = 1)."""

    def __init__(self, job: Job, model_id: str):
        self.job = job
        self.id = "msg_" + uuid.uuid4().hex[:24]
        self.model = model_id

    def shell(self, usage: Usage) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
                "stop_reason": None, "stop_sequence": None, "usage": usage_dict(usage)}

    def reply(self, text: str, engine_calls: tuple[ToolCall, ...] = ()) -> tuple[str, list[dict[str, Any]]]:
        """A finished reply's text and its tool_use blocks (a tool-calling reply is read in the model's tool-call
        format, or its calls by the engine: `engine_calls`). A call whose arguments are not a JSON object (the model
        wrote them without a grammar) stays text, as written."""
        if self.job.tools is None:
            return text, []
        content, calls = tool_reply(self.job.tool_format, text, engine_calls, self.job.tools)
        texts, uses = [content] if content else [], []
        for c in calls or ():
            fn = c["function"]
            try:
                arguments = json.loads(fn["arguments"])
            except ValueError:
                arguments = None
            if not isinstance(arguments, dict):
                texts.append(f"{fn['name']}({fn['arguments']})")
                continue
            uses.append({"type": "tool_use", "id": "toolu_" + uuid.uuid4().hex[:24], "name": fn["name"],
                         "input": arguments})
        return "\n".join(texts), uses

    def response(self, choices: list[Choice], usage: Usage, accepted_draft_tokens: int | None = None
                 ) -> dict[str, Any]:
        """The whole body (what `Server._collect` returns for a request that does not stream)."""
        c = choices[0]
        text, uses = self.reply(c.text, c.tool_calls)
        content: list[dict[str, Any]] = []
        if c.reasoning:
            content.append({"type": "thinking", "thinking": c.reasoning, "signature": signature(c.reasoning)})
        if text:
            content.append({"type": "text", "text": text})
        reason, sequence = stop_reason(c.finish_reason, c.stop_string, bool(uses))
        return {**self.shell(usage), "content": content + uses, "stop_reason": reason, "stop_sequence": sequence}

    @staticmethod
    def event(kind: str, **fields: Any) -> bytes:
        data = json.dumps({"type": kind, **fields}, ensure_ascii=False, separators=(",", ":"))
        return f"event: {kind}\ndata: {data}\n\n".encode()


class _Blocks:
    """A streamed message's content blocks, opened and closed in order, with the ping after the first opens."""

    def __init__(self, fmt: MessagesFormatter):
        self.event = fmt.event
        self.index = -1
        self.open: str | None = None  # the type of the block being streamed
        self.thinking: list[str] = []
        self.pinged = False

    def _start(self, block: dict[str, Any]) -> list[bytes]:
        self.index += 1
        out = [self.event("content_block_start", index=self.index, content_block=block)]
        if not self.pinged:
            self.pinged = True
            out.append(self.event("ping"))
        return out

    def delta(self, kind: str, text: str) -> list[bytes]:
        """More `text` of a thinking or text block (opening one when the kind changes)."""
        out = []
        if self.open != kind:
            out += self.close()
            out += self._start({"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking"
                               else {"type": "text", "text": ""})
            self.open = kind
        if kind == "thinking":
            self.thinking.append(text)
            delta = {"type": "thinking_delta", "thinking": text}
        else:
            delta = {"type": "text_delta", "text": text}
        return [*out, self.event("content_block_delta", index=self.index, delta=delta)]

    def close(self) -> list[bytes]:
        if self.open is None:
            return []
        out = []
        if self.open == "thinking":
            out.append(self.event("content_block_delta", index=self.index,
                                  delta={"type": "signature_delta", "signature": signature("".join(self.thinking))}))
            self.thinking = []
        self.open = None
        return [*out, self.event("content_block_stop", index=self.index)]

    def tool_use(self, block: dict[str, Any]) -> list[bytes]:
        out = [*self.close(), *self._start({**block, "input": {}})]
        partial = json.dumps(block["input"], ensure_ascii=False)
        out.append(self.event("content_block_delta", index=self.index,
                              delta={"type": "input_json_delta", "partial_json": partial}))
        return [*out, self.event("content_block_stop", index=self.index)]


async def message_events(fmt: MessagesFormatter, gen: Generation, on_event: Callable[[GenerationEvent], None],
                         cancelled_message: Callable[[], str]) -> AsyncIterator[bytes]:
    """A Messages stream over one generation (`on_event` sees each engine event: the server times the first
    token). Thinking and text stream as they come; tool calls arrive whole once their JSON is complete."""
    yield fmt.event("message_start", message=fmt.shell(Usage(gen.prompt_tokens, 0)))
    blocks = _Blocks(fmt)
    held = fmt.job.tool_format.stream(fmt.job.tools) if fmt.job.tools is not None else None
    parts: list[str] = []
    sent = ""  # the text that went out
    final: GenerationEvent | None = None
    async for event in gen.events():
        on_event(event)
        if event.reasoning:
            for b in blocks.delta("thinking", event.reasoning):
                yield b
        if event.text:
            parts.append(event.text)
            delta = event.text if held is None else "".join(d.content or "" for d in held.feed(event.text))
            sent += delta
            if delta:
                for b in blocks.delta("text", delta):
                    yield b
        final = event
    assert final is not None and final.finish_reason is not None
    reason = final.finish_reason
    if reason in ("error", "cancelled"):
        kind = "api_error" if reason == "error" else "overloaded_error"
        message = f"the generation failed: {final.error}" if reason == "error" else cancelled_message()
        yield fmt.event("error", error={"type": kind, "message": message})
        return
    text, uses = fmt.reply("".join(parts), final.tool_calls)
    out: list[bytes] = []
    if text.startswith(sent) and text != sent:  # what the format held back (a cut reply), or a call kept as text
        out += blocks.delta("text", text[len(sent):])
    out += blocks.close()
    for block in uses:
        out += blocks.tool_use(block)
    if not blocks.pinged:
        out.append(fmt.event("ping"))
    stop, sequence = stop_reason(reason, final.stop_string, bool(uses))
    out.append(fmt.event("message_delta", delta={"stop_reason": stop, "stop_sequence": sequence},
                         usage=usage_dict(final.usage or Usage(gen.prompt_tokens, 0))))
    out.append(fmt.event("message_stop"))
    for b in out:
        yield b
