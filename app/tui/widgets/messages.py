"""One message of the transcript: a role/status line over the text (Markdown for replies, streamed)."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.message import Message
from textual.reactive import reactive
from textual.widgets import Markdown, Static
from textual.widgets.markdown import MarkdownStream

STATUS_LABELS = {
    "done": "",
    "streaming": "…",
    "stopped": "stopped",
    "length": "max tokens reached",
    "error": "error",
    "interrupted": "interrupted",
}


class MessageView(Vertical, can_focus=True):
    """A user or assistant message. Focus it (tab, or click) to copy, edit, regenerate or inspect it."""

    DEFAULT_CSS = """
    MessageView { height: auto; padding: 0 1; margin: 0 0 1 0; }
    MessageView > .role { height: 1; color: $text-muted; text-style: bold; }
    MessageView.-user > .role { color: $accent; }
    MessageView.-assistant > .role { color: $success; }
    MessageView > .role.-error, MessageView > .role.-stopped, MessageView > .role.-interrupted { color: $warning; }
    MessageView > .body { height: auto; }
    MessageView > Markdown { margin: 0; padding: 0; background: transparent; }
    MessageView > Markdown > MarkdownParagraph { margin: 0; }
    MessageView > .error-text { color: $error; height: auto; }
    MessageView:focus { background: $boost; }
    """

    BINDINGS = [
        Binding("c", "copy", "Copy", tooltip="Copy this message to the clipboard (OSC 52)"),
        Binding("e", "edit", "Edit & resend", tooltip="Edit this user message and resend (later turns are replaced)"),
        Binding("r", "regenerate", "Regenerate", tooltip="Regenerate the last reply"),
        Binding("t", "inspect", "Tokens", tooltip="Show this message's tokens"),
    ]

    class Requested(Message):
        """The user asked for `action` ("edit", "regenerate", "inspect") on this message."""

        def __init__(self, view: MessageView, action: str) -> None:
            super().__init__()
            self.view = view
            self.action = action

    status: reactive[str] = reactive("done")

    def __init__(self, role: str, content: str, message_id: int | None = None, status: str = "done",
                 error: str | None = None) -> None:
        super().__init__(classes=f"-{role}")
        self.role = role
        self.content = content
        self.message_id = message_id
        self.error = error
        self._stream: MarkdownStream | None = None
        self.set_reactive(MessageView.status, status)

    def compose(self) -> ComposeResult:
        yield Static(self._role_line(), classes="role", markup=False)
        if self.role == "assistant":
            yield Markdown(self.content, classes="body")
        else:
            yield Static(self.content, classes="body", markup=False)
        yield Static(self.error or "", classes="error-text", markup=False)

    def on_mount(self) -> None:
        self._sync_status()

    def _role_line(self) -> str:
        who = "You" if self.role == "user" else "Assistant"
        label = STATUS_LABELS.get(self.status, self.status)
        return f"{who} · {label}" if label else who

    def _sync_status(self) -> None:
        # status classes go on the one-line role label: a class change on the message itself would restyle
        # every block of a long Markdown reply
        role = self.query_one(".role", Static)
        for s in STATUS_LABELS:
            role.set_class(self.status == s, f"-{s}")
        self.query_one(".error-text", Static).display = bool(self.error)

    def watch_status(self, status: str) -> None:
        if self.is_mounted:
            self.query_one(".role", Static).update(self._role_line())
            self._sync_status()

    # ---- streaming ---------------------------------------------------------------------------------------

    async def write(self, fragment: str) -> None:
        """Appends streamed text (through Textual's MarkdownStream, which coalesces bursts)."""
        if not fragment:
            return
        self.content += fragment
        if self._stream is None:
            self._stream = Markdown.get_stream(self.query_one(Markdown))
        await self._stream.write(fragment)

    async def finish(self, status: str, error: str | None = None) -> None:
        if self._stream is not None:
            await self._stream.stop()
            self._stream = None
        self.error = error
        if error:
            self.query_one(".error-text", Static).update(error)
        self.status = status
        self._sync_status()

    # ---- actions -------------------------------------------------------------------------------------------

    def action_copy(self) -> None:
        self.app.copy_to_clipboard(self.content)
        self.app.notify(f"Copied {len(self.content)} characters", timeout=2)

    def action_edit(self) -> None:
        if self.role == "user":
            self.post_message(self.Requested(self, "edit"))

    def action_regenerate(self) -> None:
        self.post_message(self.Requested(self, "regenerate"))

    def action_inspect(self) -> None:
        self.post_message(self.Requested(self, "inspect"))
