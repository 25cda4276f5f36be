"""A reasoning model's controls on the chat screen: expanding or collapsing a reply's thinking, and the chat's
thinking effort (`ChatSettings.reasoning_effort`, sent as `GenerationRequest.reasoning_effort`). Mixed into the
chat screen, as ReplyRunner is."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from mlx_engine.api import REASONING_EFFORTS

from app.tui.store import ChatSettings
from app.tui.widgets.messages import MessageView
from app.tui.widgets.prompt import PromptInput

if TYPE_CHECKING:
    from app.tui.app import RooflineApp

# what the effort key steps through: the model's own default (None), then off to high
EFFORT_CYCLE: tuple[str | None, ...] = (None, "none", "low", "medium", "high")
EFFORT_CHOICES = ("default", "off", "low", "medium", "high")  # as the settings screen takes them
_LABELS = {None: "default", "none": "off"}


def effort_label(effort: str | None) -> str:
    """A reasoning_effort as the app shows it: None is "default" (the model's own), "none" is "off"."""
    return _LABELS.get(effort, effort or "default")


def parse_effort(text: str) -> str | None:
    """The settings screen's thinking field: "default" (or empty) is None, "off" is "none"; else an API value."""
    word = text.strip().lower()
    if word in ("", "default"):
        return None
    if word == "off":
        return "none"
    if word in REASONING_EFFORTS:
        return word
    raise ValueError(f"Thinking: {text.strip()!r} is not one of {', '.join(EFFORT_CHOICES)}")


class ThinkingControls:
    """F5 expands or collapses the thinking of the focused reply (else the last reply that has one); F9 steps the
    chat's thinking effort. Both apply only where there is something to act on (`check_thinking_action`)."""

    @property
    def rapp(self) -> RooflineApp:
        return self.app  # type: ignore[attr-defined]

    def model_reasons(self) -> bool:
        engine = self.rapp.engine
        return engine is not None and engine.info.reasoning is not None

    def replies_with_thoughts(self) -> list[MessageView]:
        transcripts = self.query("#transcript")  # type: ignore[attr-defined]  # none before the screen is composed
        return [v for t in transcripts for v in t.children if isinstance(v, MessageView) and v.thought is not None]

    def check_thinking_action(self, action: str) -> bool | None:
        """check_action's answer for the two actions here (False hides the key, so models without reasoning see
        the footer they always had); None for any other action."""
        if action == "toggle_thought":
            return bool(self.replies_with_thoughts())
        if action == "cycle_effort":
            return self.model_reasons()
        return None

    async def action_toggle_thought(self) -> None:
        focused = self.rapp.focused
        if isinstance(focused, MessageView) and focused.thought is not None:
            view = focused
        else:
            views = self.replies_with_thoughts()
            if not views:
                return
            view = views[-1]
        assert view.thought is not None
        await view.thought.toggle()
        if view.thought.expanded and view is not focused:
            view.scroll_visible(animate=False)

    def action_cycle_effort(self) -> None:
        engine = self.rapp.engine
        if engine is None or engine.info.reasoning is None:
            return
        settings: ChatSettings = self.current_settings()  # type: ignore[attr-defined]
        now = settings.reasoning_effort
        i = EFFORT_CYCLE.index(now) if now in EFFORT_CYCLE else 0
        effort = EFFORT_CYCLE[(i + 1) % len(EFFORT_CYCLE)]
        self.apply_settings(dataclasses.replace(settings, reasoning_effort=effort))  # type: ignore[attr-defined]
        whose = "this chat" if self.chat is not None else "new chats"  # type: ignore[attr-defined]
        notify = self.notify  # type: ignore[attr-defined]
        notify(f"Thinking: {effort_label(effort)} ({whose}, {engine.info.name})", timeout=3)

    def show_effort(self) -> None:
        """The chat's thinking effort on the input's border, where the model reasons (nothing otherwise)."""
        prompt = self.query_one(PromptInput)  # type: ignore[attr-defined]
        if self.model_reasons():
            effort = self.current_settings().reasoning_effort  # type: ignore[attr-defined]
            prompt.border_subtitle = f"thinking: {effort_label(effort)} (F9)"
        else:
            prompt.border_subtitle = None
