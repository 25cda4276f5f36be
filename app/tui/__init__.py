"""The Textual chat app: `roofline` / `roofline chat [--model M]`."""

from __future__ import annotations

from typing import Any


def run(model: str | None = None, **load_options: Any) -> int:
    """The chat app; `load_options` go to Engine.load for every model it loads (the KV cache's)."""
    from app.tui.app import RooflineApp
    from app.tui.backend import EngineBackend

    RooflineApp(backend=EngineBackend(**load_options), model=model).run()
    return 0
