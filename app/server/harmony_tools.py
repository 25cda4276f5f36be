"""gpt-oss's tool calls: harmony's `commentary` channel, for a model whose reasoning family is "harmony"
(`ModelInfo.reasoning`), and the engine's reading of a reply's calls (`GenerationEvent.tool_calls`) as each API's.

gpt-oss's chat template renders the offered tools itself (its `tools` variable: a TypeScript-like `functions`
namespace in the developer message), earlier calls (`message.tool_calls`: `<|start|>assistant to=functions.NAME
<|channel|>commentary json<|message|>{...}<|call|>`) and results (`tool` messages: `<|start|>functions.NAME
to=assistant<|channel|>commentary<|message|>...`). The model writes its call the same way; the engine's harmony parser
reads it (`mlx_engine.harmony`), so the reply's text holds only its answer and the calls come on the final event.

The reply is not held to a grammar: the engine holds a grammar to the answer only (the `final` channel's content), and
a call lives in the headers and content of a `commentary` message, ended by `<|call|>`, an end-of-sequence token the
scheduler retires on before a grammar could read it (a Lark grammar over the whole reply, markup tokens by id and
`%json` for the arguments, compiles in llguidance; the engine has no mode that holds the whole reply to one). So the
arguments are what the model wrote (gpt-oss writes JSON), `tool_choice` "required" or a named function is asked for
in the developer message's instructions but not enforced, and a reply ends at its first call (`<|call|>` ends the
generation), so `parallel_tool_calls` changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mlx_engine.api import ResponseFormat, ToolCall
from mlx_engine.reasoning import HARMONY

from app.toolcalls.tool_formats import Delta, ToolFormat, ToolStream, detect
from app.toolcalls.tools import Tools, openai_call


class HarmonyTools:
    """The `ToolFormat` of gpt-oss: everything through its chat template, the calls read by the engine."""

    name = "harmony"

    def history(self, content: str, calls: list[dict[str, Any]]) -> dict[str, Any]:
        # the template renders the first call of a message (one call a reply) with its arguments `tojson`: an object
        # gives the JSON the model wrote, a string would be quoted again
        return {"role": "assistant", "content": content,
                "tool_calls": [{"type": "function", "function": c} for c in calls]}

    def conversation(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return messages

    def render(self, messages: list[dict[str, Any]], tools: Tools) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        # gpt-oss's template concatenates the description: a function without one would fail the render
        offered = [{"type": "function", "function": {"description": "", **f}} for f in tools.offered()]
        return _instructed(messages, tools), {"tools": offered}

    def grammar(self, tools: Tools) -> ResponseFormat | None:
        return None  # the engine's grammar holds the answer, not a commentary message (the module's docstring)

    def parse(self, text: str, tools: Tools | None = None) -> tuple[str | None, list[dict[str, Any]] | None]:
        return text, None  # the calls are the engine's (`tool_reply`); the text is the answer alone

    def stream(self, tools: Tools | None = None) -> ToolStream:
        return _Answer()


HARMONY_TOOLS = HarmonyTools()


def tool_format_for(reasoning: str | None, chat_template: str | None,
                    encode: Callable[[str], list[int]] | None = None) -> ToolFormat:
    """The model's tool-call format: harmony's for a model the engine reads as harmony, else the one its chat
    template shows (`tool_formats.detect`)."""
    return HARMONY_TOOLS if reasoning == HARMONY else detect(chat_template, encode)


def _instructed(messages: list[dict[str, Any]], tools: Tools) -> list[dict[str, Any]]:
    """Under "required" or a named function, the conversation with a line asking for the call in its first system
    message (gpt-oss's developer instructions), since nothing holds the reply to one."""
    if tools.choice == "auto":
        return messages
    line = "Call a function" if tools.choice == "required" else f"Call the function {tools.choice}"
    line += " before you answer."
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{line}"}, *messages[1:]]
    return [{"role": "system", "content": line}, *messages]


class _Answer:
    """A harmony reply's text is its answer (the engine kept the markup and the calls out of it): it streams as it
    comes."""

    called = False

    def feed(self, text: str) -> list[Delta]:
        return [Delta(content=text)] if text else []

    def finish(self) -> list[Delta]:
        return []


def tool_reply(fmt: ToolFormat, text: str, calls: tuple[ToolCall, ...], tools: Tools | None = None
               ) -> tuple[str | None, list[dict[str, Any]] | None]:
    """A finished tool-calling reply -> (content, OpenAI tool_calls or None): the calls the engine read in the
    model's own format (`GenerationEvent.tool_calls`), else those `fmt` reads from the text (`tools`: those
    offered)."""
    if calls:
        return text or None, [openai_call(c.name, c.arguments) for c in calls]
    return fmt.parse(text, tools)


def call_deltas(calls: tuple[ToolCall, ...], first: int = 0) -> list[Delta]:
    """The engine's calls as OpenAI's streamed `tool_calls` deltas: each call's index, id, type and name with empty
    arguments, then its arguments (index `first` onwards)."""
    out = []
    for j, c in enumerate(calls, start=first):
        out += [Delta(call={**openai_call(c.name, ""), "index": j}),
                Delta(call={"index": j, "function": {"arguments": c.arguments}})]
    return out
