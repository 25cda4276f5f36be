"""The MCP servers: each one's state, tools and error, the config file's path; `r` reloads the file. And the one line
above the input that sums them up."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Static

from app.tui.mcp.config import CONFIG_NAME

MARKS = {"starting": "…", "connected": "●", "failed": "✗", "stopped": "○"}


def status_line(states: list[Any], config_error: str | None) -> str:
    """'MCP: files 3 tools · web cannot start · F8' ('' with no config file)."""
    if config_error:
        return f"MCP: {CONFIG_NAME} has an error, no servers run · F8"
    if not states:
        return ""
    parts = []
    for s in states:
        if s.status == "connected":
            parts.append(f"{s.name} {len(s.tools)} tool{'' if len(s.tools) == 1 else 's'}")
        elif s.status == "failed":
            parts.append(f"{s.name} {'stopped' if (s.error or '').startswith('stopped') else 'cannot start'}")
        else:
            parts.append(f"{s.name} {s.status}…" if s.status == "starting" else f"{s.name} {s.status}")
    return "MCP: " + " · ".join(parts) + " · F8"


def describe(states: list[Any], path: Path, config_error: str | None, notes: list[str]) -> str:
    lines = [f"Config: {path}"]
    if config_error:
        lines += ["", config_error, "No MCP server runs until the file is fixed; r reloads it."]
    elif not states and not notes:
        lines += ["", "No MCP servers. Add them to that file, as Claude Desktop and LM Studio do:",
                  '  {"mcpServers": {"name": {"command": "...", "args": ["..."]},',
                  '                  "other": {"url": "http://127.0.0.1:8000/mcp"}}}', "then press r."]
    for s in states:
        lines += ["", f"{MARKS.get(s.status, '?')} {s.name}  {s.status}  ({s.spec.transport}: {s.spec.describe()})"]
        if s.tools:
            names = ", ".join(t["name"] for t in s.tools)
            lines.append(f"  {len(s.tools)} tool{'' if len(s.tools) == 1 else 's'}: {names}")
        lines += [f"  left out: {line}" for line in s.skipped]
        if s.error:
            lines.append(f"  {s.error}")
        if s.log is not None and s.status == "failed" and s.log.exists() and s.log.stat().st_size:
            lines.append(f"  its stderr: {s.log}")
    if notes:
        lines += ["", *notes]
    return "\n".join(lines)


class MCPScreen(ModalScreen[None]):
    """`app` gives the states (app.mcp), the config's path and error, and reloads (app.reload_mcp)."""

    DEFAULT_CSS = """
    MCPScreen { align: center middle; }
    MCPScreen > VerticalScroll { width: 100; max-width: 100%; height: auto; max-height: 90%; padding: 0 1;
                                  border: thick $accent; background: $surface; }
    MCPScreen .heading { text-style: bold; margin-bottom: 1; }
    MCPScreen Horizontal { height: auto; align-horizontal: right; margin-top: 1; }
    MCPScreen Button { margin-left: 2; }
    """
    BINDINGS = [Binding("escape", "close", "Close"), Binding("r", "reload", "Reload config")]

    def compose(self) -> ComposeResult:
        with VerticalScroll():
            yield Static("MCP servers", classes="heading")
            yield Static("", id="mcp-servers", markup=False)
            with Horizontal():
                yield Button("Close", id="close")
                yield Button("Reload config (r)", id="reload", variant="primary")

    def on_mount(self) -> None:
        self.show()

    def show(self) -> None:
        app: Any = self.app
        self.query_one("#mcp-servers", Static).update(
            describe(app.mcp.states(), app.mcp_config_path, app.mcp_error, app.mcp_config_notes))

    def action_reload(self) -> None:
        self.app.reload_mcp()  # type: ignore[attr-defined]

    def action_close(self) -> None:
        self.dismiss(None)

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "reload":
            self.action_reload()
        else:
            self.action_close()
