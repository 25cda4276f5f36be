"""A tool call in the transcript: which tool on which MCP server, its arguments, the user's answer, its result; and
one-line notes about MCP servers (one that cannot start, stopped, a config error)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal
from textual.widgets import Button, Static

from app.tui.widgets.messages import MessageView

TOOL_LABELS = {
    "queued": "waiting for the call before it",
    "asking": "allow this call?  y once · a always (this chat) · n deny",
    "running": "running…",
    "done": "",
    "error": "failed",
    "timeout": "timed out",
    "denied": "declined",
    "stopped": "stopped",
    "interrupted": "interrupted",
}
SHOWN_LINES = 12  # of a result; the rest is one line saying how much (c copies all)


class ToolCallView(MessageView):
    """One call (`call`: {"name" the model used, "tool", "server", "arguments"}) and, once it ran, its result as the
    model is told it (`content`). `ask()` shows the approval buttons and waits for the answer."""

    DEFAULT_CSS = """
    ToolCallView > .role { color: $warning; }
    ToolCallView.-asking { border-left: thick $warning; }
    ToolCallView > .arguments { color: $text-muted; height: auto; }
    ToolCallView > .approval { height: auto; display: none; }
    ToolCallView.-asking > .approval { display: block; }
    ToolCallView > .approval Button { margin-right: 2; min-width: 12; }
    """
    BINDINGS = [
        Binding("y", "answer('once')", "Allow once", tooltip="Run this tool call once"),
        Binding("a", "answer('always')", "Always allow", tooltip="Run this tool's calls in this chat without asking"),
        Binding("n", "answer('deny')", "Deny", tooltip="Do not run it; the model is told you declined"),
    ]

    def __init__(self, call: dict[str, Any], content: str = "", message_id: int | None = None,
                 status: str = "done", error: str | None = None) -> None:
        super().__init__("tool", content, message_id, status, error)
        self.call = call
        self._answer: asyncio.Future[str] | None = None

    def compose(self) -> ComposeResult:
        yield Static(self._role_line(), classes="role", markup=False)
        yield Static(arguments_line(self.call), classes="arguments", markup=False)
        yield Static(shown(self.content), classes="body", markup=False)
        with Horizontal(classes="approval"):
            yield Button("Allow once (y)", id="once", variant="primary", compact=True)
            yield Button(f"Always allow {self.call.get('tool', '?')} (a)", id="always", compact=True)
            yield Button("Deny (n)", id="deny", variant="error", compact=True)
        yield Static(self.error or "", classes="error-text", markup=False)

    def _role_line(self) -> str:
        label = TOOL_LABELS.get(self.status, self.status)
        head = f"Tool · {self.call.get('tool', '?')} on {self.call.get('server', '?')}"
        return f"{head} · {label}" if label else head

    def watch_status(self, status: str) -> None:
        super().watch_status(status)
        self.set_class(status == "asking", "-asking")
        self.refresh_bindings()

    def on_mount(self) -> None:
        super().on_mount()
        self.set_class(self.status == "asking", "-asking")
        self.query_one(".body", Static).display = bool(self.content)

    def set_result(self, content: str, status: str) -> None:
        self.content = content
        bodies = self.query(".body").results(Static) if self.is_mounted else []
        for body in bodies:
            body.update(shown(content))
            body.display = bool(content)
        if self.is_mounted and self.query(".role"):
            self.status = status
        else:  # not shown (yet, or any more: the app is closing)
            self.set_reactive(ToolCallView.status, status)

    # ---- approval ------------------------------------------------------------------------------------

    async def ask(self) -> str:
        """Shows the buttons and waits: "once", "always" or "deny"."""
        self._answer = asyncio.get_running_loop().create_future()
        self.status = "asking"
        self.focus()
        self.scroll_visible()
        try:
            return await self._answer
        finally:
            self._answer = None

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "answer":
            return self.status == "asking"
        return super().check_action(action, parameters)

    def action_answer(self, answer: str) -> None:
        if self._answer is not None and not self._answer.done():
            self._answer.set_result(answer)

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        self.action_answer(event.button.id or "deny")

    def action_edit(self) -> None:  # a tool's result is not the user's to edit
        return


class ChatNote(Static):
    """One line in the transcript from the app, not a message: an MCP server that cannot start or stopped, a config
    error, the tool-call limit. Not saved with the chat."""

    DEFAULT_CSS = "ChatNote { color: $warning; padding: 0 1; margin: 0 0 1 0; }"

    def __init__(self, text: str) -> None:
        super().__init__(text, markup=False, classes="chat-note")


def arguments_line(call: dict[str, Any]) -> str:
    args = call.get("arguments")
    text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return f"{call.get('name', '?')}({text})"


def shown(content: str) -> str:
    lines = content.splitlines()
    if len(lines) <= SHOWN_LINES:
        return content
    return "\n".join(lines[:SHOWN_LINES] + [f"… {len(lines) - SHOWN_LINES} more lines (c copies the whole result)"])
