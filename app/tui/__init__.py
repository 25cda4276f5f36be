"""The Textual chat app: `roofline` / `roofline chat [--model M]`."""

from __future__ import annotations

from typing import Any


def run(model: str | None = None, reasoning_effort: str | None = None, **load_options: Any) -> int:
    """The chat app; `reasoning_effort` is new chats' thinking effort (None: the model's own); `load_options` go to
    Engine.load for every model it loads (the KV cache's)."""
    from app.tui.app import RooflineApp
    from app.tui.backend import EngineBackend
    from app.tui.store import ChatSettings

    settings = ChatSettings(reasoning_effort=reasoning_effort)
    RooflineApp(backend=EngineBackend(**load_options), model=model, default_settings=settings).run()
    return 0
