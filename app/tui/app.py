"""RooflineApp: owns the engine, the chat store, the key bindings and routing between screens."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from textual import work
from textual.app import App, SystemCommand
from textual.binding import Binding
from textual.message import Message
from textual.screen import Screen

from mlx_engine.api import RooflineError

from app.tui.backend import EngineBackend
from app.tui.chat_kv import ChatKV
from app.tui.chat_screen import ChatScreen
from mlx_engine.roofline import Bandwidth
from app.tui.mcp.config import ConfigError, config_path, load_config
from app.tui.mcp.hub import MCPHub
from app.tui.reply import no_tokenizer_notice, reasoning_figures
from app.tui.screens.help import HelpScreen
from app.tui.screens.inspector import TokenInspector
from app.tui.screens.mcp import MCPScreen, status_line
from app.tui.screens.picker import ModelPicker
from app.tui.store import ChatSettings, ChatStore, data_dir
from app.tui.widgets.messages import MessageView
from app.tui.widgets.prompt import NEWLINE_KEYS, PromptInput
from app.tui.widgets.sidebar import ChatList
from app.tui.widgets.stats import LEGEND
from app.tui.widgets.tool_call import ToolCallView

THEMES = ("textual-dark", "textual-light")
CHAT_ACTIONS = {"new_chat", "pick_model", "settings", "inspect", "toggle_sidebar", "focus_chats", "delete_chat",
                "rename_chat", "regenerate", "stop", "copy_last", "mcp"}


class McpChanged(Message):
    """An MCP server's state changed (posted from the hub's thread)."""


class RooflineApp(App):
    """`backend` loads models, lists them and measures bandwidth (EngineBackend, or a FakeBackend in tests)."""

    CSS_PATH = Path(__file__).parent / "roofline.tcss"
    TITLE = "Roofline"
    BINDINGS = [
        Binding("f1", "help", "Help", tooltip="Every key binding"),
        Binding("ctrl+n", "new_chat", "New", tooltip="Start a new chat"),
        Binding("ctrl+l", "pick_model", "Model", tooltip="Pick or load a model"),
        Binding("ctrl+s", "settings", "Settings", tooltip="This chat's system prompt and sampling"),
        Binding("ctrl+t", "inspect", "Tokens", tooltip="Token inspector for the input (or a focused message)"),
        Binding("ctrl+b", "toggle_sidebar", "Chats", show=False, tooltip="Show or hide the chat list"),
        Binding("ctrl+o", "focus_chats", "Open chat", show=False,
                tooltip="Move to the chat list (showing it if hidden): arrows pick a chat, Enter opens it"),
        Binding("f4", "toggle_theme", "Dark/light", show=False, tooltip="Switch between dark and light themes"),
        Binding("f8", "mcp", "MCP", show=False, tooltip="MCP servers: their state and tools; r there reloads mcp.json"),
    ]

    def __init__(self, backend: Any = None, model: str | None = None, home: Path | str | None = None,
                 default_settings: ChatSettings | None = None, frame_s: float = 1 / 30,
                 coalesce_tokens: bool = True) -> None:
        super().__init__()
        self.backend = backend if backend is not None else EngineBackend()
        self.home = Path(home) if home is not None else data_dir()
        self.requested_model = model
        self.model_ref: str | None = None  # ref of the loaded engine ("" = embedded)
        self.engine: Any = None
        self.loading_ref: str | None = None
        self.bandwidth: Bandwidth | None = None
        self.frame_s = frame_s
        self.coalesce_tokens = coalesce_tokens
        self.store = ChatStore(self.home / "chats.db")
        self.chat_kv = ChatKV(self, self.backend, self.home / "kv")
        self.default_settings = default_settings or ChatSettings()
        self._tokenizers: list[tuple[str, Any]] | None = None
        self.chat_screen = ChatScreen()
        self.mcp = MCPHub(self.home / "mcp-logs", on_change=lambda: self.post_message(McpChanged()))
        self.mcp_config_path = config_path(self.home)
        self.mcp_error: str | None = None  # the config file cannot be used: no server runs
        self.mcp_config_notes: list[str] = []  # server entries left out of the config
        self._mcp_seen: dict[str, tuple[str, str | None]] = {}  # server -> (status, error) last shown
        theme = self.store.get_pref("theme")
        if theme in THEMES:
            self.theme = theme

    # ---- lifecycle -----------------------------------------------------------------------------------

    def get_default_screen(self) -> Screen:
        return self.chat_screen

    def chat_screen_ready(self) -> None:
        """Called once the chat screen is composed: report a moved-aside database, start loading."""
        if self.store.notice:
            self.notify(self.store.notice, title="Chat database", severity="warning", timeout=15)
        self.load_model(self.requested_model)
        self.measure_bandwidth()
        self.reload_mcp()

    def on_unmount(self) -> None:
        gen = self.chat_screen.gen
        if gen is not None:  # keep what was shown: the partial reply, marked stopped
            gen.cancel()
            self.store.update_message(gen.message_id, gen.view.content, "stopped", reasoning_figures(gen),
                                      reasoning=gen.view.reasoning)
        self.chat_screen.stop_tools()  # a call waiting or running is saved as stopped
        self.chat_kv.flush(timeout=5.0)  # a reply's KV still being written
        self.store.close()
        self.mcp.close()  # the servers' processes end with the app

    @work(thread=True, exclusive=True, group="bandwidth")
    def measure_bandwidth(self) -> None:
        try:
            bw = self.backend.bandwidth(self.home)
        except Exception as e:  # noqa: BLE001 - the roofline figure is optional
            self.call_from_thread(self.notify, f"Could not measure memory bandwidth: {e}", severity="warning")
            return
        self.call_from_thread(self._set_bandwidth, bw)

    def _set_bandwidth(self, bw: Bandwidth) -> None:
        self.bandwidth = bw
        self.chat_screen.show_stats()

    # ---- MCP servers ---------------------------------------------------------------------------------

    def reload_mcp(self) -> None:
        """(Re)reads mcp.json and restarts its servers on the hub's thread; what is wrong is a line in the chat."""
        self.mcp_error, self.mcp_config_notes, self._mcp_seen = None, [], {}
        try:
            config = load_config(self.mcp_config_path)
        except ConfigError as e:
            self.mcp_error = str(e)
            self.chat_screen.note(f"MCP config {e}; running without MCP servers.")
            config = None
        if config is not None:
            self.mcp_config_notes = config.errors
            for line in config.errors:
                self.chat_screen.note(f"MCP config {line}; that server is left out.")
        if config is not None or self.mcp.states():
            self.mcp.start(config.servers if config is not None else [])
        self.on_mcp_changed()

    def on_mcp_changed(self, message: McpChanged | None = None) -> None:
        states = self.mcp.states()
        line = status_line(states, self.mcp_error)
        status = self.chat_screen.query_one("#mcp-status")
        status.update(line)
        status.display = bool(line)
        for s in states:  # each failure once, as a line in the chat
            if s.status == "failed" and self._mcp_seen.get(s.name) != (s.status, s.error):
                self.chat_screen.note(f"MCP server '{s.name}' {s.error}")
            self._mcp_seen[s.name] = (s.status, s.error)
        if isinstance(self.screen, MCPScreen):
            self.screen.show()

    def action_mcp(self) -> None:
        if not isinstance(self.screen, MCPScreen):
            self.push_screen(MCPScreen())

    # ---- models --------------------------------------------------------------------------------------

    def load_model(self, ref: str | None) -> None:
        """Loads `ref` (None or "": the embedded model) in a worker; the current engine stays until it is ready."""
        ref = ref or ""
        self.loading_ref = ref
        label = ref or "the embedded model"
        self.chat_screen.set_loading(f"Loading {label}…")
        self._load_worker(ref)

    @work(thread=True, exclusive=True, group="load")
    def _load_worker(self, ref: str) -> None:
        try:
            engine = self.backend.load(ref or None, status=lambda text: self.call_from_thread(
                self.chat_screen.set_loading, text))  # a repo pulled first shows its progress
        except RooflineError as e:
            self.call_from_thread(self._load_failed, ref, str(e))
            return
        except Exception as e:  # noqa: BLE001 - any loader bug is a notice, not a crash
            self.call_from_thread(self._load_failed, ref, f"{type(e).__name__}: {e}")
            return
        self.call_from_thread(self._loaded, ref, engine)

    def _loaded(self, ref: str, engine: Any) -> None:
        old = self.engine
        gen = self.chat_screen.gen
        if gen is not None:
            gen.cancel()
        self.engine, self.model_ref, self.loading_ref = engine, ref, None
        draft = engine.info.draft_model
        self.sub_title = f"{engine.info.name} · {engine.info.runs_on}" + (f" · draft {draft}" if draft else "")
        self.chat_screen.set_loading(None)
        for warning in engine.info.warnings:
            self.notify(warning, title="About this model", severity="warning", timeout=12)
        if not engine.info.has_tokenizer:
            self.notify(no_tokenizer_notice(engine.info.name), title="This model cannot chat", severity="error",
                        timeout=20)
        if self.chat_screen.chat is not None:
            self.chat_kv.restore(engine, self.chat_screen.chat.id)
        if old is not None:  # a switch: say so (the first load shows in the title bar)
            self.notify(f"Loaded {engine.info.name}", timeout=3)
            self._close_engine(old)

    @work(thread=True, group="close")
    def _close_engine(self, engine: Any) -> None:
        try:
            engine.close()
        except Exception:  # noqa: BLE001 - closing is best effort
            pass

    def _load_failed(self, ref: str, message: str) -> None:
        self.loading_ref = None
        keep = f" Keeping {self.engine.info.name}." if self.engine is not None else ""
        self.notify(f"{message}{keep}", title=f"Could not load {ref or 'the embedded model'}", severity="error",
                    timeout=15)
        self.chat_screen.set_loading(None)

    def remember_model_path(self, ref: str) -> None:
        paths = self.extra_model_paths()
        if ref not in paths:
            self.store.set_pref("model_paths", json.dumps([*paths, ref]))

    def forget_model_path(self, ref: str) -> None:
        self.store.set_pref("model_paths", json.dumps([p for p in self.extra_model_paths() if p != ref]))

    def extra_model_paths(self) -> list[str]:
        try:
            value = json.loads(self.store.get_pref("model_paths", "[]") or "[]")
        except ValueError:
            return []
        return [p for p in value if isinstance(p, str)] if isinstance(value, list) else []

    def local_tokenizers(self) -> list[tuple[str, Any]]:
        """(name, tokenizer) for the embedded model and every readable local model (call from a worker)."""
        if self._tokenizers is None:
            out: list[tuple[str, Any]] = []
            try:
                models = self.backend.list_models()
            except Exception:  # noqa: BLE001
                models = []
            for m in models:
                if m.error:
                    continue
                try:
                    out.append((m.name, self.backend.load_tokenizer(m.ref or None)))
                except Exception:  # noqa: BLE001 - a model without a usable tokenizer is skipped
                    continue
            self._tokenizers = out
        return self._tokenizers

    # ---- actions -------------------------------------------------------------------------------------

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action in CHAT_ACTIONS and self.screen is not self.chat_screen:
            return False
        return True

    async def action_new_chat(self) -> None:
        await self.chat_screen.new_chat()

    def action_pick_model(self) -> None:
        def chosen(ref: str | None) -> None:
            if ref is not None:
                self.load_model(ref)

        self.push_screen(ModelPicker(self.backend, self.model_ref, self.extra_model_paths()), chosen)

    def action_settings(self) -> None:
        self.chat_screen.open_settings()

    def action_inspect(self, text: str | None = None) -> None:
        if text is None:
            focused = self.focused
            text = focused.content if isinstance(focused, MessageView) else self.chat_screen.query_one(PromptInput).text
        tokenizer, name = (self.engine.tokenizer, self.engine.info.name) if self.engine is not None else (None, "")
        if tokenizer is None:
            try:
                tokenizer, name = self.backend.load_tokenizer(None), "embedded model"
            except Exception as e:  # noqa: BLE001
                self.notify(f"No tokenizer available: {e}", severity="error")
                return
        self.push_screen(TokenInspector(text, tokenizer, name))

    def action_toggle_sidebar(self) -> None:
        sidebar = self.chat_screen.query_one("#sidebar")
        sidebar.display = not sidebar.display
        self.chat_screen.sidebar_choice = sidebar.display
        if sidebar.display:
            self.chat_screen.query_one(ChatList).focus()
        else:
            self.chat_screen.query_one(PromptInput).focus()

    def action_focus_chats(self) -> None:
        sidebar = self.chat_screen.query_one("#sidebar")
        if not sidebar.display:
            sidebar.display = True
            self.chat_screen.sidebar_choice = True
        self.chat_screen.query_one(ChatList).focus()

    def action_delete_chat(self) -> None:
        self.chat_screen.delete_chat()

    def action_rename_chat(self) -> None:
        self.chat_screen.rename_chat()

    def action_toggle_theme(self) -> None:
        self.theme = THEMES[1] if self.theme == THEMES[0] else THEMES[0]
        self.store.set_pref("theme", self.theme)

    def action_help(self) -> None:
        if isinstance(self.screen, HelpScreen):
            return
        self.push_screen(HelpScreen(self.key_sections()))

    def key_sections(self) -> list[tuple[str, list[tuple[str, str]]]]:
        def rows(bindings: Iterable[Any]) -> list[tuple[str, str]]:
            return [(b.key, b.tooltip or b.description) for b in bindings if isinstance(b, Binding) and b.description]

        return [
            ("Anywhere", rows(self.BINDINGS) + [("ctrl+p", "Command palette: every action"), ("ctrl+q", "Quit")]),
            ("Chat", rows(ChatScreen.BINDINGS)),
            ("Input", [("enter", "Send the message (an empty one is not sent)"),
                       (",".join(NEWLINE_KEYS), "Insert a newline"), ("tab", "Move focus to the next widget")]),
            ("Focused message", rows(MessageView.BINDINGS)),
            ("Tool call asking to run", rows(ToolCallView.BINDINGS) + [("escape", "Stop the turn's calls")]),
            ("Chat list", [("enter", "Open the highlighted chat")] + rows(ChatList.BINDINGS)),
            ("Token inspector", rows(TokenInspector.BINDINGS)),
            ("Stats bar", LEGEND),
        ]

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        if screen is not self.chat_screen:
            return
        cs = self.chat_screen
        yield SystemCommand("New chat", "Start a new chat (ctrl+n)", self.action_new_chat)
        yield SystemCommand("Pick model", "Load another model (ctrl+l)", self.action_pick_model)
        yield SystemCommand("Chat settings", "System prompt and sampling for this chat (ctrl+s)", self.action_settings)
        yield SystemCommand("Token inspector", "Tokens of the input under every local tokenizer (ctrl+t)",
                            self.action_inspect)
        yield SystemCommand("Regenerate reply", "Replace the last reply with a new one (ctrl+r)", cs.action_regenerate)
        yield SystemCommand("Stop reply", "Stop the streaming reply, keeping its text (Esc)", cs.action_stop)
        yield SystemCommand("Copy last reply", "Copy the last reply to the clipboard (F3)", cs.action_copy_last)
        if cs.replies_with_thoughts():
            yield SystemCommand("Show or hide thinking", "Expand or collapse the reasoning of the focused reply, else "
                                "the last one (F5)", cs.action_toggle_thought)
        if cs.model_reasons():
            yield SystemCommand("Thinking effort", "Step this chat's thinking effort: default, off, low, medium, "
                                "high (F9)", cs.action_cycle_effort)
        yield SystemCommand("Rename chat", "Rename this chat (F2)", self.action_rename_chat)
        yield SystemCommand("Delete chat", "Delete this chat after confirming", self.action_delete_chat)
        yield SystemCommand("Toggle sidebar", "Show or hide the chat list (ctrl+b)", self.action_toggle_sidebar)
        yield SystemCommand("Go to the chat list", "Pick a chat with the arrows, Enter opens it (ctrl+o)",
                            self.action_focus_chats)
        yield SystemCommand("MCP servers", "The MCP servers' state and tools (F8)", self.action_mcp)
        yield SystemCommand("Reload MCP config", f"Read {self.mcp_config_path} again and restart its servers",
                            self.reload_mcp)
        yield SystemCommand("Toggle dark/light", "Switch between the dark and light theme (F4)",
                            self.action_toggle_theme)
        yield SystemCommand("Help", "Every key binding (F1)", self.action_help)
