"""The model picker: the embedded model, models in the local Hugging Face cache, and paths added by hand."""

from __future__ import annotations

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import DataTable, Input, LoadingIndicator, Static

from mlx_engine.api import RooflineError
from mlx_engine.catalog import ModelSummary


def human_size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def human_params(n: int) -> str:
    if not n:
        return "?"
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}" if n < 10 * scale else f"{n / scale:.0f}{unit}"
    return str(n)


class ModelPicker(ModalScreen[str | None]):
    """Returns the chosen model's ref ("" is the embedded model), or None on Esc."""

    DEFAULT_CSS = """
    ModelPicker { align: center middle; }
    ModelPicker > Vertical { width: 100; max-width: 100%; height: auto; max-height: 100%; padding: 0 1;
                             border: thick $accent; background: $surface; }
    ModelPicker .heading { text-style: bold; }
    ModelPicker .hint { color: $text-muted; }
    ModelPicker DataTable { height: auto; max-height: 14; margin: 1 0; }
    ModelPicker LoadingIndicator { height: 3; }
    ModelPicker #picker-error { color: $error; height: auto; }
    """
    # The path box has the focus, so that what one types lands in it; the arrows move the list's cursor from there
    BINDINGS = [Binding("escape", "cancel", "Close"), Binding("up", "cursor(-1)", show=False),
                Binding("down", "cursor(1)", show=False)]

    def __init__(self, backend, current_ref: str | None, extra_refs: list[str]) -> None:
        """current_ref: the loaded model's ref ("" the embedded one), None when none is loaded."""
        super().__init__()
        self.backend = backend
        self.current_ref = current_ref
        self.extra_refs = list(extra_refs)
        self.rows: list[ModelSummary] = []

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Static("Pick a model", classes="heading")
            yield Static("↑/↓ highlight a model, Enter loads it; the current one stays until the new one is ready. "
                         "Type a path to add a model.", classes="hint")
            yield LoadingIndicator()
            table: DataTable = DataTable(cursor_type="row", zebra_stripes=True)
            table.add_columns("", "Model", "Source", "On disk", "Params", "Quant", "Context")
            table.display = False
            yield table
            yield Input(placeholder="Add a GGUF file or model folder by path, then Enter", id="add-path",
                        select_on_focus=False)
            yield Static("", id="picker-error", markup=False)

    def on_mount(self) -> None:
        self.query_one("#add-path", Input).focus()
        self.list_models()

    @work(thread=True, exclusive=True, group="picker")
    def list_models(self) -> None:
        rows: list[ModelSummary] = []
        error = ""
        try:
            rows = list(self.backend.list_models())
        except Exception as e:  # noqa: BLE001 - shown in the picker
            error = f"Could not list local models: {e}"
        for ref in self.extra_refs:
            try:
                rows.append(self.backend.describe(ref))
            except Exception as e:  # noqa: BLE001
                rows.append(ModelSummary(ref, ref, "path", 0, 0, "?", 0, "?", error=str(e)))
        self.app.call_from_thread(self._show, rows, error)

    def _show(self, rows: list[ModelSummary], error: str) -> None:
        self.rows = rows
        table = self.query_one(DataTable)
        table.clear()
        for i, m in enumerate(rows):
            mark = "●" if m.ref == self.current_ref else ""
            if m.error:
                table.add_row(mark, m.name, m.source, "", "", "unreadable", m.error[:40], key=str(i))
            else:
                table.add_row(mark, m.name, m.source, human_size(m.size_bytes), human_params(m.num_parameters),
                              m.quantization, f"{m.context_length:,}" if m.context_length else "?", key=str(i))
        self.query_one(LoadingIndicator).display = False
        table.display = True
        for i, m in enumerate(rows):
            if m.ref == self.current_ref:
                table.move_cursor(row=i)
        self.query_one("#picker-error", Static).update(error)

    def action_cursor(self, step: int) -> None:
        table = self.query_one(DataTable)
        if table.row_count:
            table.move_cursor(row=max(0, min(table.cursor_row + step, table.row_count - 1)))

    def on_key(self, event) -> None:
        """A character typed while the list has the focus goes to the path box (it would be lost otherwise)."""
        box = self.query_one("#add-path", Input)
        if event.is_printable and event.character and not box.has_focus:
            box.focus()
            box.insert_text_at_cursor(event.character)
            event.stop()

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        self.choose(int(event.row_key.value))

    def choose(self, index: int) -> None:
        m = self.rows[index]
        if m.error:
            self.query_one("#picker-error", Static).update(f"{m.name}: {m.error}")
            return
        if m.ref == self.current_ref:  # already loaded: nothing to reload
            self.notify(f"{m.name} is already loaded.", timeout=3)
            self.dismiss(None)
            return
        self.dismiss(m.ref)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        path = event.value.strip()
        if path:
            self.add_path(path)
        elif self.rows:  # an empty box: Enter loads the highlighted model
            self.choose(self.query_one(DataTable).cursor_row)

    @work(thread=True, exclusive=True, group="picker-add")
    def add_path(self, path: str) -> None:
        try:
            summary = self.backend.describe(path)
        except RooflineError as e:
            self.app.call_from_thread(self.query_one("#picker-error", Static).update, str(e))
            return
        except Exception as e:  # noqa: BLE001
            self.app.call_from_thread(self.query_one("#picker-error", Static).update, f"{path}: {e}")
            return
        self.app.call_from_thread(self._added, summary)

    def _added(self, summary: ModelSummary) -> None:
        self.app.remember_model_path(summary.ref)
        self.query_one("#add-path", Input).value = ""
        self.query_one("#picker-error", Static).update("")
        self._show([*self.rows, summary], "")
        self.query_one(DataTable).move_cursor(row=len(self.rows) - 1)

    def action_cancel(self) -> None:
        self.dismiss(None)
