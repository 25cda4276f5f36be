"""Showing which text of a streamed reply came from a speculative draft.

A reply keeps the character ranges of its drafted text as one flat sorted list of [start, end) offsets into
the reply (`marks`). Its Markdown widgets build their blocks from draft-aware subclasses of Textual's blocks,
which add a `.draft` span over each rendered character whose source character is drafted. Rendered text is
matched to its source by one forward scan (markup such as `**`, `#` or a link's target is skipped over), so
the cost is a pass over the block, paid only by blocks that overlap a drafted range: a reply without drafts
renders exactly as before.
"""

from __future__ import annotations

import re
from bisect import bisect_right
from collections.abc import Sequence
from typing import Any

from textual.content import Content, Span
from textual.widgets.markdown import MarkdownBlock, MarkdownFence

DRAFT_STYLE = ".draft"  # a component class of the reply's Markdown widget
_WS = re.compile(r"\s+")


def add_marks(marks: list[int], offset: int, ranges: Sequence[int]) -> None:
    """Appends `ranges` ([start, end, ...] relative to `offset`) to `marks`, joining touching ranges."""
    for i in range(0, len(ranges), 2):
        start, end = ranges[i] + offset, ranges[i + 1] + offset
        if marks and marks[-1] == start:
            marks[-1] = end
        else:
            marks += (start, end)


def is_drafted(marks: list[int], offset: int) -> bool:
    return bisect_right(marks, offset) % 2 == 1


def overlaps(marks: list[int], start: int, end: int) -> bool:
    i = bisect_right(marks, start)
    return i % 2 == 1 or (i < len(marks) and marks[i] < end)


def clip(marks: list[int], start: int, length: int) -> list[Span]:
    """`.draft` spans of the text at [start, start + length) of the reply, relative to `start`."""
    end = start + length
    i = bisect_right(marks, start)
    i -= i % 2
    out = []
    while i < len(marks) and marks[i] < end:
        a, b = max(marks[i], start), min(marks[i + 1], end)
        if a < b:
            out.append(Span(a - start, b - start, DRAFT_STYLE))
        i += 2
    return out


def draft_spans(plain: str, source: str, base: int, marks: list[int]) -> list[Span]:
    """`.draft` spans over the characters of `plain` (a block's rendered text) whose source characters, found
    in order in `source` (the block's Markdown, at offset `base` of the reply), are drafted."""
    if not plain or not overlaps(marks, base, base + len(source)):
        return []
    at = source.find(plain)
    if at >= 0:  # rendered as written (code, a plain line): one clip
        return clip(marks, base + at, len(plain))
    spans: list[Span] = []
    j, run = 0, -1
    for i, ch in enumerate(plain):
        if ch.isspace():  # collapsed whitespace or a line break: the next whitespace run of the source
            m = _WS.search(source, j)
            k, after = (m.start(), m.end()) if m else (-1, j)
        else:
            k = source.find(ch, j)
            after = k + 1
        drafted = False
        if k >= 0:  # else a character with no source (an image marker): not drafted, and the scan stays put
            drafted = is_drafted(marks, base + k)
            j = after
        if drafted and run < 0:
            run = i
        elif not drafted and run >= 0:
            spans.append(Span(run, i, DRAFT_STYLE))
            run = -1
    if run >= 0:
        spans.append(Span(run, len(plain), DRAFT_STYLE))
    return spans


def with_draft_spans(content: Content, spans: list[Span]) -> Content:
    return Content(content.plain, [*content.spans, *spans]) if spans else content


class _DraftedInline:
    """Mixed in before a Textual block whose text comes from an inline token (paragraph, heading, cell)."""

    def _token_to_content(self, token: Any) -> Content:
        content = super()._token_to_content(token)  # type: ignore[misc]
        return with_draft_spans(content, self._markdown.draft_spans(content.plain, token))  # type: ignore[attr-defined]


class _DraftedFence:
    """Mixed in before MarkdownFence: the highlighted code gets the spans (again after a theme change)."""

    def __init__(self, markdown: Any, token: Any, code: str) -> None:
        super().__init__(markdown, token, code)  # type: ignore[call-arg]
        self._add_draft_spans()

    def _add_draft_spans(self) -> None:
        code = self._highlighted_code  # type: ignore[has-type]
        spans = self._markdown.draft_spans(code.plain, self._token)  # type: ignore[attr-defined]
        self._highlighted_code = with_draft_spans(code, spans)

    def notify_style_update(self) -> None:
        super().notify_style_update()  # type: ignore[misc]
        self._add_draft_spans()
        self.set_content(self._highlighted_code)  # type: ignore[attr-defined]


_CLASSES: dict[type, type] = {}


def drafted_block_class(cls: type[MarkdownBlock]) -> type[MarkdownBlock]:
    """`cls` with draft spans, under the same name (so CSS type selectors and snapshots see the same blocks)."""
    if cls not in _CLASSES:
        mixin = _DraftedFence if issubclass(cls, MarkdownFence) else _DraftedInline
        _CLASSES[cls] = type(cls.__name__, (mixin, cls), {"__module__": __name__})
    return _CLASSES[cls]
