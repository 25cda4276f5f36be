"""A reply's reasoning: a dimmed one-line header over the model's thinking, collapsed (the header alone) unless
expanded. While collapsed the text is only kept, so a long thought costs one header update per frame; expanding
shows it with one parse, and what streams in after goes through Markdown's streaming API like the answer."""

from __future__ import annotations

import math
from typing import Any

from textual import events
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Markdown, Static
from textual.widgets.markdown import MarkdownStream

from app.tui.widgets.segment import MarkdownSegment


class ThoughtBody(MarkdownSegment):
    """The thinking's text: a MarkdownSegment, so an expanded thought is not laid out again on every append to the
    answer below it."""


def saved_figure(value: Any) -> float | None:
    """A number saved with a message (reasoning_tokens, reasoning_s), or None where it is missing or damaged."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0:
        return float(value)
    return None


def duration(seconds: float) -> str:
    """'4.2 s', '2 min 5 s'."""
    if seconds < 59.95:
        return f"{seconds:.1f} s"
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes} min {rest} s"


class ThoughtView(Vertical):
    """`text`: the thinking so far; `num_tokens` and `seconds` what the header says of it (None: not known, as for
    a reply saved before it finished); `streaming`: the model is still thinking."""

    DEFAULT_CSS = """
    ThoughtView { height: auto; }
    ThoughtView > .thought-header { height: 1; color: $text-muted; text-style: italic; }
    ThoughtView > .thought-header:hover { color: $text; }
    ThoughtView > ThoughtBody { display: none; color: $text-muted; margin: 0 0 0 2; padding: 0;
                                background: transparent; }
    ThoughtView.-expanded > ThoughtBody { display: block; }
    """

    def __init__(self, text: str = "", num_tokens: float | None = None, seconds: float | None = None,
                 streaming: bool = False) -> None:
        super().__init__()
        self.text = text
        self.num_tokens = num_tokens
        self.seconds = seconds
        self.streaming = streaming
        self.expanded = False
        self._shown = 0  # characters of `text` in the body
        self._stream: MarkdownStream | None = None

    def compose(self) -> ComposeResult:
        yield Static(self.header(), classes="thought-header", markup=False)
        yield ThoughtBody()

    def header(self) -> str:
        arrow = "▾" if self.expanded else "▸"
        n = self.num_tokens
        tokens = f"{n:,.0f} token{'' if n == 1 else 's'}" if n is not None else ""
        if self.streaming:
            return f"{arrow} Thinking…" + (f" ({tokens})" if tokens else "")
        figures = " / ".join(x for x in (tokens, duration(self.seconds) if self.seconds is not None else "") if x)
        return f"{arrow} Thought" + (f" for {figures}" if figures else "")

    def _show_header(self) -> None:
        # no layout: the header is one row as wide as the message, whatever it says
        if self.is_mounted:
            self.query_one(".thought-header", Static).update(self.header(), layout=False)

    async def write(self, fragment: str, num_tokens: int, seconds: float) -> None:
        """More thinking, and the figures so far."""
        self.text += fragment
        self.num_tokens, self.seconds = num_tokens, seconds
        self._show_header()
        if self.expanded and fragment:
            if self._stream is None:
                self._stream = Markdown.get_stream(self.query_one(ThoughtBody))
            await self._stream.write(fragment)
            self._shown = len(self.text)

    async def finish(self, num_tokens: int | None, seconds: float | None) -> None:
        """The thinking ended (the answer started, or the reply ended): the header gives its final figures."""
        await self._stop_stream()
        self.streaming = False
        if num_tokens is not None:
            self.num_tokens = num_tokens
        if seconds is not None:
            self.seconds = seconds
        self._show_header()

    async def set_expanded(self, expanded: bool) -> None:
        self.expanded = expanded
        self.set_class(expanded, "-expanded")
        self._show_header()
        if not expanded:
            await self._stop_stream()
            return
        body = self.query_one(ThoughtBody)
        if self._shown == 0:  # all that came while collapsed, in one parse
            await body.update(self.text)
        elif self._shown < len(self.text):
            self._stream = Markdown.get_stream(body)
            await self._stream.write(self.text[self._shown:])
        self._shown = len(self.text)

    async def toggle(self) -> None:
        await self.set_expanded(not self.expanded)

    async def _stop_stream(self) -> None:
        if self._stream is not None:
            await self._stream.stop()
            self._stream = None

    async def on_click(self, event: events.Click) -> None:
        if event.widget is not None and event.widget.has_class("thought-header"):
            event.stop()
            await self.toggle()
