"""The model picker: every model on this machine (the embedded one, the Hugging Face cache, Ollama, LM Studio,
paths added by hand) with its size, quantization and whether it fits; a path to add or a Hub repo to pull (with a
progress bar and a cancel); a model to remove (asked first)."""

from __future__ import annotations

import threading
import time

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, DataTable, Input, LoadingIndicator, ProgressBar, Static

from mlx_engine.api import RooflineError
from mlx_engine.catalog import ModelSummary

from app.models_cmd import human_params, human_size
from app.tui.backend import pull_status
from app.tui.screens.dialogs import ConfirmScreen


def fit_label(m: ModelSummary) -> str:
    if m.fits is None:
        return "?"
    return "yes" if m.fits else f"no, {human_size(m.need_bytes)}"


class _PickerProgress:
    """A pull's progress, from the pull's worker thread to the picker's bar: at each whole percent, or every 0.1 s.
    The rate shows after the first half second."""

    clock = staticmethod(time.monotonic)

    def __init__(self, picker: ModelPicker, ref: str):
        self.picker, self.ref, self.last, self.pct = picker, ref, 0.0, -1

    def start(self, plan, done_bytes: int) -> None:
        self.total, self.done, self.first, self.t0 = plan.total_bytes, done_bytes, done_bytes, self.clock()
        self._post(self.t0)

    def advance(self, nbytes: int) -> None:
        self.done += nbytes
        now = self.clock()
        if int(100 * self.done / max(self.total, 1)) != self.pct or now - self.last >= 0.1:
            self._post(now)

    def _post(self, now: float) -> None:
        self.last, self.pct = now, int(100 * self.done / max(self.total, 1))
        rate = (self.done - self.first) / (now - self.t0) if now - self.t0 >= 0.5 else 0.0
        self.picker.app.call_from_thread(self.picker._pull_progress, self.done, self.total,
                                         pull_status(self.ref, self.done, self.total, rate))

    def finish(self) -> None:
        pass


class ModelPicker(ModalScreen[str | None]):
    """Returns the chosen model's ref ("" is the embedded model), or None on Esc."""

    DEFAULT_CSS = """
    ModelPicker { align: center middle; }
    ModelPicker > Vertical { width: 110; max-width: 100%; height: auto; max-height: 100%; padding: 0 1;
                             border: thick $accent; background: $surface; }
    ModelPicker .heading { text-style: bold; }
    ModelPicker .hint { color: $text-muted; }
    ModelPicker DataTable { height: auto; max-height: 14; margin: 1 0; }
    ModelPicker LoadingIndicator { height: 3; }
    ModelPicker #pull-box { height: auto; display: none; }
    ModelPicker #pull-box ProgressBar { width: 1fr; }
    ModelPicker #pull-box Bar { width: 1fr; }
    ModelPicker #pull-box Button { min-width: 10; height: 1; border: none; }
    ModelPicker #picker-error { color: $error; height: auto; }
    """
    # The path box has the focus, so that what one types lands in it; the arrows move the list's cursor from there
    BINDINGS = [Binding("escape", "cancel", "Close"), Binding("up", "cursor(-1)", show=False),
                Binding("down", "cursor(1)", show=False),
                Binding("ctrl+r", "remove", "Remove", tooltip="Remove the highlighted model (asks first)"),
                Binding("delete", "remove", show=False)]  # Delete where the list has the focus (the box keeps its own)

    def __init__(self, backend, current_ref: str | None, extra_refs: list[str]) -> None:
        """current_ref: the loaded model's ref ("" the embedded one), None when none is loaded."""
        super().__init__()
        self.backend = backend
        self.current_ref = current_ref
        self.extra_refs = list(extra_refs)
        self.rows: list[ModelSummary] = []
        self.pulling: str | None = None  # the ref being pulled
        self.pull_cancel = threading.Event()

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Static("Pick a model", classes="heading")
            yield Static("↑/↓ highlight a model, Enter loads it; the current one stays until the new one is ready. "
                         "Type a path to add a model, or ORG/NAME[:QUANT] to pull one; ctrl+r removes one.",
                         classes="hint")
            yield LoadingIndicator()
            table: DataTable = DataTable(cursor_type="row", zebra_stripes=True)
            table.add_columns("", "Model", "Source", "On disk", "Params", "Quant", "Context", "Fits")
            table.display = False
            yield table
            yield Input(placeholder="A GGUF file or model folder to add, or ORG/NAME[:QUANT] to pull from the Hub; "
                        "then Enter", id="add-path", select_on_focus=False)
            with Horizontal(id="pull-box"):
                yield ProgressBar(total=100, show_eta=False, id="pull-bar")
                yield Button("Cancel", id="pull-cancel", variant="error")
            yield Static("", id="pull-status", markup=False)
            yield Static("", id="picker-error", markup=False)

    def on_mount(self) -> None:
        self.query_one("#add-path", Input).focus()
        self.list_models()

    def on_unmount(self) -> None:
        self.pull_cancel.set()  # the app closes mid-pull: the pull stops, its partial files kept for next time

    @work(thread=True, exclusive=True, group="picker")
    def list_models(self) -> None:
        rows: list[ModelSummary] = []
        error = ""
        try:
            rows = list(self.backend.list_models())
        except Exception as e:  # noqa: BLE001 - shown in the picker
            error = f"Could not list local models: {e}"
        known = {m.ref for m in rows}
        for ref in self.extra_refs:
            if ref in known:
                continue
            try:
                rows.append(self.backend.describe(ref))
            except Exception as e:  # noqa: BLE001
                rows.append(ModelSummary(ref, ref, "path", 0, 0, "?", 0, "?", error=str(e)))
        self.app.call_from_thread(self._show, rows, error)

    def _show(self, rows: list[ModelSummary], error: str, select: str | None = None) -> None:
        self.rows = rows
        table = self.query_one(DataTable)
        table.clear()
        for i, m in enumerate(rows):
            mark = "●" if m.ref == self.current_ref else ""
            if m.error:
                table.add_row(mark, m.name, m.source, "", "", "unreadable", m.error[:40], "", key=str(i))
            else:
                table.add_row(mark, m.name, m.source, human_size(m.size_bytes), human_params(m.num_parameters),
                              m.quantization, f"{m.context_length:,}" if m.context_length else "?", fit_label(m),
                              key=str(i))
        self.query_one(LoadingIndicator).display = False
        table.display = True
        for i, m in enumerate(rows):
            if m.ref == (select if select is not None else self.current_ref):
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

    # ---- adding a path, pulling a repo ------------------------------------------------------------------

    def on_input_submitted(self, event: Input.Submitted) -> None:
        text = event.value.strip()
        if not text:
            if self.rows:  # an empty box: Enter loads the highlighted model
                self.choose(self.query_one(DataTable).cursor_row)
            return
        if self.backend.is_repo_ref(text):
            self.start_pull(text)
        else:
            self.add_path(text)

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

    def start_pull(self, ref: str) -> None:
        if self.pulling is not None:
            self.query_one("#picker-error", Static).update(f"Already pulling {self.pulling}: cancel it first (Esc)")
            return
        self.pulling = ref
        self.pull_cancel = threading.Event()
        self.query_one("#picker-error", Static).update("")
        self.query_one("#pull-box").display = True
        self.query_one("#pull-bar", ProgressBar).update(total=100, progress=0)
        self.query_one("#pull-status", Static).update(f"Pulling {ref}: asking the Hub…")
        self.pull(ref, self.pull_cancel)

    @work(thread=True, exclusive=True, group="picker-pull")
    def pull(self, ref: str, cancel: threading.Event) -> None:
        try:
            loaded_ref = self.backend.pull(ref, _PickerProgress(self, ref), cancel)
        except RooflineError as e:
            self.app.call_from_thread(self._pull_ended, ref, None, str(e))
            return
        except Exception as e:  # noqa: BLE001 - a pull's failure is a line in the picker
            self.app.call_from_thread(self._pull_ended, ref, None, f"{type(e).__name__}: {e}")
            return
        self.app.call_from_thread(self._pull_ended, ref, loaded_ref, "")

    def _pull_progress(self, done: int, total: int, text: str) -> None:
        if self.pulling is None:
            return
        self.query_one("#pull-bar", ProgressBar).update(total=max(total, 1), progress=done)
        self.query_one("#pull-status", Static).update(text)

    def _pull_ended(self, ref: str, loaded_ref: str | None, error: str) -> None:
        self.pulling = None
        self.query_one("#pull-box").display = False
        self.query_one("#pull-status", Static).update(f"Pulled {loaded_ref}: Enter loads it" if loaded_ref else "")
        self.query_one("#picker-error", Static).update(error)
        if loaded_ref:
            self.query_one("#add-path", Input).value = ""  # so Enter loads it, highlighted
            self._refresh(select=loaded_ref)

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "pull-cancel":
            self.cancel_pull()

    def cancel_pull(self) -> None:
        if self.pulling is not None:
            self.pull_cancel.set()
            self.query_one("#pull-status", Static).update(f"Cancelling the pull of {self.pulling}…")

    @work(thread=True, exclusive=True, group="picker")
    def _refresh(self, select: str | None = None) -> None:
        try:
            rows = list(self.backend.list_models())
        except Exception as e:  # noqa: BLE001
            self.app.call_from_thread(self._show, self.rows, f"Could not list local models: {e}")
            return
        extra = [m for m in self.rows if m.source == "path" and m.ref not in {r.ref for r in rows}]
        self.app.call_from_thread(self._show, rows + extra, "", select)

    # ---- removing ---------------------------------------------------------------------------------------

    def action_remove(self) -> None:
        table = self.query_one(DataTable)
        if not self.rows:
            return
        m = self.rows[table.cursor_row]
        if m.source == "path":
            self.app.forget_model_path(m.ref)
            self._show([r for r in self.rows if r.ref != m.ref], "")
            self.query_one("#pull-status", Static).update(f"Forgot {m.ref} (its files stay where they are)")
            return
        try:
            plan = self.backend.removal(m.ref)
        except RooflineError as e:
            self.query_one("#picker-error", Static).update(str(e))
            return

        def answered(yes: bool | None) -> None:
            if yes:
                self._remove(plan)

        self.app.push_screen(ConfirmScreen(f"Remove {plan.ref} ({human_size(plan.size_bytes)}) from {plan.where}? "
                                           "Its files are deleted.", yes="Remove"), answered)

    @work(thread=True, exclusive=True, group="picker-remove")
    def _remove(self, plan) -> None:
        try:
            freed = self.backend.remove(plan)
        except Exception as e:  # noqa: BLE001 - a failed delete is a line in the picker
            self.app.call_from_thread(self.query_one("#picker-error", Static).update, f"{plan.ref}: {e}")
            return
        self.app.call_from_thread(self.query_one("#pull-status", Static).update,
                                  f"Removed {plan.ref}: {human_size(freed)} freed")
        self.app.call_from_thread(self._refresh)

    def action_cancel(self) -> None:
        if self.pulling is not None:
            self.cancel_pull()
            return
        self.dismiss(None)
