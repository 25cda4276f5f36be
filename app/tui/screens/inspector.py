"""The token inspector: a text as coloured token pieces with ids, and its token count under every local
tokenizer (so the same sentence in Chinese or Thai visibly costs more than in English)."""

from __future__ import annotations

from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Static, TextArea

PIECE_STYLES = ["on #3b4252", "on #4c566a", "on #5e4b6b", "on #3f5f4f", "on #6b5a3b", "on #3b5a6b"]

SAMPLES = [
    "The quick brown fox jumps over the lazy dog. Memory bandwidth bounds decoding speed.",
    "敏捷的棕色狐狸跳过了懒狗。内存带宽决定了解码速度。",
    "สุนัขจิ้งจอกสีน้ำตาลกระโดดข้ามสุนัขขี้เกียจ แบนด์วิดท์หน่วยความจำจำกัดความเร็วในการถอดรหัส",
]


def render_pieces(pieces: list[str], ids: list[int], show_ids: bool) -> Text:
    out = Text()
    for i, (piece, tid) in enumerate(zip(pieces, ids)):
        shown = piece.replace("\n", "↵\n").replace("\t", "→")
        out.append(shown or "∅", style=PIECE_STYLES[i % len(PIECE_STYLES)])
        if show_ids:
            out.append(f"{tid}", style="dim")
            out.append(" ")
    return out


class TokenInspector(Screen):
    """Esc closes; F5 toggles ids; F8 cycles sample texts (English, Chinese, Thai)."""

    DEFAULT_CSS = """
    TokenInspector { layout: vertical; }
    TokenInspector .heading { height: 1; padding: 0 1; text-style: bold; background: $panel; }
    TokenInspector #inspect-text { height: 6; }
    TokenInspector #count { height: 1; padding: 0 1; color: $accent; }
    TokenInspector #pieces-box { height: 1fr; border: round $border-blurred; }
    TokenInspector #pieces { padding: 0 1; }
    TokenInspector #compare { height: auto; max-height: 10; }
    """
    BINDINGS = [
        Binding("escape", "close", "Close"),
        Binding("f5", "toggle_ids", "Ids on/off"),
        Binding("f8", "sample", "Sample text"),
    ]

    def __init__(self, text: str, tokenizer, tokenizer_name: str) -> None:
        super().__init__()
        self.initial = text
        self.tokenizer = tokenizer
        self.tokenizer_name = tokenizer_name
        self.show_ids = True
        self.sample_index = -1
        self.others: list[tuple[str, object]] = []

    def compose(self) -> ComposeResult:
        yield Static("Token inspector — " + self.tokenizer_name, classes="heading", markup=False)
        yield TextArea(self.initial, id="inspect-text", soft_wrap=True, tab_behavior="focus")
        yield Static("", id="count")
        with VerticalScroll(id="pieces-box"):
            yield Static("", id="pieces")
        table: DataTable = DataTable(id="compare", cursor_type="none")
        table.add_columns("Tokenizer", "Tokens", "Chars/token")
        yield table
        yield Footer()

    def on_mount(self) -> None:
        self.refresh_tokens()
        self.load_tokenizers()

    @property
    def text(self) -> str:
        return self.query_one("#inspect-text", TextArea).text

    def on_text_area_changed(self, event: TextArea.Changed) -> None:
        self.refresh_tokens()

    def refresh_tokens(self) -> None:
        text = self.text
        try:
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            pieces = [self.tokenizer.id_to_piece(i) for i in ids]
        except Exception as e:  # noqa: BLE001 - a tokenizer error is shown, not raised
            self.query_one("#count", Static).update(f"cannot tokenize: {e}")
            return
        per = f" · {len(text) / len(ids):.2f} chars/token" if ids else ""
        self.query_one("#count", Static).update(f"{len(ids)} tokens · {len(text)} characters{per}")
        self.query_one("#pieces", Static).update(render_pieces(pieces, ids, self.show_ids))
        self.refresh_compare()

    @work(thread=True, exclusive=True, group="inspector-tokenizers")
    def load_tokenizers(self) -> None:
        self.app.call_from_thread(self._set_others, self.app.local_tokenizers())

    def _set_others(self, others: list[tuple[str, object]]) -> None:
        self.others = others
        self.refresh_compare()

    def refresh_compare(self) -> None:
        table = self.query_one("#compare", DataTable)
        table.clear()
        text = self.text
        rows = [(self.tokenizer_name + " (loaded)", self.tokenizer)] + [
            (name, tok) for name, tok in self.others if tok is not self.tokenizer and name != self.tokenizer_name]
        for name, tok in rows:
            try:
                n = len(tok.encode(text, add_special_tokens=False))
                table.add_row(name, str(n), f"{len(text) / n:.2f}" if n else "–")
            except Exception as e:  # noqa: BLE001
                table.add_row(name, "error", str(e)[:40])

    def action_toggle_ids(self) -> None:
        self.show_ids = not self.show_ids
        self.refresh_tokens()

    def action_sample(self) -> None:
        self.sample_index = (self.sample_index + 1) % len(SAMPLES)
        self.query_one("#inspect-text", TextArea).text = SAMPLES[self.sample_index]

    def action_close(self) -> None:
        self.dismiss()
