"""The app's model picker: every source with size, quantization and fit; a repo pulled with a progress bar and a
cancel; a model removed after a confirmation; through Textual's Pilot and a snapshot."""

from __future__ import annotations

import pytest
from textual.widgets import DataTable, ProgressBar

from app.tui.screens.dialogs import ConfirmScreen
from app.tui.screens.picker import ModelPicker, _PickerProgress
from tests.support.tui_frozen import settle
from tests.support.tui_helpers import make_app, ready, screen_text, wait_for

SIZE = (120, 36)


async def open_picker(pilot) -> ModelPicker:
    await ready(pilot)
    await pilot.press("ctrl+l")
    await wait_for(pilot, lambda: isinstance(pilot.app.screen, ModelPicker) and pilot.app.screen.rows, what="picker")
    return pilot.app.screen


async def type_in(pilot, picker: ModelPicker, text: str) -> None:
    box = picker.query_one("#add-path")
    box.focus()
    box.value = text
    await pilot.press("enter")


def status(picker: ModelPicker) -> str:
    return str(picker.query_one("#pull-status").render())


def error(picker: ModelPicker) -> str:
    return str(picker.query_one("#picker-error").render())


async def test_the_table_shows_source_size_quant_and_fit(tmp_path) -> None:
    app, _ = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await open_picker(pilot)
        text = screen_text(app)
        for words in ("Fits", "FakeLM-1M (test)", "embedded", "Q4_1", "org/fake-big", "hf-cache", "1.3 GB", "bf16",
                      "no, 1.5 GB", "yes"):
            assert words in text, words


async def test_pull_shows_progress_cancels_and_then_completes(tmp_path) -> None:
    app, backend = make_app(tmp_path, pull_hold_at=0.4)
    async with app.run_test(size=SIZE) as pilot:
        picker = await open_picker(pilot)
        await type_in(pilot, picker, "org/new-model")
        bar = picker.query_one("#pull-bar", ProgressBar)
        await wait_for(pilot, lambda: bar.percentage == pytest.approx(0.4), what="40%")
        assert picker.query_one("#pull-box").display
        assert "Pulling org/new-model: 16.8 of 41.9 MB (40%)" in status(picker)
        await pilot.press("escape")  # cancels the pull; the picker stays
        await wait_for(pilot, lambda: backend.pulls == [("org/new-model", "cancelled")], what="cancelled")
        await wait_for(pilot, lambda: "pull cancelled" in error(picker), what="cancel shown")
        assert isinstance(app.screen, ModelPicker) and not picker.query_one("#pull-box").display
        assert "org/new-model" not in {m.ref for m in picker.rows}
        backend.release_pull()
        await type_in(pilot, picker, "org/new-model")  # again: it completes and is listed, highlighted
        await wait_for(pilot, lambda: backend.pulls[-1] == ("org/new-model", "done"), what="pulled")
        await wait_for(pilot, lambda: "org/new-model" in {m.ref for m in picker.rows}, what="listed")
        assert "Pulled org/new-model: Enter loads it" in status(picker)
        table = picker.query_one(DataTable)
        assert picker.rows[table.cursor_row].ref == "org/new-model" and picker.query_one("#add-path").value == ""
        await pilot.press("enter")  # the box is empty: Enter loads the highlighted model
        await wait_for(pilot, lambda: app.model_ref == "org/new-model", what="loaded")


async def test_a_failed_pull_is_one_line_and_a_path_still_adds(tmp_path) -> None:
    app, backend = make_app(tmp_path, fail={"org/gated": "org/gated is gated: accept its terms at https://..."})
    gguf = tmp_path / "mine.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 64)
    async with app.run_test(size=SIZE) as pilot:
        picker = await open_picker(pilot)
        await type_in(pilot, picker, "org/gated")
        await wait_for(pilot, lambda: "org/gated is gated" in error(picker), what="error")
        assert backend.pulls == [("org/gated", "failed")]
        await type_in(pilot, picker, str(gguf))  # a path is added, not pulled
        await wait_for(pilot, lambda: str(gguf) in {m.ref for m in picker.rows}, what="added")
        assert len(backend.pulls) == 1


async def test_remove_asks_then_deletes_and_a_path_is_forgotten(tmp_path) -> None:
    app, backend = make_app(tmp_path)
    gguf = tmp_path / "mine.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 64)
    async with app.run_test(size=SIZE) as pilot:
        picker = await open_picker(pilot)
        table = picker.query_one(DataTable)
        table.focus()
        table.move_cursor(row=0)
        await pilot.press("delete")  # the embedded model is never removed
        await wait_for(pilot, lambda: "cannot be removed" in error(picker), what="refused")
        table.move_cursor(row=1)
        await pilot.press("delete")
        await wait_for(pilot, lambda: isinstance(app.screen, ConfirmScreen), what="asked")
        assert app.screen.question.startswith("Remove org/fake-big (1.3 GB) from the fake hf-cache store?")
        await pilot.press("n")
        await wait_for(pilot, lambda: app.screen is picker, what="back")
        assert backend.removed == []
        await pilot.press("delete")
        await wait_for(pilot, lambda: isinstance(app.screen, ConfirmScreen), what="asked again")
        await pilot.press("y")
        await wait_for(pilot, lambda: "org/fake-big" not in {m.ref for m in picker.rows}, what="removed")
        assert backend.removed == ["org/fake-big"] and "Removed org/fake-big: 1.3 GB freed" in status(picker)
        await type_in(pilot, picker, str(gguf))
        await wait_for(pilot, lambda: str(gguf) in {m.ref for m in picker.rows}, what="added")
        assert app.extra_model_paths() == [str(gguf)]
        table.focus()
        table.move_cursor(row=len(picker.rows) - 1)
        await pilot.press("delete")  # a path of the user's: forgotten, never deleted
        await wait_for(pilot, lambda: app.extra_model_paths() == [], what="forgotten")
        assert gguf.exists() and "Forgot" in status(picker)


def test_picker_pulling_snapshot(snap_compare, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(_PickerProgress, "clock", staticmethod(lambda: 0.0))  # no rate, so the frame is fixed
    app, backend = make_app(tmp_path, pull_hold_at=0.4)

    async def run_before(pilot) -> None:
        picker = await open_picker(pilot)
        await type_in(pilot, picker, "bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M")
        bar = picker.query_one("#pull-bar", ProgressBar)
        await wait_for(pilot, lambda: bar.percentage == pytest.approx(0.4), what="40%")
        await settle(pilot)

    try:
        assert snap_compare(app, terminal_size=SIZE, run_before=run_before)
    finally:
        backend.release_pull()
