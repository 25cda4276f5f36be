"""A TUI screen held still for a snapshot: fixed stats figures, no toasts, no cursor blink."""

from __future__ import annotations

from textual.widgets import Input, TextArea

from app.tui.widgets.stats import LiveStats

FIXED_STATS = LiveStats(decode_tps=41.3, ttft_s=0.18, prompt_tokens=31, reply_tokens=64, context_length=8192,
                        weight_bytes=94 * 2**20, kv_bytes=3 * 2**20, bytes_per_token=97 * 2**20,
                        bandwidth_bytes_per_s=100e9, bandwidth_label="100 GB/s Test chip", streaming=True)


async def settle(pilot, streaming: bool = False) -> None:
    """Freezes what changes between runs: stats figures, toasts, cursor blink."""
    app = pilot.app
    for screen in app.screen_stack:
        for w in screen.query(TextArea):
            w.cursor_blink = False
        for w in screen.query(Input):
            w.cursor_blink = False
    app.chat_screen.stats = LiveStats(**{**vars(FIXED_STATS), "streaming": streaming})
    app.chat_screen.show_stats()
    app.clear_notifications()
    await pilot.wait_for_scheduled_animations()
    await pilot.pause(0.3)
