"""The chat app driven by Textual's Pilot against a scripted fake engine, in a temporary ROOFLINE_HOME."""

from __future__ import annotations

import sqlite3

import pytest

from tests.support.tui_fake_engine import FakeReply
from app.tui.screens.dialogs import ConfirmScreen, TextPromptScreen
from app.tui.screens.help import HelpScreen
from app.tui.screens.inspector import SAMPLES, TokenInspector
from app.tui.screens.picker import ModelPicker
from app.tui.screens.settings import SettingsScreen
from app.tui.store import ChatStore
from app.tui.widgets.messages import MessageView
from app.tui.widgets.prompt import PromptInput
from app.tui.widgets.sidebar import ChatList
from tests.support.tui_helpers import idle, make_app, ready, screen_text, send, transcript, wait_for

pytestmark = pytest.mark.asyncio

SIZE = (100, 30)
LONG = " ".join(f"word{i}" for i in range(400))


async def test_send_streams_reply_into_markdown_and_saves_it(tmp_path) -> None:
    app, backend = make_app(tmp_path, script=["The capital of **France** is Paris."], tokens_per_s=400)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "What is the capital of France?")
        await idle(pilot)
        assert transcript(app) == [("user", "done", "What is the capital of France?"),
                                   ("assistant", "done", "The capital of **France** is Paris.")]
        assert "The capital of France is Paris." in screen_text(app)  # rendered as Markdown (bold, no stars)
        assert app.chat_screen.query_one(PromptInput).text == ""
        request = backend.engine.requests[0]
        assert request.messages == [{"role": "user", "content": "What is the capital of France?"}]
        assert request.sampling.temperature == 0.0
        stats = app.chat_screen.stats
        assert stats.reply_tokens == 11 and stats.prompt_tokens > 0 and stats.decode_tps > 0
        assert stats.roofline_fraction is not None and stats.roofline_fraction > 0
        (chat,) = app.store.list_chats()
        assert chat.title == "What is the capital of France?"
        assert [(m.role, m.status) for m in app.store.messages(chat.id)] == [("user", "done"), ("assistant", "done")]


async def test_empty_message_is_not_sent_and_ctrl_j_inserts_a_newline(tmp_path) -> None:
    app, backend = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "   \n  ")
        await pilot.pause()
        assert transcript(app) == [] and backend.engine.requests == []
        assert app.store.list_chats() == []
        prompt = app.chat_screen.query_one(PromptInput)
        prompt.text = ""
        await pilot.press("a", "ctrl+j", "b")
        assert prompt.text == "a\nb" and transcript(app) == []


async def test_stats_bar_updates_while_streaming(tmp_path) -> None:
    app, backend = make_app(tmp_path, script=[FakeReply(LONG, hold_after=50)], tokens_per_s=2000)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "go")
        await wait_for(pilot, lambda: app.chat_screen.stats.reply_tokens == 50, what="50 tokens shown")
        text = screen_text(app)
        assert "▶" in text and "tok/s" in text and "prompt" in text and "% of roofline" in text
        assert app.chat_screen.query_one(MessageView.__name__ + ".-assistant").status == "streaming"
        backend.engine.release()
        await idle(pilot)
        assert "▶" not in screen_text(app)


async def test_escape_stops_the_reply_keeping_the_partial_text(tmp_path) -> None:
    app, backend = make_app(tmp_path, script=[FakeReply(LONG, hold_after=20)], tokens_per_s=2000)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "tell me a long story")
        await wait_for(pilot, lambda: app.chat_screen.stats.reply_tokens == 20, what="20 tokens shown")
        await pilot.press("escape")
        await idle(pilot)
        (user, reply) = transcript(app)
        assert reply[1] == "stopped"
        assert reply[2] == " ".join(f"word{i}" for i in range(20))
        assert "Assistant · stopped" in screen_text(app)
        (chat,) = app.store.list_chats()
        saved = app.store.messages(chat.id)[1]
        assert (saved.status, saved.content) == ("stopped", reply[2])


async def test_regenerate_replaces_the_last_reply(tmp_path) -> None:
    app, backend = make_app(tmp_path, script=["First answer.", "Second answer."])
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "hi")
        await idle(pilot)
        await pilot.press("ctrl+r")
        await idle(pilot)
        assert transcript(app) == [("user", "done", "hi"), ("assistant", "done", "Second answer.")]
        assert backend.engine.requests[1].messages == [{"role": "user", "content": "hi"}]
        (chat,) = app.store.list_chats()
        assert [m.content for m in app.store.messages(chat.id)] == ["hi", "Second answer."]


async def test_edit_and_resend_replaces_later_turns(tmp_path) -> None:
    app, backend = make_app(tmp_path, script=["A1", "A2", "A3"])
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "Q1")
        await idle(pilot)
        await send(pilot, "Q2")
        await idle(pilot)
        first = app.chat_screen.query(MessageView).first()
        first.focus()
        await pilot.press("e")
        prompt = app.chat_screen.query_one(PromptInput)
        assert prompt.text == "Q1" and prompt.has_class("-editing") and prompt.has_focus
        prompt.text = "Q1 edited"
        await pilot.press("enter")
        await idle(pilot)
        assert transcript(app) == [("user", "done", "Q1 edited"), ("assistant", "done", "A3")]
        assert backend.engine.requests[-1].messages == [{"role": "user", "content": "Q1 edited"}]
        (chat,) = app.store.list_chats()
        assert [m.content for m in app.store.messages(chat.id)] == ["Q1 edited", "A3"]
        assert not prompt.has_class("-editing")


async def test_copy_a_reply_to_the_clipboard(tmp_path) -> None:
    app, _ = make_app(tmp_path, script=["Copy **me**."])
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "hi")
        await idle(pilot)
        await pilot.press("f3")
        assert app.clipboard == "Copy **me**."
        app.chat_screen.query(MessageView).first().focus()
        await pilot.press("c")
        assert app.clipboard == "hi"


async def test_multi_turn_history_reaches_the_engine_with_system_prompt(tmp_path) -> None:
    app, backend = make_app(tmp_path, script=["A1", "A2"])
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "Q1")
        await idle(pilot)
        app.chat_screen.chat.settings.system_prompt = "Be brief."
        await send(pilot, "Q2")
        await idle(pilot)
        assert backend.engine.requests[1].messages == [
            {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Q1"},
            {"role": "assistant", "content": "A1"}, {"role": "user", "content": "Q2"}]


async def test_switch_rename_and_delete_chats_from_the_sidebar(tmp_path) -> None:
    app, _ = make_app(tmp_path, script=["one", "two"])
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "first chat")
        await idle(pilot)
        first_stats = app.chat_screen.stats.render_line()
        assert " · reply 1 │ ctx " in first_stats and "TTFT –" not in first_stats
        await pilot.press("ctrl+n")
        assert " · reply 0 │ ctx 0/" in app.chat_screen.stats.render_line()  # a new chat: nothing yet
        assert transcript(app) == []
        await send(pilot, "second chat")
        await idle(pilot)
        chat_list = app.chat_screen.query_one(ChatList)
        assert [item.chat.title for item in chat_list.children] == ["second chat", "first chat"]  # newest first
        chat_list.focus()
        chat_list.index = 1
        await pilot.press("enter")
        await wait_for(pilot, lambda: transcript(app)[:1] == [("user", "done", "first chat")], what="switch")
        assert transcript(app) == [("user", "done", "first chat"), ("assistant", "done", "one")]
        assert app.chat_screen.stats.render_line() == first_stats  # its last reply's figures, not zeros
        # rename
        chat_list.focus()
        await pilot.press("r")
        assert isinstance(app.screen, TextPromptScreen)
        app.screen.query_one("Input").value = "Renamed"
        await pilot.press("enter")
        await wait_for(pilot, lambda: "Renamed" in [c.title for c in app.store.list_chats()], what="rename")
        # delete: "n" keeps it, "y" deletes it
        chat_list.focus()
        chat_list.index = [i.chat.title for i in chat_list.children].index("Renamed")
        await pilot.press("d")
        assert isinstance(app.screen, ConfirmScreen)
        await pilot.press("n")
        assert len(app.store.list_chats()) == 2
        chat_list.focus()
        await pilot.press("delete")
        assert isinstance(app.screen, ConfirmScreen)
        await pilot.press("y")
        await wait_for(pilot, lambda: len(app.store.list_chats()) == 1, what="delete")
        assert [c.title for c in app.store.list_chats()] == ["second chat"]
        assert transcript(app) == []  # the open chat was the deleted one


async def test_settings_round_trip_and_validation(tmp_path) -> None:
    app, backend = make_app(tmp_path, script=["ok"])
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "hi")
        await idle(pilot)
        await pilot.press("ctrl+s")
        assert isinstance(app.screen, SettingsScreen)
        screen = app.screen
        screen.query_one("#top_p").value = "1.5"
        await pilot.press("ctrl+s")
        assert isinstance(app.screen, SettingsScreen)  # refused, with the engine's message
        assert "top_p" in str(screen.query_one("#error").render())
        screen.query_one("#top_p").value = "0.9"
        screen.query_one("#temperature").value = "0.3"
        screen.query_one("#seed").value = "7"
        screen.query_one("#max_tokens").value = "64"
        screen.query_one("#system_prompt").text = "You are terse."
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: app.screen is app.chat_screen, what="settings closed")
        chat_id = app.chat_screen.chat.id
        await send(pilot, "again")
        await idle(pilot)
        sampling = backend.engine.requests[-1].sampling
        assert (sampling.temperature, sampling.top_p, sampling.seed, sampling.max_tokens) == (0.3, 0.9, 7, 64)
        assert backend.engine.requests[-1].messages[0] == {"role": "system", "content": "You are terse."}
    store = ChatStore(tmp_path / "chats.db")
    s = store.get_chat(chat_id).settings
    assert (s.temperature, s.top_p, s.seed, s.max_tokens, s.system_prompt) == (0.3, 0.9, 7, 64, "You are terse.")
    store.close()


async def test_a_model_that_fails_to_load_keeps_the_previous_one(tmp_path) -> None:
    app, backend = make_app(tmp_path, fail={"org/broken": "org/broken: unsupported architecture 'mamba'"})
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        first = app.engine
        app.load_model("org/broken")
        await wait_for(pilot, lambda: app.loading_ref is None, what="load attempt")
        assert app.engine is first and not first.closed
        assert any("unsupported architecture" in n.message and "Keeping" in n.message for n in app._notifications)
        assert not app.chat_screen.query_one(PromptInput).disabled


async def test_a_models_warnings_are_shown_when_it_loads(tmp_path, monkeypatch) -> None:
    """ModelInfo.warnings (say, weights near what Metal keeps resident) reach the user as a warning notice."""
    import dataclasses

    from tests.support import tui_fake_engine as fake_engine

    info = fake_engine.fake_info
    warning = "the weights take 5.7 GiB of the 6.0 GiB Metal keeps resident: generation may be slow"
    monkeypatch.setattr(fake_engine, "fake_info",
                        lambda *a, **k: dataclasses.replace(info(*a, **k), warnings=(warning,)))
    app, backend = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await wait_for(pilot, lambda: any(n.message == warning and n.severity == "warning"
                                          for n in app._notifications), what="warning notice")


async def test_a_missing_model_path_at_startup_is_a_notice_not_a_crash(tmp_path) -> None:
    app, backend = make_app(tmp_path)
    app.requested_model = str(tmp_path / "nope.gguf")
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: any("no such file" in n.message for n in app._notifications), what="notice")
        assert app.engine is None
        prompt = app.chat_screen.query_one(PromptInput)
        assert prompt.disabled and "ctrl+l" in str(prompt.placeholder)
        await pilot.press("ctrl+l")  # the picker still works and loads a good model
        await wait_for(pilot, lambda: isinstance(app.screen, ModelPicker) and app.screen.rows, what="picker")
        await pilot.press("enter")
        await ready(pilot)
        assert app.model_ref == ""


def a_gguf(tmp_path):
    gguf = tmp_path / "mine.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 100)
    return gguf


async def open_picker(pilot) -> ModelPicker:
    """ctrl+l, then waits for the picker's rows."""
    app = pilot.app
    await pilot.press("ctrl+l")
    await wait_for(pilot, lambda: isinstance(app.screen, ModelPicker) and app.screen.rows, what="picker rows")
    return app.screen


async def test_model_picker_lists_models_adds_a_path_and_switches(tmp_path) -> None:
    gguf = a_gguf(tmp_path)
    app, backend = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        picker = await open_picker(pilot)
        text = screen_text(app)
        assert "FakeLM-1M (test)" in text and "org/fake-big" in text and "600M" in text and "32,768" in text
        picker.query_one("#add-path").value = str(tmp_path / "missing.gguf")
        picker.query_one("#add-path").focus()
        await pilot.press("enter")
        await wait_for(pilot, lambda: "no such file" in str(picker.query_one("#picker-error").render()), what="error")
        picker.query_one("#add-path").value = str(gguf)
        await pilot.press("enter")
        await wait_for(pilot, lambda: len(picker.rows) == 3, what="path added")
        assert app.extra_model_paths() == [str(gguf)]
        picker.query_one("DataTable").focus()
        picker.query_one("DataTable").move_cursor(row=1)
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.model_ref == "org/fake-big", what="switched")
        assert app.sub_title == "org/fake-big · MLX on CPU" and backend.engines[0].closed


async def test_ctrl_l_then_typing_a_path_adds_it_and_enter_never_reloads_the_current_model(tmp_path) -> None:
    """As a person does it: ctrl+l, type a path, Enter (it is added and highlighted), Enter (it loads). The arrows
    move the list from the path box; a character typed with the list focused lands in the box too; Enter on the
    model already loaded closes the picker without loading it again."""
    gguf = a_gguf(tmp_path)
    app, backend = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        picker = await open_picker(pilot)
        assert picker.query_one("#add-path").has_focus
        await pilot.press("enter")  # the highlighted row is the loaded model
        await wait_for(pilot, lambda: app.screen is app.chat_screen, what="picker closed")
        assert len(backend.engines) == 1 and any("already loaded" in n.message for n in app._notifications)
        picker = await open_picker(pilot)
        picker.query_one("DataTable").focus()  # even from the list, what one types goes to the path box
        await pilot.press(*str(gguf))
        assert picker.query_one("#add-path").value == str(gguf)
        await pilot.press("enter")
        await wait_for(pilot, lambda: len(picker.rows) == 3, what="path added")
        assert len(backend.engines) == 1 and picker.query_one("DataTable").cursor_row == 2
        await pilot.press("up", "down")
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.model_ref == str(gguf), what="the added model loaded")
        assert len(backend.engines) == 2


async def test_a_model_without_a_tokenizer_is_said_at_load_and_nothing_is_saved_into_the_chat(tmp_path) -> None:
    app, backend = make_app(tmp_path, no_tokenizer=("org/fake-big",))
    app.requested_model = "org/fake-big"
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.engine is not None, what="model loaded")
        await wait_for(pilot, lambda: any("without a tokenizer" in n.message and "cannot chat" in n.message
                                          for n in app._notifications), what="the notice at load")
        assert all("prompt_token_ids" not in n.message for n in app._notifications)
        prompt = app.chat_screen.query_one(PromptInput)
        assert prompt.disabled and "no tokenizer" in str(prompt.placeholder)
        prompt.disabled = False  # even if a message gets through, it is refused before the chat is touched
        await send(pilot, "hi")
        await pilot.pause(0.2)
        assert app.store.list_chats() == [] and transcript(app) == [] and backend.engine.requests == []
        assert prompt.text == "hi"  # the text stays in the box


async def test_after_a_switch_the_stats_bar_shows_no_figures_of_the_other_model(tmp_path) -> None:
    """Speed, TTFT and cache hits belong to the model that made the reply: after a switch (and when a chat whose
    last reply another model made is opened) the bar is blank beside the new model's size, not the old figures."""
    app, backend = make_app(tmp_path, script=["Paris is the capital of France, on the Seine."], tokens_per_s=400)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "What is the capital of France?")
        await idle(pilot)
        assert app.chat_screen.stats.decode_tps > 0 and app.chat_screen.stats.ttft_s is not None
        app.load_model("org/fake-big")
        await wait_for(pilot, lambda: app.model_ref == "org/fake-big", what="switch")
        await pilot.pause()
        s = app.chat_screen.stats
        assert (s.decode_tps, s.ttft_s, s.reply_tokens, s.cached_tokens) == (0.0, None, 0, 0)
        assert "TTFT –" in screen_text(app) and "0.0 tok/s" in screen_text(app)
        chat = app.chat_screen.chat
        await app.chat_screen.open_chat(None)
        await app.chat_screen.open_chat(chat)  # reopened: its last reply is the other model's
        assert app.chat_screen.stats.decode_tps == 0.0 and "TTFT –" in screen_text(app)
        assert app.store.messages(chat.id)[-1].stats["model"] == "FakeLM-1M (test)"


async def test_engine_error_mid_reply_is_shown_and_the_chat_stays_usable(tmp_path) -> None:
    app, backend = make_app(tmp_path, script=[FakeReply("one two three four five", error_after=3, error="Metal: out of memory"),
                                              "Recovered."])
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "hi")
        await idle(pilot)
        (user, reply) = transcript(app)
        assert reply == ("assistant", "error", "one two three")
        assert "Metal: out of memory" in screen_text(app)
        await send(pilot, "again")
        await idle(pilot)
        assert transcript(app)[-1] == ("assistant", "done", "Recovered.")
        # the failed reply is not fed back to the model
        assert backend.engine.requests[-1].messages == [{"role": "user", "content": "hi"},
                                                       {"role": "user", "content": "again"}]


async def test_a_prompt_longer_than_the_context_is_refused_in_the_message(tmp_path) -> None:
    app, backend = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, " ".join(["many"] * 3000))
        await idle(pilot)
        (user, reply) = transcript(app)
        assert reply[1] == "error" and "longer than the context (2048)" in screen_text(app).replace("\n", " ")


async def test_chats_persist_across_two_runs_and_a_killed_reply_is_kept(tmp_path) -> None:
    app, _ = make_app(tmp_path, script=["Saved reply."])
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "remember me")
        await idle(pilot)
    # a reply that was streaming when the process died: its row is left with status "streaming"
    store = ChatStore(tmp_path / "chats.db")
    chat = store.create_chat("killed mid-reply")
    store.add_message(chat.id, "user", "q")
    store.add_message(chat.id, "assistant", "partial te", status="streaming")
    store.close()
    app2, _ = make_app(tmp_path)
    async with app2.run_test(size=SIZE) as pilot:
        await ready(pilot)
        titles = [item.chat.title for item in app2.chat_screen.query_one(ChatList).children]
        assert titles == ["killed mid-reply", "remember me"]
        assert transcript(app2) == [("user", "done", "q"), ("assistant", "interrupted", "partial te")]
        chat_list = app2.chat_screen.query_one(ChatList)
        chat_list.focus()
        chat_list.index = 1
        await pilot.press("enter")
        await wait_for(pilot, lambda: transcript(app2)[:1] == [("user", "done", "remember me")], what="reopen")
        assert transcript(app2) == [("user", "done", "remember me"), ("assistant", "done", "Saved reply.")]


async def test_a_corrupt_database_is_moved_aside_and_the_app_starts_fresh(tmp_path) -> None:
    (tmp_path / "chats.db").write_bytes(b"this is not a database" * 100)
    app, _ = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await wait_for(pilot, lambda: any("moved it to" in n.message for n in app._notifications), what="notice")
        await send(pilot, "works")
        await idle(pilot)
    aside = sorted(p.name for p in tmp_path.iterdir() if ".corrupt-" in p.name)
    assert len(aside) == 1 and (tmp_path / aside[0]).read_bytes().startswith(b"this is not a database")
    conn = sqlite3.connect(tmp_path / "chats.db")
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert conn.execute("SELECT count(*) FROM messages").fetchone()[0] == 2


async def test_token_inspector_shows_pieces_ids_and_counts_per_tokenizer(tmp_path) -> None:
    app, _ = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        app.chat_screen.query_one(PromptInput).text = "Hello, world"
        await pilot.press("ctrl+t")
        assert isinstance(app.screen, TokenInspector)
        await wait_for(pilot, lambda: app.screen.others, what="local tokenizers")
        assert "3 tokens · 12 characters" in screen_text(app)
        await pilot.press("f8", "f8")  # the Chinese sample
        assert app.screen.text == SAMPLES[1]
        table = app.screen.query_one("#compare")
        counts = {table.get_row_at(i)[0]: int(table.get_row_at(i)[1]) for i in range(table.row_count)}
        assert counts["FakeLM-1M (test) (loaded)"] == 3 * counts["org/fake-big"]  # costs 3x under one tokenizer
        await pilot.press("escape")
        assert app.screen is app.chat_screen


async def test_ctrl_o_goes_to_the_chat_list_and_the_settings_open_on_their_first_field(tmp_path) -> None:
    from app.tui.screens.settings import SettingsScreen

    app, _ = make_app(tmp_path, script=["One.", "Two."])
    async with app.run_test(size=(80, 24)) as pilot:  # narrow: the sidebar starts hidden
        await ready(pilot)
        await send(pilot, "first")
        await idle(pilot)
        await pilot.press("ctrl+n")
        await send(pilot, "second")
        await idle(pilot)
        assert not app.chat_screen.query_one("#sidebar").display
        await pilot.press("ctrl+o")
        chat_list = app.chat_screen.query_one(ChatList)
        assert chat_list.has_focus and app.chat_screen.query_one("#sidebar").display
        await pilot.press("down", "enter")  # the older chat
        await wait_for(pilot, lambda: transcript(app)[:1] == [("user", "done", "first")], what="chat opened")
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: isinstance(app.screen, SettingsScreen), what="settings")
        await pilot.pause()
        assert app.focused is app.screen.query_one("#system_prompt")
        await pilot.press(*"Be brief.")
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: app.screen is app.chat_screen, what="saved")
        assert app.chat_screen.chat.settings.system_prompt == "Be brief."


async def test_the_help_screen_explains_the_stats_bar_and_the_tint_of_drafted_text(tmp_path) -> None:
    app, _ = make_app(tmp_path)
    async with app.run_test(size=(100, 80)) as pilot:
        await ready(pilot)
        await pilot.press("f1")
        await wait_for(pilot, lambda: isinstance(app.screen, HelpScreen), what="help")
        app.screen.query_one("VerticalScroll").scroll_end(animate=False)  # the last section
        await pilot.pause(0.1)
        text = screen_text(app)
        assert "Stats bar" in text and "drafted (tinted)" in text and "N% accepted: speculative" in text
        assert "N per verify" in text and "N forwards" in text and "% of roofline" in text
        legend = dict(dict(app.key_sections())["Stats bar"])
        assert "accepted drafted text is tinted in the reply" in legend["drafted (tinted)"]
        assert "forward passes of the model" in legend["N forwards"]
        tooltip = str(app.chat_screen.query_one("#stats").tooltip)
        assert "N per verify: draft tokens accepted per verification forward" in tooltip


async def test_help_lists_every_binding_and_the_palette_has_every_action(tmp_path) -> None:
    app, _ = make_app(tmp_path)
    async with app.run_test(size=(100, 60)) as pilot:
        await ready(pilot)
        await pilot.press("f1")
        assert isinstance(app.screen, HelpScreen)
        text = screen_text(app)
        for key in ("f1", "ctrl+n", "ctrl+l", "ctrl+s", "ctrl+t", "ctrl+b", "ctrl+o", "f4", "escape", "ctrl+r", "f3",
                    "f2", "enter", "ctrl+j", "ctrl+p", "ctrl+q", "f5", "f8", "f9"):
            assert key in text, key
        await pilot.press("escape")
        titles = {c.title for c in app.get_system_commands(app.chat_screen)}
        assert {"New chat", "Pick model", "Chat settings", "Token inspector", "Regenerate reply", "Stop reply",
                "Copy last reply", "Rename chat", "Delete chat", "Toggle sidebar", "Go to the chat list",
                "MCP servers", "Reload MCP config", "Toggle dark/light", "Help"} <= titles


async def test_theme_toggle_persists_and_80x24_is_usable(tmp_path) -> None:
    app, _ = make_app(tmp_path, script=["short"])
    async with app.run_test(size=(80, 24)) as pilot:
        await ready(pilot)
        assert not app.chat_screen.query_one("#sidebar").display  # narrow: the chat list starts hidden
        await send(pilot, "hello")
        await idle(pilot)
        text = screen_text(app)
        assert "short" in text and "tok/s" in text and "% of roofline" in text
        await pilot.press("ctrl+b")
        assert app.chat_screen.query_one("#sidebar").display
        await pilot.resize_terminal(120, 40)
        await pilot.pause()
        assert app.chat_screen.query_one("#sidebar").display
        assert app.theme == "textual-dark"
        await pilot.press("f4")
        assert app.theme == "textual-light"
    app2, _ = make_app(tmp_path)
    assert app2.theme == "textual-light"
    app2.store.close()


async def test_a_long_reply_streams_into_segments_that_render_like_one_document(tmp_path, monkeypatch) -> None:
    from app.tui.widgets.messages import MarkdownSegment
    from tests.support.tui_helpers import SEGMENTED_REPLY

    monkeypatch.setattr(MessageView, "segment_chars", 1)  # a segment per block wherever a cut is allowed
    app, _ = make_app(tmp_path, script=[SEGMENTED_REPLY], tokens_per_s=2000)
    async with app.run_test(size=(100, 70)) as pilot:
        await ready(pilot)
        await send(pilot, "Show me some Markdown")
        await idle(pilot)
        reply = app.chat_screen.query(MessageView).last()
        assert len(reply.query_children(MarkdownSegment)) > 3  # streamed into several Markdown widgets

        def shown() -> tuple[int, list[str]]:
            view = app.chat_screen.query(MessageView).last()
            region = view.region
            lines = screen_text(app).splitlines()[region.y:region.bottom]
            return region.height, [line[region.x:region.right].rstrip() for line in lines]

        await pilot.pause(0.1)
        streamed = shown()
        assert reply.content == SEGMENTED_REPLY
        (chat,) = app.store.list_chats()
        assert app.store.messages(chat.id)[-1].content == SEGMENTED_REPLY  # stored whole
        await pilot.press("f3")
        assert app.clipboard == SEGMENTED_REPLY  # copied whole

        await app.chat_screen.open_chat(app.store.get_chat(chat.id))  # re-rendered from the store, one widget
        await pilot.pause(0.1)
        assert len(app.chat_screen.query(MessageView).last().query_children(MarkdownSegment)) == 1
        assert shown() == streamed
        assert "Final words." in "\n".join(streamed[1]) and "```" not in "\n".join(streamed[1])


async def test_parts_of_a_long_reply_far_off_screen_give_way_to_placeholders(tmp_path, monkeypatch) -> None:
    from app.tui.widgets.messages import SegmentPlaceholder

    monkeypatch.setattr(MessageView, "segment_chars", 100)
    reply = "\n\n".join(f"Paragraph {i} says something." if i % 2 else f"- item {i}\n- more {i}" for i in range(120))
    app, _ = make_app(tmp_path, script=[reply], tokens_per_s=1500)
    app.default_settings.max_tokens = 2000
    async with app.run_test(size=(100, 24)) as pilot:
        await ready(pilot)
        await send(pilot, "Long, please")
        await idle(pilot)
        await pilot.pause(0.2)
        view = app.chat_screen.query(MessageView).last()
        await view.hide_far_segments()  # what a streaming reply does every HIDE_EVERY_S (timing-dependent here)
        await pilot.pause(0.2)
        assert view.has_hidden_segments and view.query_children(SegmentPlaceholder)
        transcript = app.chat_screen.query_one("#transcript")

        def visible() -> list[str]:
            r = transcript.region
            return [line[r.x:r.right].rstrip() for line in screen_text(app).splitlines()[r.y:r.bottom]]

        async def scroll(home: bool) -> list[str]:
            transcript.scroll_home(animate=False) if home else transcript.scroll_end(animate=False)
            await pilot.pause(0.2)
            return visible()

        bottom = visible()
        top = await scroll(home=True)  # scrolling brings the hidden parts back
        assert "Long, please" in "\n".join(top) and "item 0" in "\n".join(top)
        assert await scroll(home=False) == bottom
        assert view.content == reply

        (chat,) = app.store.list_chats()
        await app.chat_screen.open_chat(app.store.get_chat(chat.id))  # one widget, nothing hidden
        await pilot.pause(0.2)
        assert await scroll(home=False) == bottom
        assert await scroll(home=True) == top
