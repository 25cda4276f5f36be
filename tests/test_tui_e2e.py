"""The app on the real embedded model (SmolLM2-135M on MLX): one short greedy question, end to end."""

from __future__ import annotations

import pytest

from app.tui.app import RooflineApp
from app.tui.store import ChatSettings
from tests.support.tui_helpers import idle, ready, screen_text, send, transcript, wait_for

pytestmark = pytest.mark.asyncio


async def test_embedded_model_answers_paris(tmp_path) -> None:
    app = RooflineApp(home=tmp_path, default_settings=ChatSettings(temperature=0.0, max_tokens=8))
    app.backend.bandwidth = lambda home: None  # the roofline denominator is not under test here
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_for(pilot, lambda: app.engine is not None, timeout=120, what="embedded model loaded")
        await ready(pilot)
        assert "SmolLM2" in app.sub_title
        await send(pilot, "What is the capital of France?")
        await wait_for(pilot, lambda: app.chat_screen.gen is None, timeout=120, what="reply")
        await idle(pilot)
        (user, reply) = transcript(app)
        assert reply[1] in ("done", "length") and "Paris" in reply[2], reply
        assert "Paris" in screen_text(app)
        stats = app.chat_screen.stats
        assert stats.reply_tokens <= 8 and stats.prompt_tokens > 0 and stats.decode_tps > 0
        assert stats.weight_bytes > 0 and stats.bytes_per_token > stats.weight_bytes // 2


async def test_embedded_model_reopened_chat_restores_its_kv(tmp_path) -> None:
    """A 2-turn chat, quit, reopen: the chat's KV comes back from disk and the next reply's prompt hits it."""

    def app_at(home):
        app = RooflineApp(home=home, default_settings=ChatSettings(temperature=0.0, max_tokens=6))
        app.backend.bandwidth = lambda home: None
        return app

    app = app_at(tmp_path)
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_for(pilot, lambda: app.engine is not None, timeout=120, what="embedded model loaded")
        await ready(pilot)
        for text in ("What is the capital of France?", "And of Italy?"):
            await send(pilot, text)
            await wait_for(pilot, lambda: app.chat_screen.gen is None, timeout=60, what="reply")
        chat_id = app.chat_screen.chat.id
        path = app.chat_kv.path(chat_id, app.engine)  # one file per chat and model
        await wait_for(pilot, lambda: path.exists() and app.chat_kv._pending == 0, timeout=30, what="KV saved")
    app2 = app_at(tmp_path)
    async with app2.run_test(size=(100, 30)) as pilot:
        await wait_for(pilot, lambda: app2.chat_kv.restored.get(chat_id), timeout=120, what="KV restored")
        await send(pilot, "And of Spain?")
        await wait_for(pilot, lambda: app2.chat_screen.gen is None, timeout=60, what="reply")
        await idle(pilot)
        stats = app2.chat_screen.stats
        assert 0 < stats.cached_tokens < stats.prompt_tokens and stats.cached_tokens >= app2.chat_kv.restored[chat_id] - 16
