"""The chat screen: sidebar of saved chats, the transcript, the input and the stats bar; sending, editing,
regenerating. Running a reply is `ReplyRunner`'s job (reply.py), its MCP tool calls `ToolRunner`'s (tool_runner.py); a
reasoning model's keys are `ThinkingControls`' (thinking.py)."""

from __future__ import annotations

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import Screen
from textual.widgets import Footer, Header, ProgressBar, Static

from app.tui.screens.dialogs import ConfirmScreen, TextPromptScreen
from app.tui.reply import Generation, ReplyRunner, no_tokenizer_notice
from app.tui.screens.settings import SettingsScreen
from app.tui.store import Chat, ChatSettings, Message
from app.tui.thinking import ThinkingControls
from app.tui.tool_runner import ToolRunner, chat_messages
from app.tui.widgets.messages import MessageView
from app.tui.widgets.prompt import PromptInput
from app.tui.widgets.sidebar import ChatList, Sidebar
from app.tui.widgets.stats import LiveStats, StatsBar
from app.tui.widgets.tool_call import ToolCallView

WELCOME = "Ask anything. Enter sends, ctrl+j adds a line, Esc stops a reply, F1 lists every key."


class ChatScreen(ToolRunner, ReplyRunner, ThinkingControls, Screen):
    BINDINGS = [
        Binding("escape", "stop", "Stop", tooltip="Stop the reply (keeps the partial text) or cancel an edit"),
        Binding("ctrl+r", "regenerate", "Regen", tooltip="Regenerate the last reply"),
        Binding("f3", "copy_last", "Copy", show=False, tooltip="Copy the last reply to the clipboard (OSC 52)"),
        Binding("f2", "rename_chat", "Rename", show=False, tooltip="Rename this chat"),
        Binding("f5", "toggle_thought", "Thinking",
                tooltip="Show/hide thinking: the focused reply's, else the last one's"),
        Binding("f9", "cycle_effort", "Effort",
                tooltip="Thinking effort of this chat: default/off/low/medium/high"),
    ]

    NARROW = 90  # below this width the sidebar starts hidden (ctrl+b shows it)

    def __init__(self) -> None:
        super().__init__()
        self.sidebar_choice: bool | None = None  # set once the user toggles the sidebar
        self.chat: Chat | None = None
        self.gen: Generation | None = None
        self.init_tools()
        self.editing: MessageView | None = None
        self.stats = LiveStats()

    # ---- layout ---------------------------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal(id="body"):
            yield Sidebar(id="sidebar")
            with Vertical(id="main"):
                with VerticalScroll(id="transcript"):
                    yield Static(WELCOME, id="welcome")
                with Horizontal(id="loading"):
                    yield Static("Loading model…", id="loading-label", markup=False)
                    yield ProgressBar(total=None, show_eta=False, show_percentage=False, id="loading-bar")
                yield Static("", id="mcp-status", markup=False)
                yield PromptInput(id="prompt", placeholder="Loading model…", disabled=True)
                yield StatsBar(id="stats")
        yield Footer()

    async def on_mount(self) -> None:
        chats = self.rapp.store.list_chats()
        await self.refresh_sidebar(chats)
        if chats:
            await self.open_chat(chats[0])
        transcript = self.query_one("#transcript", VerticalScroll)
        transcript.anchor()
        self.watch(transcript, "scroll_y", self.transcript_scrolled, init=False)
        self.show_stats()
        self.rapp.chat_screen_ready()

    def on_resize(self) -> None:
        sidebar = self.query_one("#sidebar")
        sidebar.display = self.sidebar_choice if self.sidebar_choice is not None else self.size.width >= self.NARROW

    # ---- model state (called by the app) -------------------------------------------------------------

    def set_loading(self, label: str | None) -> None:
        """label: "Loading X…" while a model loads; None when done (the input state follows the engine)."""
        box = self.query_one("#loading")
        box.display = label is not None
        if label is not None:
            self.query_one("#loading-label", Static).update(label)
        prompt = self.query_one(PromptInput)
        engine = self.rapp.engine
        mute = engine is not None and not engine.info.has_tokenizer
        ready = engine is not None and label is None and not mute
        prompt.disabled = not ready
        if ready:
            prompt.placeholder = "Message (Enter sends, ctrl+j newline)"
        elif label is not None:
            prompt.placeholder = label
        elif mute:
            prompt.placeholder = f"{engine.info.name} has no tokenizer, so it cannot chat: ctrl+l picks another model"
        else:
            prompt.placeholder = "No model loaded: ctrl+l picks one"
        if ready and self.app.screen is self:
            prompt.focus()
        self.show_effort()
        self.refresh_bindings()
        self.show_stats()

    def show_stats(self) -> None:
        engine = self.rapp.engine
        bw = self.rapp.bandwidth
        s = self.stats
        if engine is not None and s.model and s.model != engine.info.name and not s.streaming:
            s = self.stats = LiveStats()  # another model's speed and cache, not this one's: start blank
        if engine is not None:
            s.context_length = engine.info.context_length
            s.weight_bytes = engine.info.weight_bytes
            if not s.streaming and s.reply_tokens and not s.bytes_per_token:  # a saved reply's figures
                self.fill_bytes(engine, s)
        if bw is not None:
            s.bandwidth_bytes_per_s = bw.bytes_per_s
            s.bandwidth_label = bw.describe()
        self.query_one(StatsBar).show(s)

    async def transcript_scrolled(self) -> None:
        """Brings back the parts of long replies that scrolling brought near (see MessageView.hide_far_segments)."""
        for view in self.query(MessageView):
            if view.has_hidden_segments:
                await view.hide_far_segments()

    # ---- chats -------------------------------------------------------------------------------------------

    async def refresh_sidebar(self, chats: list[Chat] | None = None) -> None:
        chats = self.rapp.store.list_chats() if chats is None else chats
        await self.query_one(ChatList).set_chats(chats, self.chat.id if self.chat else None)

    async def open_chat(self, chat: Chat | None) -> None:
        """Shows `chat` (None: a fresh, unsaved chat that is created on the first message)."""
        if self.gen is not None:
            self.gen.cancel()
        self.stop_tools()
        self.cancel_edit()
        self.chat = chat
        transcript = self.query_one("#transcript", VerticalScroll)
        await transcript.remove_children()
        self.sub_title_for_chat()
        messages = self.rapp.store.messages(chat.id) if chat is not None else []
        if messages:
            views = [message_view(m) for m in messages]
            for view, after in zip(views, views[1:]):  # a reply that only called tools: its calls say it all
                view.display = not (view.role == "assistant" and not view.content and not view.reasoning
                                    and isinstance(after, ToolCallView))
            await transcript.mount_all(views)
        else:
            await transcript.mount(Static(WELCOME, id="welcome"))
        transcript.scroll_end(animate=False)
        # the bar shows the chat's last finished reply, as it did when that reply ended
        saved = [m.stats for m in messages if m.role == "assistant" and "completion_tokens" in m.stats]
        self.stats = LiveStats.from_saved(saved[-1]) if saved else LiveStats()
        self.show_stats()
        self.show_effort()
        self.refresh_bindings()
        if chat is not None and self.rapp.engine is not None:
            self.rapp.chat_kv.restore(self.rapp.engine, chat.id)

    def sub_title_for_chat(self) -> None:
        self.title = self.chat.title if self.chat else "New chat"

    @on(ChatList.Selected)
    async def chat_selected(self, event: ChatList.Selected) -> None:
        item = event.item
        chat = getattr(item, "chat", None)
        if chat is not None and (self.chat is None or chat.id != self.chat.id):
            await self.open_chat(self.rapp.store.get_chat(chat.id))

    @on(ChatList.Requested)
    async def chat_list_request(self, event: ChatList.Requested) -> None:
        if event.action == "new":
            await self.new_chat()
        elif event.action == "rename" and event.chat is not None:
            self.rename_chat(event.chat)
        elif event.action == "delete" and event.chat is not None:
            self.delete_chat(event.chat)

    async def new_chat(self) -> None:
        await self.open_chat(None)
        await self.refresh_sidebar()
        self.query_one(PromptInput).focus()

    def rename_chat(self, chat: Chat | None = None) -> None:
        chat = chat or self.chat
        if chat is None:
            self.notify("This chat is not saved yet: send a message first.", severity="warning")
            return

        async def done(title: str | None) -> None:
            if title and title.strip():
                self.rapp.store.rename_chat(chat.id, title.strip())
                if self.chat and self.chat.id == chat.id:
                    self.chat.title = title.strip()
                    self.sub_title_for_chat()
                await self.refresh_sidebar()

        self.app.push_screen(TextPromptScreen("Rename chat", chat.title), done)

    def delete_chat(self, chat: Chat | None = None) -> None:
        chat = chat or self.chat
        if chat is None:
            return

        async def done(yes: bool | None) -> None:
            if not yes:
                return
            if self.gen is not None and self.gen.chat_id == chat.id:
                self.gen.cancel()
            self.rapp.store.delete_chat(chat.id)
            self.rapp.chat_kv.forget(chat.id)
            if self.chat and self.chat.id == chat.id:
                await self.open_chat(None)
            await self.refresh_sidebar()
            self.notify(f"Deleted “{chat.title}”", timeout=3)

        self.app.push_screen(ConfirmScreen(f"Delete the chat “{chat.title}” and all its messages?"), done)

    def current_settings(self) -> ChatSettings:
        return self.chat.settings if self.chat else self.rapp.default_settings

    def apply_settings(self, settings: ChatSettings) -> None:
        """This chat's settings from now on (saved), or those of new chats while none is open."""
        if self.chat is not None:
            self.chat.settings = settings
            self.rapp.store.save_settings(self.chat.id, settings)
        else:
            self.rapp.default_settings = settings
        self.show_effort()

    def open_settings(self) -> None:
        def done(settings: ChatSettings | None) -> None:
            if settings is None:
                return
            self.apply_settings(settings)
            self.notify("Settings saved", timeout=2)

        engine = self.rapp.engine
        self.app.push_screen(SettingsScreen(self.current_settings(), self.chat.title if self.chat else "",
                                            reasons=engine is not None and engine.info.reasoning is not None), done)

    # ---- sending ------------------------------------------------------------------------------------------

    @on(PromptInput.Submitted)
    async def submitted(self, event: PromptInput.Submitted) -> None:
        text = event.text
        if not text.strip():
            self.notify("Nothing to send: the message is empty.", severity="warning", timeout=2)
            return
        if self.gen is not None:
            self.notify("A reply is still streaming: Esc stops it.", severity="warning", timeout=3)
            return
        if self.tool_worker is not None:
            self.notify("A tool call is waiting or running: y, a or n answers it, Esc stops the turn.",
                        severity="warning", timeout=4)
            return
        if self.rapp.engine is None:
            self.notify("No model is loaded: ctrl+l picks one.", severity="error")
            return
        if not self.rapp.engine.info.has_tokenizer:
            self.notify(no_tokenizer_notice(self.rapp.engine.info.name), severity="error")
            return
        if self.editing is not None:
            await self.truncate_from(self.editing)
            self.cancel_edit()
        event.prompt.clear()
        await self.send(text)

    async def send(self, text: str) -> None:
        if self.chat is None:
            title = " ".join(text.split())[:48] or "New chat"
            self.chat = self.rapp.store.create_chat(title, self.rapp.model_ref or "",
                                                    settings=ChatSettings(**vars(self.rapp.default_settings)))
            self.sub_title_for_chat()
        for w in self.query("#welcome"):
            await w.remove()
        msg = self.rapp.store.add_message(self.chat.id, "user", text)
        await self.query_one("#transcript").mount(MessageView("user", text, msg.id))
        await self.refresh_sidebar()
        await self.start_reply()

    def history(self) -> list[dict[str, str]]:
        """The chat as the model sees it: the system prompt, then every message but failed replies."""
        assert self.chat is not None
        return chat_messages(self.chat.settings.system_prompt, list(self.query(MessageView)),
                             self.tool_format(self.rapp.engine))

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        thinking = self.check_thinking_action(action)
        if thinking is not None:
            return thinking
        if action == "stop":
            return self.gen is not None or self.editing is not None or self.tool_worker is not None
        if action == "regenerate":
            return True if self.gen is None and self.tool_worker is None and self.chat is not None else None
        return True

    # ---- stop, regenerate, edit, copy ----------------------------------------------------------------------

    def action_stop(self) -> None:
        if self.gen is not None:
            self.gen.cancel()
        elif self.tool_worker is not None:
            self.stop_tools()
        elif self.editing is not None:
            self.cancel_edit()
            self.query_one(PromptInput).clear()

    def cancel_edit(self) -> None:
        if self.editing is not None:
            self.editing = None
            prompt = self.query_one(PromptInput)
            prompt.remove_class("-editing")
            prompt.border_title = None
            self.refresh_bindings()

    async def truncate_from(self, view: MessageView) -> None:
        """Deletes `view`'s message and every later one (store and transcript)."""
        assert self.chat is not None and view.message_id is not None
        self.rapp.store.delete_messages_from(self.chat.id, view.message_id)
        self.rapp.chat_kv.forget(self.chat.id)  # its prefix blocks stay valid; the next reply saves the new history
        views = list(self.query(MessageView))
        for v in views[views.index(view):]:
            await v.remove()

    async def action_regenerate(self) -> None:
        if self.gen is not None or self.tool_worker is not None or self.chat is None or self.rapp.engine is None:
            return
        views = list(self.query(MessageView))
        if not views:
            return
        if views[-1].role == "assistant":
            await self.truncate_from(views[-1])
        await self.start_reply()

    def action_copy_last(self) -> None:
        replies = [v for v in self.query(MessageView) if v.role == "assistant"]
        if not replies:
            self.notify("No reply to copy yet.", timeout=2)
            return
        replies[-1].action_copy()

    def action_rename_chat(self) -> None:
        self.rename_chat()

    @on(MessageView.Requested)
    async def message_request(self, event: MessageView.Requested) -> None:
        view = event.view
        if event.action == "edit":
            if self.gen is not None or self.tool_worker is not None:
                self.notify("Stop the reply first (Esc).", severity="warning")
                return
            self.editing = view
            prompt = self.query_one(PromptInput)
            prompt.text = view.content
            prompt.add_class("-editing")
            prompt.border_title = "Editing: Enter resends (later turns are replaced), Esc cancels"
            prompt.focus()
            prompt.move_cursor(prompt.document.end)
            self.refresh_bindings()
        elif event.action == "regenerate":
            views = list(self.query(MessageView))
            if view is views[-1] and view.role == "assistant":
                await self.action_regenerate()
            else:
                self.notify("Only the last reply can be regenerated; edit a message to branch earlier.", timeout=3)
        elif event.action == "inspect":
            self.rapp.action_inspect(view.content)


def message_view(m: Message) -> MessageView:
    if m.role == "tool":
        return ToolCallView(m.stats.get("tool_call") or {}, m.content, m.id, m.status)
    return MessageView(m.role, m.content, m.id, m.status, m.stats.get("error"), m.reasoning, m.stats)
