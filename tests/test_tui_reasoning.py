"""A reasoning model in the chat app: its thinking streams into a collapsed block above the answer, F5 expands it,
it is saved with the chat (a schema migration keeps older databases) and never sent back; F9 and the settings set
the thinking effort; a model without reasoning shows none of it. Against the scripted fake engine."""

from __future__ import annotations

import pytest

from app.tui.screens.settings import NO_REASONING, SettingsScreen
from app.tui.store import ChatSettings, ChatStore
from app.tui.streaming import TokenBuffer
from app.tui.widgets.messages import MessageView
from app.tui.widgets.stats import LiveStats
from app.tui.widgets.thought import ThoughtBody, ThoughtView
from mlx_engine.api import GenerationEvent, Usage
from tests.support.tui_fake_engine import FakeReply
from tests.support.tui_helpers import idle, make_app, ready, screen_text, send, transcript, wait_for

SIZE = (100, 30)
THOUGHT = "The user asks for six times seven. Six sevens are forty-two."
ANSWER = "It is **42**."
THOUGHT_TOKENS = 16  # the fake tokenizer's 15 pieces of THOUGHT, and the closer


def replies(app) -> list[MessageView]:
    return [v for v in app.chat_screen.query(MessageView) if v.role == "assistant"]


def header(view: MessageView) -> str:
    assert view.thought is not None
    return str(view.thought.query_one(".thought-header").render())


def shown(view: MessageView) -> bool:
    """Whether the thought's text is on screen (expanded), not just kept."""
    assert view.thought is not None
    return view.thought.query_one(ThoughtBody).display


@pytest.mark.asyncio
async def test_thinking_streams_collapsed_above_the_answer_and_f5_expands_it(tmp_path) -> None:
    app, backend = make_app(tmp_path, script=[FakeReply(ANSWER, thought=THOUGHT, hold_after=5)], reasoning="think",
                            tokens_per_s=2000)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "What is 6 x 7?")
        await wait_for(pilot, lambda: replies(app) and replies(app)[0].thought is not None
                       and replies(app)[0].thought.num_tokens == 5, what="five tokens of thinking")
        (view,) = replies(app)
        assert header(view) == "▸ Thinking… (5 tokens)" and not shown(view)
        await wait_for(pilot, lambda: "reply 5 (5 thinking)" in screen_text(app), what="the stats bar's share")
        assert view.content == "" and "The user asks" not in screen_text(app)
        await pilot.press("f5")  # expanded while it streams: what came so far, then the rest as it comes
        assert shown(view) and "The user asks for six" in screen_text(app)
        backend.engine.release()
        await idle(pilot)
        assert view.thought.text == view.reasoning == THOUGHT and view.content == ANSWER
        assert header(view).startswith(f"▾ Thought for {THOUGHT_TOKENS} tokens / ") and header(view).endswith(" s")
        text = screen_text(app)
        assert "Six sevens are forty-two." in text and "It is 42." in text
        assert text.index("Thought for") < text.index("Six sevens") < text.index("It is 42.")
        await pilot.press("f5")
        assert not shown(view) and "Six sevens" not in screen_text(app)
        assert f"({THOUGHT_TOKENS} thinking)" in screen_text(app)  # the stats bar's share of the reply
        await pilot.click(".thought-header")  # a click on the header toggles it too
        assert shown(view)


@pytest.mark.asyncio
async def test_f5_acts_on_the_focused_reply_else_the_last_and_is_in_help_and_the_palette(tmp_path) -> None:
    app, _ = make_app(tmp_path, script=[FakeReply("One.", thought="First thought."),
                                        FakeReply("Two.", thought="Second thought.")], reasoning="think")
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "a")
        await idle(pilot)
        await send(pilot, "b")
        await idle(pilot)
        first, last = replies(app)
        await pilot.press("f5")  # the input has focus: the last reply's
        assert (shown(first), shown(last)) == (False, True)
        first.focus()
        await pilot.press("f5")
        assert (shown(first), shown(last)) == (True, True)
        titles = {c.title for c in app.get_system_commands(app.chat_screen)}
        assert {"Show or hide thinking", "Thinking effort"} <= titles
        rows = dict(dict(app.key_sections())["Chat"])
        assert "thinking" in rows["f5"] and "thinking effort" in rows["f9"].lower()
        assert "f5 Thinking" in screen_text(app) and "f9 Effort" in screen_text(app)  # the footer


@pytest.mark.asyncio
async def test_the_thought_is_saved_restored_collapsed_and_never_sent_back(tmp_path) -> None:
    app, backend = make_app(tmp_path, script=[FakeReply(ANSWER, thought=THOUGHT), FakeReply("Yes.", thought="Sure.")],
                            reasoning="think")
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "What is 6 x 7?")
        await idle(pilot)
        await send(pilot, "Sure?")
        await idle(pilot)
        # the second turn's prompt has the first answer, not its thinking (templates drop earlier thinking)
        assert backend.engine.requests[1].messages == [{"role": "user", "content": "What is 6 x 7?"},
                                                       {"role": "assistant", "content": ANSWER},
                                                       {"role": "user", "content": "Sure?"}]
        chat_id = app.chat_screen.chat.id
    store = ChatStore(tmp_path / "chats.db")
    saved = [(m.role, m.content, m.reasoning, m.stats.get("reasoning_tokens")) for m in store.messages(chat_id)]
    store.close()
    assert saved == [("user", "What is 6 x 7?", "", None), ("assistant", ANSWER, THOUGHT, THOUGHT_TOKENS),
                     ("user", "Sure?", "", None), ("assistant", "Yes.", "Sure.", 3)]
    app2, backend2 = make_app(tmp_path, script=["Fine."], reasoning="think")
    async with app2.run_test(size=SIZE) as pilot:
        await ready(pilot)
        first, second = replies(app2)
        assert first.thought.text == THOUGHT and second.thought.text == "Sure."
        assert not shown(first) and not shown(second)
        assert header(first).startswith(f"▸ Thought for {THOUGHT_TOKENS} tokens / ")
        assert "Six sevens" not in screen_text(app2) and "It is 42." in screen_text(app2)
        await pilot.press("f5")
        assert shown(second) and "Sure." in screen_text(app2)
        await send(pilot, "Thanks")
        await idle(pilot)
        sent = backend2.engine.requests[0].messages
        assert [m["content"] for m in sent if m["role"] == "assistant"] == [ANSWER, "Yes."]
        assert not any(THOUGHT in m["content"] or "Sure." == m["content"] for m in sent)


@pytest.mark.asyncio
async def test_stopped_while_thinking_keeps_the_partial_thought(tmp_path) -> None:
    app, _ = make_app(tmp_path, script=[FakeReply(ANSWER, thought=THOUGHT, hold_after=4)], reasoning="think",
                      tokens_per_s=2000)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "q")
        await wait_for(pilot, lambda: replies(app) and replies(app)[0].reasoning == "The user asks for",
                       what="four tokens of thinking")
        await pilot.press("escape")
        await idle(pilot)
        (view,) = replies(app)
        assert view.status == "stopped" and view.content == ""
        assert header(view).startswith("▸ Thought for 4 tokens / ")
        assert "▸ Thought for 4 tokens / 0." in screen_text(app)  # the header is not cut to what it said before
        (_, reply) = app.store.messages(app.chat_screen.chat.id)
        assert (reply.status, reply.reasoning, reply.stats["reasoning_tokens"]) == ("stopped", "The user asks for", 4)


@pytest.mark.asyncio
async def test_f9_and_the_settings_set_the_thinking_effort_of_the_request(tmp_path) -> None:
    app, backend = make_app(tmp_path, script=[FakeReply(ANSWER, thought=THOUGHT)], reasoning="think")
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        prompt = app.chat_screen.query_one("#prompt")
        assert prompt.border_subtitle == "thinking: default (F9)"
        await send(pilot, "default")
        await idle(pilot)
        assert backend.engine.requests[-1].reasoning_effort is None  # the model's own
        await pilot.press("f9")
        assert app.chat_screen.chat.settings.reasoning_effort == "none"
        assert prompt.border_subtitle == "thinking: off (F9)"
        await send(pilot, "off")
        await idle(pilot)
        assert backend.engine.requests[-1].reasoning_effort == "none"
        assert replies(app)[-1].thought is None and replies(app)[-1].content == ANSWER  # it did not think
        await pilot.press("f9", "f9")
        assert app.chat_screen.chat.settings.reasoning_effort == "medium"
        await pilot.press("ctrl+s")
        screen = app.screen
        assert isinstance(screen, SettingsScreen)
        field = screen.query_one("#reasoning_effort")
        assert field.value == "medium" and not field.disabled
        field.value = "sometimes"
        await pilot.press("ctrl+s")
        assert "Thinking: 'sometimes' is not one of default, off, low, medium, high" in str(
            screen.query_one("#error").render())
        field.value = "high"
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: app.screen is app.chat_screen, what="settings saved")
        await send(pilot, "high")
        await idle(pilot)
        assert backend.engine.requests[-1].reasoning_effort == "high"
        chat_id = app.chat_screen.chat.id
    store = ChatStore(tmp_path / "chats.db")
    assert store.get_chat(chat_id).settings.reasoning_effort == "high"
    store.close()


@pytest.mark.asyncio
async def test_a_model_without_reasoning_shows_none_of_it(tmp_path) -> None:
    app, backend = make_app(tmp_path, script=[FakeReply(ANSWER, thought=THOUGHT)])
    app.default_settings = ChatSettings(temperature=0.0, reasoning_effort="high")  # kept from a model that reasons
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        assert app.engine.info.reasoning is None
        await send(pilot, "q")
        await idle(pilot)
        assert transcript(app)[-1] == ("assistant", "done", ANSWER) and replies(app)[0].thought is None
        assert backend.engine.requests[-1].reasoning_effort is None  # never sent to a model without reasoning
        text = screen_text(app)
        assert "Thinking" not in text and "Effort" not in text and "thinking" not in text
        assert app.chat_screen.query_one("#prompt").border_subtitle is None
        await pilot.press("f9", "f5")  # nothing to act on
        assert app.chat_screen.chat.settings.reasoning_effort == "high"
        titles = {c.title for c in app.get_system_commands(app.chat_screen)}
        assert not {"Show or hide thinking", "Thinking effort"} & titles
        await pilot.press("ctrl+s")
        screen = app.screen
        field = screen.query_one("#reasoning_effort")
        assert field.disabled and NO_REASONING in screen_text(app)
        await pilot.press("ctrl+s")  # saved as it was, for the next model that reasons
        await wait_for(pilot, lambda: app.screen is app.chat_screen, what="settings saved")
        assert app.chat_screen.chat.settings.reasoning_effort == "high"


def test_token_buffer_keeps_the_thinking_apart_with_its_tokens() -> None:
    buf = TokenBuffer()
    buf.push(GenerationEvent(reasoning="Let me", token_ids=(5, 6)))
    buf.push(GenerationEvent(token_ids=(7,)))  # the closer: no text, still the thinking's
    assert (buf.reasoning_tokens, buf.reasoning_ended_at) == (3, None)
    buf.push(GenerationEvent(text="Hi", token_ids=(8,)))
    d = buf.drain()
    assert (d.reasoning, d.text, d.num_tokens) == ("Let me", "Hi", 4)
    assert buf.reasoning_tokens == 3 and buf.reasoning_ended_at is not None
    plain = TokenBuffer()  # a model without reasoning: a held-back first token is no thinking
    plain.push(GenerationEvent(token_ids=(1,)))
    plain.push(GenerationEvent(text="é", token_ids=(2,), finish_reason="stop", usage=Usage(3, 2)))
    assert plain.reasoning_tokens == 0 and plain.drain().reasoning == ""


def test_a_thought_header_says_what_is_known() -> None:
    assert ThoughtView("x", 1, 0.04).header() == "▸ Thought for 1 token / 0.0 s"
    assert ThoughtView("x", 1200, 125.4).header() == "▸ Thought for 1,200 tokens / 2 min 5 s"
    assert ThoughtView("x").header() == "▸ Thought"  # saved by a reply that never finished
    assert ThoughtView("x", 3, streaming=True).header() == "▸ Thinking… (3 tokens)"


def test_the_stats_bar_keeps_the_thinking_share_of_a_saved_reply() -> None:
    s = LiveStats(prompt_tokens=5, reply_tokens=20, reasoning_tokens=12)
    assert "reply 20 (12 thinking)" in s.render_line()
    assert LiveStats.from_saved(s.to_saved()).reasoning_tokens == 12
    assert "thinking" not in LiveStats(reply_tokens=20).render_line()
    assert "reasoning_tokens" not in LiveStats().to_saved()


def test_roofline_chat_takes_the_thinking_effort_of_new_chats(monkeypatch, capsys) -> None:
    import app.tui as tui_pkg
    import app.tui.app as tui_app
    from app import cli

    made: list[dict] = []

    class App:
        def __init__(self, **kwargs) -> None:
            made.append(kwargs)

        def run(self) -> None:
            pass

    monkeypatch.setattr(tui_app, "RooflineApp", App)
    assert cli.main(["chat", "--reasoning-effort", "low"]) == 0
    assert made[-1]["default_settings"] == ChatSettings(reasoning_effort="low")
    assert cli.main(["chat"]) == 0 and made[-1]["default_settings"] == ChatSettings()
    seen: dict = {}
    monkeypatch.setattr(tui_pkg, "run", lambda model, **options: seen.update(options) or 0)
    assert cli.cmd_chat(cli.argparse.Namespace(model=None, device="auto", threads=None, compile=None)) == 0
    assert seen == {}  # `roofline` alone: the model's own effort
    with pytest.raises(SystemExit) as exit_:
        cli.main(["chat", "--reasoning-effort", "lots"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err == ("roofline: error: --reasoning-effort 'lots': expected one of none, minimal, "
                                       "low, medium, high\n")
