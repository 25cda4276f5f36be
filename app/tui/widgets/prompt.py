"""The multi-line message input: Enter sends, ctrl+j / alt+enter / shift+enter insert a newline."""

from __future__ import annotations

from textual import events
from textual.message import Message
from textual.widgets import TextArea

NEWLINE_KEYS = ("ctrl+j", "alt+enter", "shift+enter")


class PromptInput(TextArea):
    """A TextArea whose Enter submits; the keys in NEWLINE_KEYS insert a newline."""

    DEFAULT_CSS = """
    PromptInput { height: auto; min-height: 3; max-height: 10; border: tall $border-blurred; }
    PromptInput:focus { border: tall $border; }
    PromptInput.-editing { border: tall $warning; }
    """

    class Submitted(Message):
        def __init__(self, prompt: PromptInput, text: str) -> None:
            super().__init__()
            self.prompt = prompt
            self.text = text

    def __init__(self, **kwargs) -> None:
        super().__init__(soft_wrap=True, show_line_numbers=False, tab_behavior="focus", compact=False, **kwargs)

    async def _on_key(self, event: events.Key) -> None:
        if self.read_only:
            return
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            self.post_message(self.Submitted(self, self.text))
        elif event.key in NEWLINE_KEYS:
            event.stop()
            event.prevent_default()
            start, end = self.selection
            self._replace_via_keyboard("\n", start, end)
