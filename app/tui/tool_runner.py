"""MCP tools in a chat: offering the connected servers' tools to the model in its own tool-call format
(`app.toolcalls`), reading its calls back, asking the user about each, running it on the MCP hub, and continuing the
reply with the result. `ToolRunner` is mixed into the chat screen beside `ReplyRunner`.

A call is a `tool` message in the store (its call in `stats["tool_call"]`, its result as the model is told it in
`content`), written when the call is shown, so a chat never holds a call without a result: one still waiting when
the app quit reads back as interrupted. The model sees its earlier calls as its format writes them, then the
results as `tool` messages through the chat template, until it answers in text; after MAX_TOOL_CALLS calls in one
turn it answers without tools.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from textual.containers import VerticalScroll
from textual.worker import Worker

from mlx_engine.api import EngineLike, GenerationRequest

from app.toolcalls.tool_formats import ToolFormat, ToolStream, detect
from app.toolcalls.tools import Tools
from app.tui.reply import model_messages
from app.tui.widgets.messages import MessageView
from app.tui.widgets.tool_call import ChatNote, ToolCallView

if TYPE_CHECKING:
    from app.tui.app import RooflineApp
    from app.tui.store import Chat

MAX_TOOL_CALLS = 8  # in one turn (since the user's last message)
DECLINED = "The user declined this call, so it did not run."
STOPPED = "The user stopped this call, so it has no result."
INTERRUPTED = "The call was interrupted (the app closed) before it returned a result."
LIMIT_NOTE = (f"{MAX_TOOL_CALLS} tool calls in this turn, the most one turn may make: the model answers without "
              "tools now.")
STATUS_OF = {"done": "done", "error": "error", "timeout": "timeout", "gone": "error"}  # ToolResult -> view
SLACK_S = 10.0  # past a call's timeout, the UI stops waiting on the hub


@dataclass
class Offer:
    """The tools offered to one reply, and that reply read back as it streams."""

    fmt: ToolFormat
    tools: Tools
    catalog: dict[str, dict[str, Any]]  # name the model sees -> {"server", "tool", ...}
    reader: ToolStream = field(init=False)
    raw: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.reader = self.fmt.stream(self.tools)

    def request(self, request: GenerationRequest) -> GenerationRequest:
        """`request` (the chat's messages, sampling and thinking effort) offering the tools: the conversation and
        template variables as the format renders them, the reply held to its grammar."""
        msgs, variables = self.fmt.render(request.messages, self.tools)
        return dataclasses.replace(request, messages=msgs, chat_template_kwargs=variables or None,
                                   sampling=dataclasses.replace(request.sampling,
                                                                response_format=self.fmt.grammar(self.tools)))

    def feed(self, text: str) -> str:
        """Generated text -> the reply's text to show (a call's JSON is not shown)."""
        self.raw.append(text)
        return "".join(d.content for d in self.reader.feed(text) if d.content)

    def finish(self) -> str:
        return "".join(d.content for d in self.reader.finish() if d.content)

    def calls(self) -> list[dict[str, Any]]:
        """The reply's calls: [{"name", "arguments", "server", "tool"}], of offered tools only."""
        _, calls = self.fmt.parse("".join(self.raw), self.tools)
        out = []
        for c in calls or []:
            name, text = c["function"]["name"], c["function"]["arguments"]
            try:
                arguments = json.loads(text) if text.strip() else {}
            except ValueError:
                arguments = text
            if name in self.catalog and isinstance(arguments, dict):
                entry = self.catalog[name]
                out.append({"name": name, "arguments": arguments, "server": entry["server"], "tool": entry["tool"]})
        return out


def catalog(states: Iterable[Any]) -> dict[str, dict[str, Any]]:
    """Every connected server's tools by the name the model sees: the tool's own, or `<server>_<tool>` where two
    servers have one of that name."""
    entries = [(s.name, t) for s in states if s.status == "connected" for t in s.tools]
    counts: dict[str, int] = {}
    for _, t in entries:
        counts[t["name"]] = counts.get(t["name"], 0) + 1
    out: dict[str, dict[str, Any]] = {}
    for server, t in entries:
        name = t["name"]
        if counts[name] > 1:
            name = ("".join(c if c.isalnum() or c in "_-." else "_" for c in server) + "_" + name)[:64]
        if name not in out:
            out[name] = {**t, "name": name, "server": server}
    return out


def chat_messages(system_prompt: str, views: list[MessageView], fmt: ToolFormat) -> list[dict[str, Any]]:
    """The chat as the model sees it (`model_messages`), with each reply that called tools written as the model's
    format writes calls and each result a `tool` message."""
    if not any(isinstance(v, ToolCallView) for v in views):
        return model_messages(system_prompt, [(v.role, v.content, v.status) for v in views])
    msgs: list[dict[str, Any]] = [{"role": "system", "content": system_prompt}] if system_prompt.strip() else []
    for i, v in enumerate(views):
        if isinstance(v, ToolCallView):
            msgs.append({"role": "tool", "content": result_for_model(v.content, v.status)})
            continue
        calls = []
        for w in views[i + 1:]:
            if not isinstance(w, ToolCallView):
                break
            calls.append({"name": w.call["name"], "arguments": w.call["arguments"]})
        if v.role == "assistant" and calls:
            msgs.append(fmt.history(v.content, calls))
        elif v.role != "assistant" or (v.status != "error" and v.content):
            msgs.append({"role": v.role, "content": v.content})
    return fmt.conversation(msgs)


def result_for_model(content: str, status: str) -> str:
    return INTERRUPTED if status in ("interrupted", "streaming", "queued", "asking", "running") else content


class ToolRunner:
    """The chat screen's tool calls (a mixin on a Screen, beside ReplyRunner)."""

    chat: Chat | None

    def init_tools(self) -> None:
        self.tool_worker: Worker[None] | None = None  # the turn's calls, while they wait for the user or run
        self.open_calls: list[ToolCallView] = []  # shown and not settled
        self.always_allowed: dict[int, set[tuple[str, str]]] = {}  # chat id -> (server, tool) run without asking
        self._formats: dict[int, tuple[EngineLike, ToolFormat]] = {}

    @property
    def rapp(self) -> RooflineApp:
        return self.app  # type: ignore[attr-defined]

    def tool_format(self, engine: EngineLike | None) -> ToolFormat:
        """The engine's tool-call format, from its chat template (read once per engine)."""
        cache = self._formats
        if engine is None:
            return detect(None)
        if id(engine) not in cache or cache[id(engine)][0] is not engine:
            tok = engine.tokenizer
            cache.clear()
            cache[id(engine)] = (engine, detect(getattr(tok, "chat_template", None),
                                                lambda text: tok.encode(text, add_special_tokens=False)))
        return cache[id(engine)][1]

    def tool_offer(self, engine: EngineLike) -> Offer | None:
        """What the next reply is offered: the connected servers' tools, none past the turn's limit."""
        tools = catalog(self.rapp.mcp.states())
        if not tools:
            return None
        if self.calls_this_turn() >= MAX_TOOL_CALLS:
            return None
        functions = tuple({k: t[k] for k in ("name", "description", "parameters") if k in t} for t in tools.values())
        return Offer(self.tool_format(engine), Tools(functions), tools)

    def calls_this_turn(self) -> int:
        n = 0
        for v in reversed(list(self.query(MessageView))):  # type: ignore[attr-defined]
            if v.role == "user":
                break
            n += isinstance(v, ToolCallView)
        return n

    def note(self, text: str) -> None:
        """A line in the transcript (not saved)."""
        transcript = self.query_one("#transcript", VerticalScroll)  # type: ignore[attr-defined]
        transcript.mount(ChatNote(text))
        transcript.scroll_end(animate=False)

    # ---- running the calls of a reply ------------------------------------------------------------------

    def run_tool_calls(self, chat_id: int, calls: list[dict[str, Any]]) -> None:
        """Shows the reply's calls and runs them (each once the user allows it), then continues the reply."""
        self.tool_worker = self.run_worker(self._tool_turn(chat_id, calls), group="tools",  # type: ignore[attr-defined]
                                           exclusive=True, exit_on_error=False)
        self.refresh_bindings()  # type: ignore[attr-defined]

    def stop_tools(self) -> None:
        """Stops the calls of the turn: one still waiting is not run, one running is no longer waited for; the model
        is not asked to go on."""
        worker, self.tool_worker = self.tool_worker, None
        for view in list(self.open_calls):
            self._settle(view, STOPPED, "stopped")
        if worker is not None:
            worker.cancel()
        self.refresh_bindings()  # type: ignore[attr-defined]

    async def _tool_turn(self, chat_id: int, calls: list[dict[str, Any]]) -> None:
        store = self.rapp.store
        transcript = self.query_one("#transcript", VerticalScroll)  # type: ignore[attr-defined]
        views = []
        for call in calls:
            row = store.add_message(chat_id, "tool", "", status="streaming", stats={"tool_call": call})
            views.append(ToolCallView(call, "", row.id, status="queued"))
        self.open_calls.extend(views)
        await transcript.mount_all(views)
        transcript.scroll_end(animate=False)
        for view in views:
            if self.tool_worker is None:
                return  # stopped
            await self._run_call(chat_id, view)
        if self.tool_worker is None or self.chat is None or self.chat.id != chat_id:
            return
        self.tool_worker = None
        self.refresh_bindings()  # type: ignore[attr-defined]
        if self.calls_this_turn() >= MAX_TOOL_CALLS:
            self.note(LIMIT_NOTE)
        await self.start_reply()  # type: ignore[attr-defined]

    async def _run_call(self, chat_id: int, view: ToolCallView) -> None:
        call = view.call
        allowed = self.always_allowed.setdefault(chat_id, set())
        key = (call["server"], call["tool"])
        if key not in allowed:
            answer = await view.ask()
            # typing goes to the input again, not to the call's keys (e edits, r regenerates)
            self.query_one("#prompt").focus()  # type: ignore[attr-defined]
            if answer == "deny":
                self._settle(view, DECLINED, "denied")
                return
            if answer == "always":
                allowed.add(key)
        view.status = "running"
        state = self.rapp.mcp.states_by_name().get(call["server"])
        timeout = state.spec.timeout_s if state is not None else 60.0
        future = self.rapp.mcp.call(call["server"], call["tool"], call["arguments"], timeout)
        try:
            result = await asyncio.wait_for(asyncio.wrap_future(future), timeout + SLACK_S)
        except TimeoutError:
            self._settle(view, f"Error: the tool did not answer within {timeout:g} s.", "timeout")
            return
        self._settle(view, result.text, STATUS_OF.get(result.status, "error"))

    def _settle(self, view: ToolCallView, content: str, status: str) -> None:
        """The call's result, shown and saved (its row keeps the call)."""
        if view in self.open_calls:
            self.open_calls.remove(view)
        view.set_result(content, status)
        if view.message_id is not None:
            self.rapp.store.update_message(view.message_id, content, status, {"tool_call": view.call})
