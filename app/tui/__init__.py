"""The Textual chat app: `roofline` / `roofline chat [--model M]`."""

from __future__ import annotations


def run(model: str | None = None) -> int:
    from app.tui.app import RooflineApp

    RooflineApp(model=model).run()
    return 0
