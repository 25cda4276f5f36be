"""The reasoning parser on token sequences (tags as one token each, and spelled by text tokens split every way), its
budget's masks, the template variables a reasoning_effort becomes, and the family read from template and tokenizer."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_engine.api import RequestError
from mlx_engine.reasoning import ThinkParser, ThinkTags, reasoning_family, template_kwargs

OPEN_ID, CLOSE_ID = 126, 127
ID_TAGS = ThinkTags(open_id=OPEN_ID, close_id=CLOSE_ID, close_ids=(CLOSE_ID,))
CLOSE_TEXT_IDS = tuple(b"</think>")
TEXT_TAGS = ThinkTags(open_id=None, close_id=None, close_ids=CLOSE_TEXT_IDS)
V = 128


def run(parser: ThinkParser, tokens: list[tuple[int, str]]) -> tuple[str, str, list[bool]]:
    """Feeds every token, then flushes: (reasoning, answer, whether each token was the answer's)."""
    r, a, kinds = [], [], []
    for token_id, text in tokens:
        got_r, got_a = parser.feed(token_id, text)
        r.append(got_r)
        a.append(got_a)
        kinds.append(parser.answer_token)
    tail_r, tail_a = parser.flush()
    return "".join(r) + tail_r, "".join(a) + tail_a, kinds


def text_tokens(pieces: list[str]) -> list[tuple[int, str]]:
    return [(1000 + i, p) for i, p in enumerate(pieces)]


def test_tag_tokens_split_the_reply_by_id() -> None:
    p = ThinkParser(ID_TAGS, opened=True)
    tokens = [(1, "\n"), (2, "Why"), (3, " not"), (4, "?\n"), (CLOSE_ID, "</think>"), (5, "\n\n"), (6, "Sure"),
              (7, "!")]
    assert run(p, tokens) == ("Why not?", "Sure!", [False] * 5 + [True] * 3)
    assert (p.num_tokens, p.num_thinking) == (5, 4)


def test_a_reply_that_opens_its_reasoning_and_one_that_does_not() -> None:
    p = ThinkParser(ID_TAGS, opened=False)
    tokens = [(1, "\n"), (OPEN_ID, "<think>"), (2, "hm"), (CLOSE_ID, "</think>"), (3, "ok")]
    assert run(p, tokens) == ("hm", "ok", [True, False, False, False, True])
    assert p.num_tokens == 3
    p = ThinkParser(ID_TAGS, opened=False)
    assert run(p, [(1, "\n"), (2, "Hi"), (OPEN_ID, "<think>"), (3, "!")]) == ("", "\nHi<think>!", [True] * 4)
    assert p.num_tokens == 0


def test_tag_text_from_other_tokens_stays_text_where_the_tags_are_tokens() -> None:
    p = ThinkParser(ID_TAGS, opened=True)
    tokens = [(1, "a </"), (2, "think> b"), (CLOSE_ID, "</think>"), (3, "<think>x</think>")]
    assert run(p, tokens)[:2] == ("a </think> b", "<think>x</think>")


REPLY = "\n Let me see: <b> is bold.\n</think>\n\nIt is <b>.</think> done"


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, len(REPLY) - 1), unique=True), st.booleans())
def test_text_tags_split_across_tokens_never_leak(cuts: list[int], opened: bool) -> None:
    reply = REPLY if opened else "<think>" + REPLY
    if not opened:
        cuts = [0, *(c + 7 for c in cuts)]
    bounds = [0, *sorted(set(cuts) - {0}), len(reply)]
    pieces = [reply[a:b] for a, b in zip(bounds, bounds[1:])]
    p = ThinkParser(TEXT_TAGS, opened=opened)
    outs = []
    for token_id, text in text_tokens(pieces):
        r, a = p.feed(token_id, text)
        assert "<think>" not in r + a and "</think>" not in r, (pieces, r, a)
        outs.append((r, a))
    tail = p.flush()
    assert "".join(r for r, _ in outs) + tail[0] == "Let me see: <b> is bold."
    assert "".join(a for _, a in outs) + tail[1] == "It is <b>.</think> done"


def test_text_opener_held_until_it_is_not_one() -> None:
    p = ThinkParser(TEXT_TAGS, opened=False)
    assert p.feed(1, " <th") == ("", "")
    assert p.feed(2, "e end") == ("", " <the end")
    p = ThinkParser(TEXT_TAGS, opened=True)
    assert p.feed(1, "x </th") == ("x", "")
    assert p.flush() == (" </th", "")  # cut off inside the closer: what was held is reasoning


def test_budget_forces_the_closer_token_after_exactly_n() -> None:
    p = ThinkParser(ID_TAGS, opened=True, budget=2)
    assert not p.steers(1) and p.mask(None, V) is None and p.draft_room(0, False) == 1
    p.feed(1, "a")
    assert p.steers(1) and not p.steers(0) and p.draft_room(0, False) == 0
    p.feed(2, "b")
    forced = p.mask(None, V)
    assert forced is not None and np.flatnonzero(forced).tolist() == [CLOSE_ID]
    p.feed(CLOSE_ID, "</think>")
    assert not p.budgeted and not p.steers(5) and p.mask(None, V) is None and p.draft_room(3, True) is None
    assert p.feed(3, "ok") == ("", "ok") and (p.num_tokens, p.num_thinking) == (3, 2)


def test_budget_writes_a_text_closer_token_by_token() -> None:
    p = ThinkParser(TEXT_TAGS, opened=True, budget=1)
    p.feed(1, "x")
    written = []
    while p.budgeted:
        token = int(np.flatnonzero(p.mask(None, V))[0])
        written.append(token)
        p.feed(token, chr(token))
    assert tuple(written) == CLOSE_TEXT_IDS and p.feed(2, "\nhi") == ("", "hi")
    assert p.num_tokens == 1 + len(CLOSE_TEXT_IDS)


def test_masks_before_the_reply_opens() -> None:
    grammar = np.zeros(V, dtype=bool)
    grammar[[10, 20]] = True
    p = ThinkParser(ID_TAGS, opened=False)
    assert p.mask(None, V) is None  # free to think or not
    assert np.flatnonzero(p.mask(grammar, V)).tolist() == [10, 20, OPEN_ID]  # the grammar's answer, or thinking
    assert p.draft_room(0, True) == 0 and p.answering
    none = ThinkParser(ID_TAGS, opened=False, budget=0)
    assert none.steers(0) and np.flatnonzero(~none.mask(None, V)).tolist() == [OPEN_ID]
    assert np.flatnonzero(none.mask(grammar, V)).tolist() == [10, 20]
    opened = ThinkParser(ID_TAGS, opened=True, budget=0)
    assert np.flatnonzero(opened.mask(grammar, V)).tolist() == [CLOSE_ID]  # the grammar waits for the answer
    assert not opened.answering


def test_reasoning_effort_becomes_template_variables() -> None:
    assert template_kwargs("think", None, "none") == {"reasoning_effort": "none", "enable_thinking": False}
    assert template_kwargs("think", None, "minimal")["enable_thinking"] is False
    assert template_kwargs("think", None, "high") == {"reasoning_effort": "high"}
    assert template_kwargs("think", {"enable_thinking": True}, "none")["enable_thinking"] is True
    assert template_kwargs(None, None, "none") == {"reasoning_effort": "none"}  # no thinking to turn off
    assert template_kwargs(None, {"x": 1}, None) == {"x": 1}
    with pytest.raises(RequestError, match="'add_generation_prompt' is the request's own field"):
        template_kwargs("think", {"add_generation_prompt": False}, None)


class _Tok:
    def __init__(self, template: str | None, vocab: dict[str, int] | None = None):
        self.chat_template = template
        self.vocab = vocab or {}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [self.vocab[text]] if text in self.vocab else list(text.encode())

    def decode(self, ids: list[int]) -> str:
        names = {i: t for t, i in self.vocab.items()}
        return "".join(names.get(i, chr(i)) for i in ids)


def test_the_family_comes_from_the_template_and_the_tokenizer_not_the_name() -> None:
    assert reasoning_family(_Tok("{{ messages }}<think>{{ x }}</think>")) == "think"
    assert reasoning_family(_Tok("{{ messages }}")) is None
    assert reasoning_family(_Tok(None)) is None
    assert reasoning_family(object()) is None
