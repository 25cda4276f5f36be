"""One message of the transcript: a role/status line over the text (Markdown for replies, streamed), and a
reasoning model's thinking between them (collapsed)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from textual import events
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.message import Message
from textual.reactive import reactive
from textual.widget import Widget
from textual.widgets import Markdown, Static
from textual.widgets.markdown import MarkdownStream

from app.tui.drafted import add_marks
from app.tui.segments import DEFAULT_SEGMENT_CHARS, MarkdownSegmenter, cuts_render_alike
from app.tui.widgets.segment import MarkdownSegment
from app.tui.widgets.thought import ThoughtView, saved_figure

STATUS_LABELS = {
    "done": "",
    "streaming": "…",
    "stopped": "stopped",
    "length": "max tokens reached",
    "error": "error",
    "interrupted": "interrupted",
}


class SegmentPlaceholder(Widget):
    """Stands in, at the same height, for a finished segment scrolled far out of view: Textual walks every
    displayed widget on each layout, so hiding the blocks that nobody can see keeps the cost of an append from
    growing with the reply (see MessageView.hide_far_segments)."""

    DEFAULT_CSS = "SegmentPlaceholder { width: 1fr; }"

    def __init__(self, segment: MarkdownSegment, content_y: int) -> None:
        super().__init__()
        self.segment = segment
        self.content_y = content_y  # its top row in the scrolling container's content
        self.height = segment.outer_size.height
        self.styles.height = self.height

    def render(self) -> str:
        return ""


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

    HIDE_EVERY_S = 0.25  # how often a streaming reply looks for segments it can hide
    segment_chars = DEFAULT_SEGMENT_CHARS
    """A streamed reply goes on in a new Markdown widget once the last one holds this many characters (at a
    block boundary where that renders the same), so each append lays out only the last segment."""

    def __init__(self, role: str, content: str, message_id: int | None = None, status: str = "done",
                 error: str | None = None, reasoning: str = "",
                 reasoning_figures: dict[str, Any] | None = None) -> None:
        """`reasoning`: a reply's thinking; `reasoning_figures`: the stats saved with it (its reasoning_tokens and
        reasoning_s, for the thought's header)."""
        super().__init__(classes=f"-{role}")
        self.role = role
        self.content = content
        self.reasoning = reasoning
        self.thought: ThoughtView | None = None
        if reasoning:
            figures = reasoning_figures or {}
            self.thought = ThoughtView(reasoning, saved_figure(figures.get("reasoning_tokens")),
                                       saved_figure(figures.get("reasoning_s")))
        self.message_id = message_id
        self.error = error
        self._stream: MarkdownStream | None = None
        self._segmenter: MarkdownSegmenter | None = None
        self._segments: list[Markdown] = []  # the streamed reply's Markdown widgets, in order
        self.drafted: list[int] = []  # [start, end) ranges of `content` that came from a speculative draft
        self._placeholders: list[SegmentPlaceholder] = []
        self._last_hide = 0.0
        self._width = 0
        self.set_reactive(MessageView.status, status)

    def compose(self) -> ComposeResult:
        yield Static(self._role_line(), classes="role", markup=False)
        if self.thought is not None:
            yield self.thought
        if self.role == "assistant":
            yield MarkdownSegment(self.content, classes="body", drafted=self.drafted)
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

    async def write(self, fragment: str, drafted: Sequence[int] = ()) -> None:
        """Appends streamed text (through Textual's MarkdownStream, which coalesces bursts) to the last
        segment, starting a new one where the segmenter cuts. `drafted`: [start, end, ...) ranges of
        `fragment` that came from a speculative draft."""
        if not fragment:
            return
        if drafted:
            add_marks(self.drafted, len(self.content), drafted)
        self.content += fragment
        if self._segmenter is None:
            self._segmenter = MarkdownSegmenter(self.segment_chars)
            self._segments = [self.query_children(MarkdownSegment).first()]
            self._segmenter.feed(self.content[: -len(fragment)])  # text the widget was created with
        at = len(self.content) - len(fragment)  # where the next piece starts in the reply
        for new_segment, piece in self._segmenter.feed(fragment):
            if new_segment:
                await self._stop_stream()
                segment = MarkdownSegment(classes="body", drafted=self.drafted, reply_offset=at)
                await self.mount(segment, after=self._segments[-1])
                self._segments.append(segment)
            if self._stream is None:
                self._stream = Markdown.get_stream(self._segments[-1])
            await self._stream.write(piece)
            at += len(piece)
        now = time.monotonic()
        if len(self._segments) > 2 and now - self._last_hide >= self.HIDE_EVERY_S:
            self._last_hide = now
            await self.hide_far_segments()

    async def write_reasoning(self, fragment: str, num_tokens: int, seconds: float, done: bool = False) -> None:
        """Appends streamed thinking (the thought block appears with the first), with its token count and seconds
        so far; `done`: the thinking ended (the answer started)."""
        self.reasoning += fragment
        if self.thought is None:
            if not fragment:
                return
            self.thought = ThoughtView(streaming=True)
            await self.mount(self.thought, after=self.query_one(".role"))
        await self.thought.write(fragment, num_tokens, seconds)
        if done and self.thought.streaming:
            await self.thought.finish(num_tokens, seconds)

    async def _stop_stream(self) -> None:
        if self._stream is not None:
            await self._stream.stop()
            self._stream = None

    @property
    def has_hidden_segments(self) -> bool:
        return bool(self._placeholders)

    async def hide_far_segments(self) -> None:
        """Swaps each segment but the last that lies more than a screen away from the rows its scrolling
        container shows for a placeholder of its height, and back each placeholder that has come nearer.

        Positions are rows of the container's scrolled content (virtual regions, which scrolling leaves alone),
        so this is right even while a scroll has not been laid out yet."""
        container = self.parent
        if len(self._segments) < 2 or not isinstance(container, Widget):
            return
        seen = round(container.scroll_y)
        rows = container.scrollable_content_region.height
        top, bottom = seen - rows, seen + 2 * rows
        base = self.virtual_region.y + self.styles.gutter.top
        back = [p for p in self._placeholders if p.content_y < bottom and p.content_y + p.height > top]
        hide = []
        for segment in self._segments[:-1]:
            region = segment.virtual_region
            y = base + region.y
            if segment.display and region.height and (y + region.height <= top or y >= bottom):
                hide.append((segment, y))
        if back or hide:
            with self.app.batch_update():
                await self._show_segments(back)
                for segment, content_y in hide:
                    placeholder = SegmentPlaceholder(segment, content_y)
                    segment.display = False
                    await self.mount(placeholder, before=segment)
                    self._placeholders.append(placeholder)

    async def _show_segments(self, placeholders: list[SegmentPlaceholder] | None = None) -> None:
        for placeholder in list(self._placeholders if placeholders is None else placeholders):
            if placeholder in self._placeholders:  # not already brought back by a concurrent call
                self._placeholders.remove(placeholder)
                placeholder.segment.display = True
                await placeholder.remove()

    async def on_resize(self, event: events.Resize) -> None:
        if event.size.width != self._width:  # new width, new heights: show everything again
            self._width = event.size.width
            await self._show_segments()

    async def finish(self, status: str, error: str | None = None, reasoning_tokens: int | None = None,
                     reasoning_s: float | None = None) -> None:
        await self._stop_stream()
        if self.thought is not None:
            await self.thought.finish(reasoning_tokens, reasoning_s)
        if len(self._segments) > 1 and self._segmenter is not None and not cuts_render_alike(
                self.content, self._segmenter.cuts):
            await self._show_segments()
            # a cut the streaming rule could not see coming (setext heading, HTML, link definitions): one widget
            await self.remove_children(self._segments[1:])
            await self._segments[0].update(self.content)
            self._segments = self._segments[:1]
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
