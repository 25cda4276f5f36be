"""A chat's KV on disk (ROOFLINE_HOME/kv/<chat_id>-<model key>.safetensors, one file per chat and model) with the fake engine's pretend prefix cache:
saved after each reply, restored when a chat is opened (the next reply's cached prompt tokens show the hit),
refused files deleted, the file removed with the chat or when its history changes."""

from __future__ import annotations

import json

import pytest

from app.tui.store import ChatStore
from app.tui.widgets.sidebar import ChatList
from tests.support.tui_helpers import idle, make_app, ready, screen_text, send, transcript, wait_for

pytestmark = pytest.mark.asyncio

SIZE = (100, 30)
REPLY = "Paris is the capital of France, and it sits on the Seine river in the north of the country."


def kv_file(home, chat_id: int, model: str = "FakeLM-1M (test)"):
    from types import SimpleNamespace

    from app.tui.chat_kv import model_key
    from tests.support.tui_fake_engine import fake_info

    return home / "kv" / f"{chat_id}-{model_key(SimpleNamespace(info=fake_info(model)))}.safetensors"


async def saved(pilot, path) -> None:
    await wait_for(pilot, lambda: path.exists() and pilot.app.chat_kv._pending == 0, what=f"{path.name} saved")


async def first_reply_saved(pilot, home, text: str = "What is the capital of France?"):
    """A new app's first message and reply, then its chat's KV file written; returns (chat id, file)."""
    await ready(pilot)
    await send(pilot, text)
    await idle(pilot)
    chat_id = pilot.app.chat_screen.chat.id
    await saved(pilot, kv_file(home, chat_id))
    return chat_id, kv_file(home, chat_id)


async def test_a_reply_saves_the_conversation_kv_in_whole_blocks(tmp_path) -> None:
    app, backend = make_app(tmp_path, script=[REPLY])
    async with app.run_test(size=SIZE) as pilot:
        chat_id, _ = await first_reply_saved(pilot, tmp_path)
        ((kind, path, n),) = backend.engine.kv_calls
        assert kind == "save" and n > 0 and n % 16 == 0
        assert path != str(kv_file(tmp_path, chat_id))  # written aside, then renamed into place
        pieces = json.loads(kv_file(tmp_path, chat_id).read_text())["pieces"]
        assert len(pieces) == n and " France" in pieces and "Paris" in pieces  # the reply is part of it
        assert sorted(p.name for p in (tmp_path / "kv").iterdir()) == [kv_file(tmp_path, chat_id).name]


async def test_a_chat_shorter_than_one_block_saves_nothing_silently(tmp_path) -> None:
    app, backend = make_app(tmp_path, script=["ok"], block_size=64)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "hi")
        await idle(pilot)
        await wait_for(pilot, lambda: app.chat_kv._pending == 0, what="save attempt")
        assert backend.engine.kv_calls == [] and not kv_file(tmp_path, app.chat_screen.chat.id).exists()
        assert not app._notifications


async def test_reopening_a_chat_restores_its_kv_and_the_next_reply_hits_it(tmp_path) -> None:
    app, _ = make_app(tmp_path, script=[REPLY])
    async with app.run_test(size=SIZE) as pilot:
        chat_id, _ = await first_reply_saved(pilot, tmp_path)
        n_saved = json.loads(kv_file(tmp_path, chat_id).read_text())["pieces"]
    app2, backend2 = make_app(tmp_path, script=["It is about 105 square kilometres."])
    async with app2.run_test(size=SIZE) as pilot:
        await ready(pilot)  # the app opens on its last chat and restores it once the model is loaded
        await wait_for(pilot, lambda: app2.chat_kv.restored.get(chat_id), what="restore")
        assert backend2.engine.kv_calls == [("restore", str(kv_file(tmp_path, chat_id)), len(n_saved))]
        await send(pilot, "How big is it?")
        await idle(pilot)
        stats = app2.chat_screen.stats
        assert stats.cached_tokens == len(n_saved) and stats.cached_tokens < stats.prompt_tokens
        assert f"({stats.cached_tokens:,} cached)" in screen_text(app2)
        (chat,) = app2.store.list_chats()
        assert app2.store.messages(chat.id)[-1].stats["cached_prompt_tokens"] == len(n_saved)


async def test_switching_chats_restores_each_once_per_engine(tmp_path) -> None:
    app, _ = make_app(tmp_path, script=[REPLY])
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "first chat about France and its capital city")
        await idle(pilot)
        first = app.chat_screen.chat.id
        await pilot.press("ctrl+n")
        await send(pilot, "second chat about France and its capital city")
        await idle(pilot)
        second = app.chat_screen.chat.id
        await saved(pilot, kv_file(tmp_path, first))
        await saved(pilot, kv_file(tmp_path, second))
    app2, backend2 = make_app(tmp_path)
    async with app2.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await wait_for(pilot, lambda: second in app2.chat_kv.restored, what="restore of the open chat")
        chat_list = app2.chat_screen.query_one(ChatList)
        for index, chat_id in ((1, first), (0, second), (1, first)):
            chat_list.focus()
            chat_list.index = index
            await pilot.press("enter")
            await wait_for(pilot, lambda: app2.chat_screen.chat.id == chat_id, what="switch")
        await wait_for(pilot, lambda: first in app2.chat_kv.restored, what="restore on switch")
        assert [(kind, path) for kind, path, _ in backend2.engine.kv_calls] == [
            ("restore", str(kv_file(tmp_path, second))), ("restore", str(kv_file(tmp_path, first)))]


@pytest.mark.parametrize("content", [b"\x00not json at all", json.dumps(
    {"format": "fake-kv-1", "model": "SomeOtherModel", "pieces": ["<s>"] * 16}).encode()])
async def test_a_refused_kv_file_is_deleted_and_the_chat_prefills(tmp_path, content: bytes) -> None:
    store = ChatStore(tmp_path / "chats.db")
    chat = store.create_chat("old chat")
    store.add_message(chat.id, "user", "What is the capital of France?")
    store.add_message(chat.id, "assistant", REPLY)
    store.close()
    (tmp_path / "kv").mkdir()
    kv_file(tmp_path, chat.id).write_bytes(content)
    app, backend = make_app(tmp_path, script=["Yes."])
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await wait_for(pilot, lambda: not kv_file(tmp_path, chat.id).exists(), what="refused file deleted")
        await wait_for(pilot, lambda: any("prefill" in n.message for n in app._notifications), what="notice")
        assert backend.engine.kv_calls == [] and chat.id not in app.chat_kv.restored
        await send(pilot, "Are you sure?")
        await idle(pilot)
        assert transcript(app)[-1] == ("assistant", "done", "Yes.") and app.chat_screen.stats.cached_tokens == 0
        await saved(pilot, kv_file(tmp_path, chat.id))  # and the reply saves a good one


async def test_deleting_a_chat_or_changing_its_history_removes_the_file(tmp_path) -> None:
    app, backend = make_app(tmp_path, script=[REPLY])
    async with app.run_test(size=SIZE) as pilot:
        _, path = await first_reply_saved(pilot, tmp_path)
        app.chat_kv.forget(app.chat_screen.chat.id)  # as regenerate does, before the new reply saves again
        assert not path.exists()
        await pilot.press("ctrl+r")
        await idle(pilot)
        await saved(pilot, path)
        assert [kind for kind, _, _ in backend.engine.kv_calls] == ["save", "save"]
        app.chat_screen.delete_chat()
        await pilot.press("y")
        await wait_for(pilot, lambda: app.store.list_chats() == [], what="chat deleted")
        assert not path.exists() and list((tmp_path / "kv").iterdir()) == []


async def test_edit_and_resend_deletes_the_file_before_the_new_reply(tmp_path) -> None:
    app, backend = make_app(tmp_path, script=[REPLY])
    async with app.run_test(size=SIZE) as pilot:
        _, path = await first_reply_saved(pilot, tmp_path)
        calls = len(backend.engine.kv_calls)
        await app.chat_screen.truncate_from(app.chat_screen.query("MessageView").first())
        assert not path.exists() and len(backend.engine.kv_calls) == calls


async def test_an_engine_without_a_paged_cache_saves_and_restores_nothing(tmp_path) -> None:
    app, backend = make_app(tmp_path, script=[REPLY], paged=False)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "What is the capital of France?")
        await idle(pilot)
        await wait_for(pilot, lambda: app.chat_kv._pending == 0, what="save attempt")
        assert backend.engine.kv_calls == [] and not (tmp_path / "kv").exists()
        assert not app._notifications


async def test_switching_models_keeps_each_models_file_and_switching_back_restores_it(tmp_path) -> None:
    """One file per chat and model: a switch neither deletes the chat's file of the other model nor needs it; back
    on the first model its file is restored (no re-prefill), and deleting the chat removes both."""
    app, backend = make_app(tmp_path, script=[REPLY])
    async with app.run_test(size=SIZE) as pilot:
        chat_id, first = await first_reply_saved(pilot, tmp_path)
        app.load_model("org/fake-big")
        await wait_for(pilot, lambda: app.model_ref == "org/fake-big" and app.chat_kv._pending == 0, what="switch")
        assert first.exists() and backend.engine.kv_calls == []  # nothing of the other model's was tried
        await send(pilot, "And its population?")
        await idle(pilot)
        second = kv_file(tmp_path, chat_id, "org/fake-big")
        await saved(pilot, second)
        assert first.exists() and first != second
        app.load_model("")
        await wait_for(pilot, lambda: app.model_ref == "" and app.chat_kv.restored.get(chat_id), what="back")
        assert backend.engine.kv_calls == [("restore", str(first), len(json.loads(first.read_text())["pieces"]))]
        app.chat_screen.delete_chat()
        await pilot.press("y")
        await wait_for(pilot, lambda: app.store.list_chats() == [], what="chat deleted")
        assert list((tmp_path / "kv").iterdir()) == []
