"""A reply's Markdown widget (or one segment of a long streamed reply), with its height cached by width and its
drafted text tinted."""

from __future__ import annotations

import re
from typing import Any

from textual.geometry import Size
from textual.widgets import Markdown

from app.tui.drafted import draft_spans, drafted_block_class
from app.tui.segments import PARSER


class MarkdownSegment(Markdown):
    """A reply's Markdown (or one segment of a long streamed reply) whose height is cached by width.

    Textual computes an auto-height container's height by re-arranging its children against the size of its
    parent, so while a reply streams and its MessageView grows, every segment would be re-laid out, block by
    block, on every append. Blocks are all auto-height, so a segment's height depends only on the width and
    on its own content: cache it on those (`_layout_updates` counts layout changes below this widget).
    It also shares one Markdown parser (Textual builds a new one, ~1 ms, for every append).

    Text that came from a speculative draft (`drafted`: the reply's ranges, shared with its MessageView;
    `reply_offset`: where this segment starts in the reply) is shown in the `draft` component style."""

    COMPONENT_CLASSES = {"draft"}
    DEFAULT_CSS = "MarkdownSegment > .draft { color: $text-success; }"

    def __init__(self, *args, drafted: list[int] | None = None, reply_offset: int = 0, **kwargs) -> None:
        kwargs.setdefault("parser_factory", lambda: self)  # parse() below: Textual calls parser.parse(text)
        super().__init__(*args, **kwargs)
        self._height_cache: tuple[object, int] = (None, 0)
        self.drafted: list[int] = drafted if drafted is not None else []
        self.reply_offset = reply_offset
        self._parsed = ""  # the text of the last parse: all of this segment (update) or its last lines (append)
        self._parsed_at = 0  # where it starts in this segment
        self._line_starts: list[int] | None = None

    def parse(self, text: str, env: dict | None = None) -> list:
        self._parsed, self._parsed_at, self._line_starts = text, len(self._markdown) - len(text), None
        return PARSER.parse(text, env)

    def get_block_class(self, block_name: str) -> type:
        cls = super().get_block_class(block_name)
        return drafted_block_class(cls) if self.drafted else cls

    def draft_spans(self, plain: str, token: Any) -> list:
        """The `.draft` spans of a block rendered as `plain` from `token` (of the last parse)."""
        if not self.drafted or token.map is None:
            return []
        if self._line_starts is None:
            self._line_starts = [0, *(m.end() for m in re.finditer("\n", self._parsed))]
        starts, n = self._line_starts, len(self._parsed)
        first, last = token.map
        a = starts[first] if first < len(starts) else n
        b = starts[last] if last < len(starts) else n
        return draft_spans(plain, self._parsed[a:b], self.reply_offset + self._parsed_at + a, self.drafted)

    def get_content_height(self, container: Size, viewport: Size, width: int) -> int:
        key = (width, self._nodes._updates, self._layout_updates, self.styles._cache_key)
        if self._height_cache[0] != key:
            self._height_cache = (key, super().get_content_height(container, viewport, width))
        return self._height_cache[1]
