"""The sidebar: saved chats, newest first."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.message import Message
from textual.widgets import Label, ListItem, ListView, Static

from app.tui.store import Chat


class ChatItem(ListItem):
    def __init__(self, chat: Chat) -> None:
        super().__init__()
        self.chat = chat

    def compose(self) -> ComposeResult:
        yield Label(self.chat.title, markup=False)


class ChatList(ListView):
    """Enter opens the highlighted chat; n new, r rename, d/delete delete (after confirming)."""

    BINDINGS = [
        Binding("n", "request('new')", "New", tooltip="Start a new chat"),
        Binding("r,f2", "request('rename')", "Rename", tooltip="Rename the highlighted chat"),
        Binding("d,delete", "request('delete')", "Delete", tooltip="Delete the highlighted chat (asks first)"),
    ]

    class Requested(Message):
        def __init__(self, action: str, chat: Chat | None) -> None:
            super().__init__()
            self.action = action
            self.chat = chat

    @property
    def highlighted_chat(self) -> Chat | None:
        item = self.highlighted_child
        return item.chat if isinstance(item, ChatItem) else None

    def action_request(self, action: str) -> None:
        self.post_message(self.Requested(action, self.highlighted_chat))

    async def set_chats(self, chats: list[Chat], current_id: int | None) -> None:
        await self.clear()
        await self.extend([ChatItem(c) for c in chats])
        for i, c in enumerate(chats):
            if c.id == current_id:
                self.index = i
                break


class Sidebar(Vertical):
    DEFAULT_CSS = """
    Sidebar { width: 24; height: 1fr; border-right: vkey $border-blurred; }
    Sidebar > .title { height: 1; padding: 0 1; color: $text-muted; text-style: bold; }
    Sidebar ChatList { height: 1fr; background: transparent; }
    Sidebar ChatList > ChatItem { padding: 0 1; }
    Sidebar ChatList > ChatItem Label { text-wrap: nowrap; text-overflow: ellipsis; width: 1fr; }
    """

    def compose(self) -> ComposeResult:
        yield Static("Chats  [dim]ctrl+n new[/]", classes="title")
        yield ChatList(id="chat-list")
