"""Every key binding, grouped by where it applies (built from the bindings themselves, so it cannot drift)."""

from __future__ import annotations

from rich.table import Table
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static


def format_key(key: str) -> str:
    return " / ".join(k.strip() for k in key.split(","))


def keys_table(sections: list[tuple[str, list[tuple[str, str]]]]) -> Table:
    table = Table(box=None, expand=True, show_header=False, padding=(0, 1))
    table.add_column("Key", style="bold", no_wrap=True, ratio=1)
    table.add_column("Does", ratio=3)
    for where, rows in sections:
        table.add_row(f"[reverse] {where} [/]", "")
        for key, what in rows:
            table.add_row(format_key(key), what)
    return table


class HelpScreen(ModalScreen[None]):
    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen > VerticalScroll { width: 90; max-width: 100%; height: auto; max-height: 100%; padding: 0 1;
                                  border: thick $accent; background: $surface; }
    HelpScreen .heading { text-style: bold; }
    HelpScreen .hint { color: $text-muted; margin-bottom: 1; }
    """
    BINDINGS = [Binding("escape,q,f1", "close", "Close")]

    def __init__(self, sections: list[tuple[str, list[tuple[str, str]]]]) -> None:
        super().__init__()
        self.sections = sections

    def compose(self) -> ComposeResult:
        with VerticalScroll():
            yield Static("Keys", classes="heading")
            yield Static("ctrl+p opens the command palette with every action. Esc closes this screen.", classes="hint")
            yield Static(keys_table(self.sections), id="keys")

    def action_close(self) -> None:
        self.dismiss()
