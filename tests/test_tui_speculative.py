"""Speculative decoding in the chat app: the per-chat setting, drafted text shown apart in the streamed reply,
acceptance in the stats bar, and a refused mode shown like any request error (fake engine, no model)."""

from __future__ import annotations

import pytest
from textual.content import Span
from textual.geometry import Region
from textual.widgets.markdown import MarkdownBlock, MarkdownFence

from app.tui.drafted import add_marks, clip, draft_spans, overlaps
from tests.support.tui_fake_engine import FAKE_DRAFT_NAME, FakeReply
from app.tui.screens.settings import SettingsScreen, sampling_params
from app.tui.store import ChatSettings, ChatStore
from app.tui.streaming import TokenBuffer
from app.tui.widgets.messages import MarkdownSegment, MessageView
from app.tui.widgets.stats import LiveStats, StatsBar
from mlx_engine.api import NO_DRAFT_MODEL, GenerationEvent, RequestError, Stats, Usage
from tests.support.tui_helpers import idle, make_app, ready, send, transcript, wait_for

D = ".draft"


# ---- settings ----------------------------------------------------------------------------------------------


def test_speculative_settings_default_to_auto_and_old_stores_still_load(tmp_path) -> None:
    assert ChatSettings().speculative == "auto" and ChatSettings().num_draft_tokens == 4
    old = ChatSettings.from_json('{"temperature": 0.3, "top_p": 1.0, "top_k": 0, "min_p": 0.0, '
                                 '"repetition_penalty": 1.0, "max_tokens": 512, "seed": null, "system_prompt": ""}')
    assert old == ChatSettings(temperature=0.3, speculative="auto", num_draft_tokens=4)
    store = ChatStore(tmp_path / "chats.db")
    chat = store.create_chat("c", settings=ChatSettings(speculative=None, num_draft_tokens=7))
    assert store.get_chat(chat.id).settings.speculative is None  # off survives the round trip
    assert store.get_chat(chat.id).settings.num_draft_tokens == 7
    store.close()
    p = sampling_params(ChatSettings(speculative="prompt-lookup", num_draft_tokens=9))
    assert (p.speculative, p.num_draft_tokens) == ("prompt-lookup", 9)
    with pytest.raises(RequestError, match=r"num_draft_tokens=0"):
        sampling_params(ChatSettings(num_draft_tokens=0))


# ---- drafted ranges: from events to reply offsets to rendered spans ---------------------------------------


def ev(text: str, *drafted: bool) -> GenerationEvent:
    return GenerationEvent(text=text, token_ids=tuple(range(len(drafted))), from_draft=drafted)


def test_token_buffer_marks_the_text_of_drafted_tokens() -> None:
    buf = TokenBuffer()
    for e in [ev("The", False), ev(" cat", True), ev(" sat", True), ev("", True), ev(" on", False),
              ev(" the", True, False), ev(" mat", True)]:
        buf.push(e)
    d = buf.drain()
    assert d.text == "The cat sat on the mat" and d.num_tokens == 8
    assert d.drafted == [3, 11, 18, 22]  # " cat sat" joined; " the" mixed: not drafted; " mat"
    buf.push(ev("!", True))
    assert buf.drain().drafted == [0, 1]  # relative to each drain
    buf.push(ev("?", False))
    assert buf.drain().drafted == []


def test_marks_join_and_clip() -> None:
    marks: list[int] = []
    add_marks(marks, 10, [0, 3, 5, 6])
    add_marks(marks, 16, [0, 2])  # touches [15, 16): joined
    assert marks == [10, 13, 15, 18]
    assert overlaps(marks, 12, 14) and overlaps(marks, 0, 11) and not overlaps(marks, 13, 15)
    assert not overlaps(marks, 18, 30)
    assert clip(marks, 11, 6) == [Span(0, 2, D), Span(4, 6, D)]


def test_draft_spans_follow_rendered_text_past_markup() -> None:
    src = "The **capital** of\n[France](http://fr.example) is  Paris."
    plain = "The capital of France is Paris."
    # drafted in the source: "capital" (6-13), " of\n[Fr" (15-22) and "Paris" (51-56); the link target is
    # skipped, the line break is the rendered space after "of"
    marks = [106, 113, 115, 122, 151, 156]
    assert draft_spans(plain, src, 100, marks) == [Span(4, 17, D), Span(25, 30, D)]  # "capital of Fr", "Paris"
    assert draft_spans(plain, src, 200, marks) == []  # no overlap: nothing to do
    assert draft_spans("x = 1", "```py\nx = 1\n```\n", 0, [8, 11]) == [Span(2, 5, D)]  # verbatim: one clip


# ---- the app ------------------------------------------------------------------------------------------------

REPLY = "The capital of **France** is Paris.\n\n```\nx = 1\n```\n\n- one two"
# FakeTokenizer pieces: The| capital| of| *|*|France|*|*| is| Paris|.|\n\n|`|`|`|\n|x| =| 1|\n|`|`|`|\n\n|-| one| two
DRAFTED = (False, True, True, False, True, True, False, True, True, False, True, False,
           False, False, False, False, True, True, False, False, False, False, False, False, False, True, True)


def draft_spans_of(view: MessageView) -> list[tuple[str, str, list[Span]]]:
    out = []
    for block in view.query(MarkdownBlock):
        content = block._highlighted_code if isinstance(block, MarkdownFence) else block._content
        if content.plain:
            out.append((type(block).__name__, content.plain, [s for s in content.spans if s.style == D]))
    return out


@pytest.mark.asyncio
async def test_drafted_tokens_are_shown_apart_and_the_stats_bar_shows_acceptance(tmp_path) -> None:
    reply = FakeReply(REPLY, drafted=DRAFTED, acceptance_rate=0.75, mean_accepted_tokens=2.5)
    app, backend = make_app(tmp_path, script=[reply], tokens_per_s=2000)
    async with app.run_test(size=(120, 30)) as pilot:
        await ready(pilot)
        await send(pilot, "hi")
        await idle(pilot)
        assert backend.engine.requests[-1].sampling.speculative == "auto"  # the app's default
        view = app.chat_screen.query(MessageView).last()
        assert view.content == REPLY
        assert [view.content[a:b] for a, b in zip(view.drafted[::2], view.drafted[1::2])] == [
            " capital of", "*France", "* is", ".", "x =", " one two"]
        assert draft_spans_of(view) == [
            ("MarkdownParagraph", "The capital of France is Paris.",
             [Span(3, 14, D), Span(15, 24, D), Span(30, 31, D)]),
            ("MarkdownFence", "x = 1", [Span(0, 3, D)]),
            ("MarkdownParagraph", "one two", [Span(0, 7, D)]),
        ]
        paragraph = view.query(MarkdownBlock).first()
        strip = paragraph.render_lines(Region(0, 0, paragraph.size.width, 1))[0]
        line = [(seg.text, seg.style.color) for seg in strip][:7]  # then the padding to the width
        draft = view.query_one(MarkdownSegment).get_component_rich_style("draft").color
        plain = line[0][1]
        assert draft != plain and draft.triplet.hex == "#8ad4a1"  # $text-success of textual-dark
        assert line == [("The", plain), (" capital of", draft), (" ", plain), ("France", draft), (" is", draft),
                        (" Paris", plain), (".", draft)]

        line = app.chat_screen.stats.render_line().splitlines()[0]
        assert line.endswith("│ prompt 15 · reply 27 │ ctx 42/2,048 │ drafted (tinted) 75% accepted · 2.5 per verify · 16 forwards")
        assert "drafted (tinted) 75% accepted · 2.5 per verify · 16 forwards" in str(app.chat_screen.query_one(StatsBar).render())
        (chat,) = app.store.list_chats()
        stats = app.store.messages(chat.id)[-1].stats
        assert (stats["acceptance_rate"], stats["mean_accepted_tokens"], stats["target_forwards"]) == (0.75, 2.5, 16)

        # a plain reply (speculation off) renders with Textual's own blocks and shows no acceptance
        app.chat_screen.chat.settings = ChatSettings(temperature=0.0, speculative=None)
        await send(pilot, "again")
        await idle(pilot)
        assert backend.engine.requests[-1].sampling.speculative is None
        view = app.chat_screen.query(MessageView).last()
        assert view.drafted == [] and all(spans == [] for _, _, spans in draft_spans_of(view))
        assert {type(b).__module__ for b in view.query(MarkdownBlock)} == {"textual.widgets._markdown"}
        assert "drafts" not in app.chat_screen.stats.render_line()


@pytest.mark.asyncio
async def test_drafted_text_keeps_its_place_across_segments(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(MessageView, "segment_chars", 1)  # a new Markdown widget at each allowed cut
    text = "Alpha beta.\n\nGamma delta.\n\nEpsilon zeta."  # pieces: Alpha| beta|.|\n\n|Gamma| delta|.|\n\n|...
    drafted = (False, True, False, False, True, False, False, False, False, True, True)
    app, _ = make_app(tmp_path, script=[FakeReply(text, drafted=drafted)], tokens_per_s=2000)
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot)
        await send(pilot, "hi")
        await idle(pilot)
        view = app.chat_screen.query(MessageView).last()
        assert [s.reply_offset for s in view.query_children(MarkdownSegment)] == [0, 13, 27]
        assert draft_spans_of(view) == [("MarkdownParagraph", "Alpha beta.", [Span(5, 10, D)]),
                                        ("MarkdownParagraph", "Gamma delta.", [Span(0, 5, D)]),
                                        ("MarkdownParagraph", "Epsilon zeta.", [Span(7, 13, D)])]


@pytest.mark.asyncio
async def test_settings_form_sets_the_mode_and_draft_tokens(tmp_path) -> None:
    app, backend = make_app(tmp_path, script=["ok"])
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot)
        await send(pilot, "hi")
        await idle(pilot)
        await pilot.press("ctrl+s")
        screen = app.screen
        assert isinstance(screen, SettingsScreen)
        assert (screen.query_one("#speculative").value, screen.query_one("#num_draft_tokens").value) == ("auto", "4")
        screen.query_one("#speculative").value = "medusa"
        await pilot.press("ctrl+s")
        assert app.screen is screen  # refused, with the engine's message
        assert "invalid sampling parameter speculative='medusa'" in str(screen.query_one("#error").render())
        screen.query_one("#speculative").value = "self"
        screen.query_one("#num_draft_tokens").value = "17"
        await pilot.press("ctrl+s")
        assert "num_draft_tokens=17: expected an integer in [1, 16]" in str(screen.query_one("#error").render())
        screen.query_one("#num_draft_tokens").value = "6"
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: app.screen is app.chat_screen, what="settings closed")
        await send(pilot, "again")
        await idle(pilot)
        p = backend.engine.requests[-1].sampling
        assert (p.speculative, p.num_draft_tokens) == ("self", 6)
        chat_id = app.chat_screen.chat.id

        await pilot.press("ctrl+s")
        app.screen.query_one("#speculative").value = "off"
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: app.screen is app.chat_screen, what="settings closed")
        await send(pilot, "plain")
        await idle(pilot)
        assert backend.engine.requests[-1].sampling.speculative is None
    store = ChatStore(tmp_path / "chats.db")
    s = store.get_chat(chat_id).settings
    assert (s.speculative, s.num_draft_tokens) == (None, 6)
    store.close()


@pytest.mark.asyncio
async def test_a_refused_speculative_mode_is_shown_in_the_chat_and_nothing_is_lost(tmp_path) -> None:
    app, backend = make_app(tmp_path, script=["Fine."])
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot)
        app.default_settings = ChatSettings(temperature=0.0, speculative="draft")
        await send(pilot, "hello there")
        await idle(pilot)
        message = NO_DRAFT_MODEL
        assert transcript(app) == [("user", "done", "hello there"), ("assistant", "error", "")]
        view = app.chat_screen.query(MessageView).last()
        assert view.error == message
        assert any(n.message == message for n in app._notifications)
        (chat,) = app.store.list_chats()
        stored = app.store.messages(chat.id)
        assert [(m.role, m.content, m.status) for m in stored] == [("user", "hello there", "done"),
                                                                     ("assistant", "", "error")]
        assert stored[-1].stats == {"error": message}
        assert backend.engine.requests == []  # refused before it started

        app.chat_screen.chat.settings = ChatSettings(temperature=0.0, speculative="prompt-lookup")
        await pilot.press("ctrl+r")  # regenerate: the user's message is still there to answer
        await idle(pilot)
        assert transcript(app) == [("user", "done", "hello there"), ("assistant", "done", "Fine.")]
        assert backend.engine.requests[-1].messages == [{"role": "user", "content": "hello there"}]


@pytest.mark.asyncio
async def test_a_loaded_draft_model_is_named_in_the_title_and_drafts(tmp_path) -> None:
    """`roofline chat --draft-model M`: the title bar names the draft beside the model, and "draft" is served."""
    app, backend = make_app(tmp_path, script=["Fine."], draft_model=True)
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot)
        assert app.sub_title == f"FakeLM-1M (test) · MLX on CPU · draft {FAKE_DRAFT_NAME}"
        app.default_settings = ChatSettings(temperature=0.0, speculative="draft")
        await send(pilot, "hello there")
        await idle(pilot)
        assert transcript(app) == [("user", "done", "hello there"), ("assistant", "done", "Fine.")]
        assert backend.engine.requests[-1].sampling.speculative == "draft"


def test_stats_line_without_and_with_speculation() -> None:
    base = dict(decode_tps=41.3, ttft_s=0.18, prompt_tokens=31, reply_tokens=64, context_length=8192)
    assert LiveStats(**base).render_line().splitlines()[0] == \
        "41.3 tok/s │ TTFT 0.18 s │ prompt 31 · reply 64 │ ctx 95/8,192"
    line = LiveStats(**base, acceptance_rate=0.6667, mean_accepted_tokens=2.0, target_forwards=1234).render_line()
    assert line.splitlines()[0] == \
        "41.3 tok/s │ TTFT 0.18 s │ prompt 31 · reply 64 │ ctx 95/8,192 │ drafted (tinted) 67% accepted · 2.0 per verify · 1,234 forwards"
    stats = Stats(0.1, 1.0, 1.0, 0, acceptance_rate=0.0, mean_accepted_tokens=0.0, target_forwards=3)
    assert stats.acceptance_rate == 0.0 and Usage(1, 3).total_tokens == 4
    zero = LiveStats(**base, acceptance_rate=0.0, mean_accepted_tokens=0.0, target_forwards=3).render_line()
    assert zero.splitlines()[0].endswith("│ drafted (tinted) 0% accepted · 0.0 per verify · 3 forwards")  # drafts were tried, none accepted
