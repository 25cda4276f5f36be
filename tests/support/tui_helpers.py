"""Helpers shared by the TUI tests: a fake-engine app in a temporary ROOFLINE_HOME, waiting, screen text."""

from __future__ import annotations

import asyncio
import io
import time
from collections.abc import Callable

from rich.console import Console
from textual.app import App
from textual.pilot import Pilot


def screen_text(app: App) -> str:
    """The screen as plain text (what a user would read), for asserting on the layout."""
    width, height = app.size
    console = Console(width=width, height=height, file=io.StringIO(), force_terminal=True, record=True,
                      legacy_windows=False, safe_box=False)
    console.print(app.screen._compositor.render_update(full=True, screen_stack=app._background_screens))
    return console.export_text()


async def wait_for(pilot: Pilot, predicate: Callable[[], bool], timeout: float = 5.0, what: str = "") -> None:
    """Pauses the pilot until `predicate()` holds (fails the test after `timeout` seconds)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or predicate}")
        await pilot.pause(0.02)
    await asyncio.sleep(0)


def make_app(home, script=None, tokens_per_s: float | None = None, **backend_kwargs):
    """A RooflineApp on a FakeBackend in `home`, greedy settings; returns (app, backend)."""
    from app.tui.app import RooflineApp
    from app.tui.store import ChatSettings
    from tests.support.tui_fake_engine import FakeBackend

    backend = FakeBackend(script=script, tokens_per_s=tokens_per_s, **backend_kwargs)
    app = RooflineApp(backend=backend, home=home, default_settings=ChatSettings(temperature=0.0, max_tokens=256))
    return app, backend


async def ready(pilot: Pilot) -> None:
    """Waits until the model is loaded and the input is enabled."""
    app = pilot.app
    await wait_for(pilot, lambda: app.engine is not None and not app.chat_screen.query_one("#prompt").disabled,
                   what="model loaded")


async def send(pilot: Pilot, text: str) -> None:
    prompt = pilot.app.chat_screen.query_one("#prompt")
    prompt.focus()
    prompt.text = text
    await pilot.press("enter")


async def idle(pilot: Pilot) -> None:
    """Waits until no reply is streaming."""
    await wait_for(pilot, lambda: pilot.app.chat_screen.gen is None, what="reply finished")
    await pilot.pause()


def transcript(app) -> list[tuple[str, str, str]]:
    from app.tui.widgets.messages import MessageView

    return [(v.role, v.status, v.content) for v in app.chat_screen.query(MessageView)]


SEGMENTED_REPLY = """Intro paragraph with **bold** text and `code`, long enough to fill a segment.

## A heading

First paragraph under the heading, long enough to pass the threshold.

- one
- two

```python
a = 1

b = 2
```

1. first

2. second, in a loose list

### After a list

Closing paragraph after the list.

> a quote

| a | b |
|---|---|
| 1 | 2 |

Final words."""
