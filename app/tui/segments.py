"""Splitting a streamed Markdown reply into segments, each shown by its own Markdown widget.

Every append to a Markdown widget makes Textual re-lay out all of that widget's blocks, so one widget per reply
costs more per token the longer the reply grows (10 ms early, hundreds of ms near 3,000 tokens). Closing a
segment once it holds `min_chars` characters and streaming the rest into a new widget keeps the cost of each
append bounded by the size of the last segment.

A segment is only closed where two separate documents render exactly like one:
  - at the start of a line that follows a blank line, outside a fenced code block;
  - the new line starts a block with no top margin (a paragraph, a list, a table or a rule: not a heading,
    a quote, a fence, HTML, an indented line or a possible link reference definition), so the vertical gap is
    the previous block's bottom margin either way (Textual collapses sibling margins to their max, but not
    margins of blocks in different widgets);
  - after a list, never where the list might go on (a line starting with a list marker).
The rule looks at the first character of the next line only, so no text is ever held back. The few cases it
cannot see (a setext heading underline on the next line, HTML blocks spanning blank lines, link reference
definitions, which apply to the whole document) are caught when the reply ends: `cuts_render_alike` checks
the cuts against a parse of the whole reply, and the message falls back to one widget if they are not safe.
"""

from __future__ import annotations

import re

from markdown_it import MarkdownIt

DEFAULT_SEGMENT_CHARS = 1500
PARSER = MarkdownIt("gfm-like")  # Textual's Markdown parser; parsing keeps no state in it, so one serves all

_FENCE = re.compile(r"^([ \t]*)(`{3,}|~{3,})(.*)$")
_LIST_ITEM = re.compile(r"^[ \t]*(?:[-*+]|\d{1,9}[.)])(?:[ \t]|$)")
_NO_CUT_BEFORE = frozenset(" \t\r\n#>`~<[")  # blocks with a top margin, indented lines, HTML, link definitions
_LIST_GOES_ON = frozenset("-*+0123456789")
# top-level blocks with no top margin: a cut before them renders as the unsplit document does
SAFE_CUT_TOKENS = frozenset({"paragraph_open", "bullet_list_open", "ordered_list_open", "table_open", "hr"})


class MarkdownSegmenter:
    """Decides, as text streams in, where a new segment (Markdown widget) starts.

    `feed(text)` returns the text as a list of (new_segment, piece): `new_segment` True means `piece` starts
    a new segment. `cuts` lists the character offsets (into the whole text) where segments start.
    """

    def __init__(self, min_chars: int = DEFAULT_SEGMENT_CHARS) -> None:
        self.min_chars = min_chars
        self.cuts: list[int] = []
        self._offset = 0  # characters fed so far
        self._segment_start = 0  # offset where the current segment starts
        self._line = ""  # the current line, while incomplete
        self._fence: tuple[str, int, int] | None = None  # (char, length, indent) of the open code fence
        self._block: str | None = None  # kind of the last block: "para", "list", "code", "fence", "other"
        self._after_blank = False  # a blank line (outside a fence) ended the last line

    def feed(self, text: str) -> list[tuple[bool, str]]:
        out: list[tuple[bool, str]] = []
        new, start, i, n = False, 0, 0, len(text)
        while i < n:
            if not self._line and self._can_cut(text[i], self._offset + i):
                if i > start:
                    out.append((new, text[start:i]))
                self.cuts.append(self._offset + i)
                self._segment_start = self._offset + i
                new, start = True, i
            j = text.find("\n", i)
            if j < 0:
                self._line += text[i:]
                break
            self._end_line(self._line + text[i:j])
            self._line = ""
            i = j + 1
        if n > start or new:
            out.append((new, text[start:]))
        self._offset += n
        return out

    def _can_cut(self, ch: str, offset: int) -> bool:
        return (self._after_blank and self._fence is None and offset - self._segment_start >= self.min_chars
                and ch not in _NO_CUT_BEFORE and not (self._block == "list" and ch in _LIST_GOES_ON))

    def _end_line(self, line: str) -> None:
        if self._fence is not None:
            char, length, indent = self._fence
            m = _FENCE.match(line)
            if (m and m.group(2)[0] == char and len(m.group(2)) >= length and not m.group(3).strip()
                    and len(m.group(1).expandtabs(4)) <= (3 if indent <= 3 else indent + 3)):
                self._fence = None
            return
        if not line.strip():
            if self._block is not None:
                self._after_blank = True
            return
        m = _FENCE.match(line)
        if m and not (m.group(2)[0] == "`" and "`" in m.group(3)):
            self._fence = (m.group(2)[0], len(m.group(2)), len(m.group(1).expandtabs(4)))
            self._block = "fence"
        elif _LIST_ITEM.match(line):
            self._block = "list"
        elif self._after_blank or self._block is None:
            if line[:1] in (" ", "\t"):
                self._block = "list" if self._block == "list" else "code"
            else:
                self._block = "para" if line[0].isalnum() else "other"
        self._after_blank = False


def cuts_render_alike(text: str, cuts: list[int]) -> bool:
    """Whether `text` cut at the character offsets `cuts` renders, one Markdown widget per piece, as the whole
    text does in one: every cut starts a top-level block with no top margin, and no link reference
    definitions (they apply to the whole document)."""
    if not cuts:
        return True
    env: dict = {}
    tokens = PARSER.parse(text, env)
    if env.get("references"):
        return False
    starts = {t.map[0]: t.type for t in tokens if t.level == 0 and t.nesting >= 0 and t.map is not None}
    return all(starts.get(text.count("\n", 0, cut)) in SAFE_CUT_TOKENS for cut in cuts)
