"""A reasoning model's controls on the chat screen: expanding or collapsing a reply's thinking. Mixed into the
chat screen, as ReplyRunner is."""

from __future__ import annotations

from typing import TYPE_CHECKING

from app.tui.widgets.messages import MessageView

if TYPE_CHECKING:
    from app.tui.app import RooflineApp

class ThinkingControls:
    """F5 expands or collapses the thinking of the focused reply (else the last reply that has one), where there
    is one (`check_thinking_action`)."""

    @property
    def rapp(self) -> RooflineApp:
        return self.app  # type: ignore[attr-defined]

    def replies_with_thoughts(self) -> list[MessageView]:
        transcripts = self.query("#transcript")  # type: ignore[attr-defined]  # none before the screen is composed
        return [v for t in transcripts for v in t.children if isinstance(v, MessageView) and v.thought is not None]

    def check_thinking_action(self, action: str) -> bool | None:
        """check_action's answer for the action here (False hides the key, so chats without thinking show the
        footer they always had); None for any other action."""
        if action == "toggle_thought":
            return bool(self.replies_with_thoughts())
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
