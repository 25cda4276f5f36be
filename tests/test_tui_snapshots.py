"""SVG snapshots of the app's screens (pytest-textual-snapshot) at a fixed size, cursor blink off, with the fake
engine and fixed figures in the stats bar. Update with `uv run pytest tests/test_tui_snapshots.py --snapshot-update`."""

from __future__ import annotations

import pytest
from textual.widgets import Input, TextArea

from app.tui.widgets.stats import LiveStats
from tests.support.tui_fake_engine import FakeReply
from tests.support.tui_frozen import FIXED_STATS, settle
from tests.support.tui_helpers import make_app, ready, send, wait_for

SIZE = (100, 30)
REPLY = """Here is a **bandwidth** check in Python:

```python
import numpy as np

def bandwidth(n=1 << 28):
    src = np.ones(n // 8)
    return 2 * src.nbytes
```

- Decode reads every weight once per token.
- So tokens/s is capped by GB/s over model bytes, and that is the roofline we compare against
"""


def chat_app(tmp_path, **kw):
    app, backend = make_app(tmp_path, script=[FakeReply(REPLY, hold_after=60)], tokens_per_s=None, **kw)
    return app, backend


def test_chat_mid_reply(snap_compare, tmp_path) -> None:
    app, backend = chat_app(tmp_path)

    async def run_before(pilot) -> None:
        await ready(pilot)
        await send(pilot, "How do I measure memory bandwidth?")
        await wait_for(pilot, lambda: app.chat_screen.gen is not None and app.chat_screen.gen.buffer.total_tokens == 60)
        await pilot.pause(0.2)
        await settle(pilot, streaming=True)

    try:
        assert snap_compare(app, terminal_size=SIZE, run_before=run_before)
    finally:
        if backend.engines:
            backend.engine.release()


def test_chat_at_80x24_after_reply(snap_compare, tmp_path) -> None:
    app, backend = make_app(tmp_path, script=["The capital of France is **Paris**."])

    async def run_before(pilot) -> None:
        await ready(pilot)
        await send(pilot, "What is the capital of France?")
        await wait_for(pilot, lambda: app.chat_screen.gen is None and len(app.chat_screen.query("MessageView")) == 2)
        await settle(pilot)

    assert snap_compare(app, terminal_size=(80, 24), run_before=run_before)


def test_model_picker(snap_compare, tmp_path) -> None:
    app, _ = make_app(tmp_path)

    async def run_before(pilot) -> None:
        await ready(pilot)
        await pilot.press("ctrl+l")
        await wait_for(pilot, lambda: getattr(app.screen, "rows", None))
        await settle(pilot)

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


def test_settings(snap_compare, tmp_path) -> None:
    app, _ = make_app(tmp_path)

    async def run_before(pilot) -> None:
        await ready(pilot)
        await pilot.press("ctrl+s")
        await settle(pilot)

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


def test_token_inspector(snap_compare, tmp_path) -> None:
    app, _ = make_app(tmp_path)

    async def run_before(pilot) -> None:
        await ready(pilot)
        app.chat_screen.query_one("#prompt").text = "Bandwidth bounds decode: 敏捷的狐狸"
        await pilot.press("ctrl+t")
        await wait_for(pilot, lambda: getattr(app.screen, "others", None))
        await settle(pilot)

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


def test_help(snap_compare, tmp_path) -> None:
    app, _ = make_app(tmp_path)

    async def run_before(pilot) -> None:
        await ready(pilot)
        await pilot.press("f1")
        await settle(pilot)

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


@pytest.mark.parametrize("theme", ["textual-light"])
def test_light_theme(snap_compare, tmp_path, theme) -> None:
    app, _ = make_app(tmp_path, script=["Light **theme** reply."])

    async def run_before(pilot) -> None:
        await ready(pilot)
        app.theme = theme
        await send(pilot, "hello")
        await wait_for(pilot, lambda: app.chat_screen.gen is None and len(app.chat_screen.query("MessageView")) == 2)
        await settle(pilot)

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


THOUGHT = ("The user asks why decode is slow. Each token reads every weight once, so tokens/s is at most the memory "
           "bandwidth over the model's bytes.\n\nA 94 MiB model at 100 GB/s: about 1,000 tok/s at best.")


@pytest.mark.parametrize("expanded", [False, True], ids=["collapsed", "expanded"])
def test_reply_with_a_thought(snap_compare, tmp_path, expanded) -> None:
    app, _ = make_app(tmp_path, script=[FakeReply("Decode is **memory bound**: it reads every weight per token.",
                                                  thought=THOUGHT)], reasoning="think")

    async def run_before(pilot) -> None:
        await ready(pilot)
        await send(pilot, "Why is decode slow?")
        await wait_for(pilot, lambda: app.chat_screen.gen is None and len(app.chat_screen.query("MessageView")) == 2)
        if expanded:
            await pilot.press("f5")
        thought = app.chat_screen.query("MessageView").last().thought
        thought.seconds = 2.4  # the fake's thinking time varies between runs
        thought.query_one(".thought-header").update(thought.header())
        await settle(pilot)

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)
