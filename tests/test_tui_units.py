"""The app's pieces without a terminal: chat store, chip table and bandwidth cache, token batching, stats math,
and that importing the app pulls in no MLX."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import pytest

from app.tui.store import ChatSettings, ChatStore
from app.tui.streaming import TokenBuffer
from app.tui.widgets.stats import LiveStats
from mlx_engine import roofline as chips
from mlx_engine.api import GenerationEvent, Usage
from mlx_engine.roofline import Bandwidth, load_chips, lookup, machine_bandwidth
from tests.support.tui_helpers import SEGMENTED_REPLY


def test_store_round_trip_newest_first_and_wal(tmp_path) -> None:
    store = ChatStore(tmp_path / "chats.db")
    a = store.create_chat("a", settings=ChatSettings(temperature=0.2, seed=3))
    b = store.create_chat("b")
    m1 = store.add_message(a.id, "user", "hi")
    store.add_message(a.id, "assistant", "hello", stats={"decode_tps": 5.0})
    assert [c.title for c in store.list_chats()] == ["a", "b"]  # a got a message: most recently updated
    assert store.get_chat(a.id).settings == ChatSettings(temperature=0.2, seed=3)
    assert [(m.role, m.content, m.stats) for m in store.messages(a.id)] == [
        ("user", "hi", {}), ("assistant", "hello", {"decode_tps": 5.0})]
    store.delete_messages_from(a.id, m1.id)
    assert store.messages(a.id) == []
    store.delete_chat(b.id)
    assert [c.title for c in store.list_chats()] == ["a"]
    store.set_pref("theme", "textual-light")
    assert store.get_pref("theme") == "textual-light" and store.get_pref("nope", "d") == "d"
    assert store.conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    store.close()


def test_settings_from_json_ignores_unknown_and_bad_fields() -> None:
    assert ChatSettings.from_json('{"temperature": 0.1, "future_field": 1}') == ChatSettings(temperature=0.1)
    assert ChatSettings.from_json("not json") == ChatSettings()


@pytest.mark.parametrize("garbage", [b"junk" * 1000, b"SQLite format 3\x00" + b"\xff" * 5000])
def test_corrupt_database_is_moved_aside_never_deleted(tmp_path, garbage) -> None:
    path = tmp_path / "chats.db"
    path.write_bytes(garbage)
    store = ChatStore(path)
    assert store.notice and "moved it to chats.db.corrupt-" in store.notice
    (aside,) = [p for p in tmp_path.iterdir() if ".corrupt-" in p.name]
    assert aside.read_bytes() == garbage
    assert store.list_chats() == []
    store.close()


def test_unwritable_data_dir_falls_back_to_memory(tmp_path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    store = ChatStore(blocker / "sub" / "chats.db")  # parent is a file: cannot be created
    assert store.notice and "in memory" in store.notice
    store.create_chat("t")
    assert len(store.list_chats()) == 1


def test_killed_reply_reads_back_as_interrupted(tmp_path) -> None:
    store = ChatStore(tmp_path / "chats.db")
    c = store.create_chat("c")
    store.add_message(c.id, "assistant", "part", status="streaming")
    store.close()
    assert [m.status for m in ChatStore(tmp_path / "chats.db").messages(c.id)] == ["interrupted"]


def test_damaged_message_stats_read_back_as_none(tmp_path) -> None:
    store = ChatStore(tmp_path / "chats.db")
    chat = store.create_chat("c")
    ok = store.add_message(chat.id, "assistant", "a", stats={"completion_tokens": 3})
    for i, text in enumerate(["{not json", "[1, 2]", '"text"']):
        m = store.add_message(chat.id, "assistant", f"b{i}")
        store.conn.execute("UPDATE messages SET stats=? WHERE id=?", (text, m.id))
    assert [m.stats for m in store.messages(chat.id)] == [{"completion_tokens": 3}, {}, {}, {}]
    assert store.messages(chat.id)[0].id == ok.id


def test_stats_bar_from_a_saved_reply_keeps_only_sound_numbers() -> None:
    saved = {"prompt_tokens": 31, "completion_tokens": 8, "cached_prompt_tokens": 16, "ttft_s": 1.25,
             "decode_tps": 5.0, "acceptance_rate": 0.5, "mean_accepted_tokens": 1.5, "target_forwards": 6}
    s = LiveStats.from_saved(saved)
    assert s.to_saved() == saved  # the round trip the chat store makes
    assert s.render_line().splitlines()[0] == ("5.0 tok/s │ TTFT 1.25 s │ prompt 31 (16 cached) · reply 8 │ ctx 39/0"
                                                " │ drafted (tinted) 50% accepted · 1.5 per verify · 6 forwards")
    bad = LiveStats.from_saved({"prompt_tokens": "31", "completion_tokens": -2, "ttft_s": float("nan"),
                                "decode_tps": True, "acceptance_rate": None})
    assert bad == LiveStats()


def test_chip_table_covers_m1_to_m5_and_datacenter_gpus() -> None:
    table = {c.name: c for c in load_chips()}
    for family in ("M1", "M2", "M3", "M4"):
        for tier in ("", " Pro", " Max", " Ultra") if family != "M4" else ("", " Pro", " Max"):
            assert f"Apple {family}{tier}" in table
    assert table["Apple M5"].gbs == 153
    assert {"NVIDIA H100 SXM", "NVIDIA H200", "NVIDIA B200"} <= set(table)
    assert all(c.source for c in table.values())


def test_lookup_picks_the_bandwidth_bin_by_performance_cores() -> None:
    assert lookup("Apple M1", None).bytes_per_s == 68.25e9
    assert lookup("Apple M3 Max", 10).bytes_per_s == 300e9
    assert lookup("Apple M3 Max", 12).bytes_per_s == 400e9
    assert lookup("Apple M4 Max", 10).bytes_per_s == 410e9
    assert lookup("Apple  M4 Pro", 10).bytes_per_s == 273e9  # whitespace-tolerant
    assert lookup("Apple M5 Max", 12) is None  # unknown: never guessed from "Apple M5"
    assert lookup("NVIDIA H100 SXM", None) is None  # comparison rows are not a host


def test_unknown_machine_measures_the_best_of_many_copies_and_rechecks_it(tmp_path, monkeypatch) -> None:
    """The roofline's bandwidth is the best of FULL_RUNS copies with their spread, cached; each later start checks
    it with CHECK_RUNS copies, and a check reading above it (the cache was measured under load) measures again.
    A check below it (the machine is busy now) keeps the cached peak."""
    monkeypatch.setattr(chips, "detect_chip", lambda: None)
    calls = []
    readings = {chips.FULL_RUNS: [9e9, 14e9, 17e9, 12e9, 22e9] + [16e9] * (chips.FULL_RUNS - 5)}

    def measure(runs: int) -> list[float]:
        calls.append(runs)
        return readings[runs]

    bw = machine_bandwidth(tmp_path, measure)
    assert (bw.bytes_per_s, bw.median_bytes_per_s, bw.low_bytes_per_s, bw.runs) == (22e9, 16e9, 9e9, chips.FULL_RUNS)
    assert bw.measured and bw.describe() == f"22 GB/s {bw.label} (measured, 15 runs 9-22)"
    assert "median 16.0, low 9.0 GB/s" in bw.detail()
    assert json.loads((tmp_path / "bandwidth.json").read_text())["bytes_per_s"] == 22e9
    readings[chips.CHECK_RUNS] = [10e9, 12e9, 11e9]  # busy now: the cached peak stands, nothing re-measured
    assert machine_bandwidth(tmp_path, measure) == bw and calls == [chips.FULL_RUNS, chips.CHECK_RUNS]
    readings[chips.CHECK_RUNS] = [20e9, 26e9, 21e9]  # above the cached figure by more than DISAGREE
    readings[chips.FULL_RUNS] = [24e9] * chips.FULL_RUNS
    again = machine_bandwidth(tmp_path, measure)
    assert again.bytes_per_s == 24e9 and calls[-2:] == [chips.CHECK_RUNS, chips.FULL_RUNS]
    (tmp_path / "bandwidth.json").write_text(json.dumps({"label": bw.label, "bytes_per_s": 9e9}))  # one old copy
    assert machine_bandwidth(tmp_path, measure).bytes_per_s == 24e9 and calls[-1] == chips.FULL_RUNS


def test_known_mac_uses_the_table(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(chips, "detect_chip", lambda: ("Apple M4 Max", 12))
    bw = machine_bandwidth(tmp_path, lambda: pytest.fail("must not measure"))
    assert bw == Bandwidth("Apple M4 Max", 546e9, measured=False) and bw.describe() == "546 GB/s Apple M4 Max"


def test_token_buffer_wakes_once_per_drain() -> None:
    buf = TokenBuffer()
    wakes = [buf.push(GenerationEvent(text=f"t{i} ", token_ids=(i,))) for i in range(100)]
    assert wakes == [True] + [False] * 99
    d = buf.drain()
    assert d.num_tokens == 100 and d.text.startswith("t0 t1 ") and d.final is None
    assert buf.push(GenerationEvent(finish_reason="stop", usage=Usage(3, 100))) is True
    assert buf.drain().final.finish_reason == "stop" and buf.total_tokens == 100


def test_token_buffer_is_thread_safe() -> None:
    buf = TokenBuffer()

    def producer() -> None:
        for i in range(5000):
            buf.push(GenerationEvent(text="x", token_ids=(i,)))

    t = threading.Thread(target=producer)
    t.start()
    seen = 0
    while t.is_alive():
        seen += len(buf.drain().text)
    t.join()
    seen += len(buf.drain().text)
    assert seen == 5000 and buf.total_tokens == 5000


def test_roofline_fraction_is_bytes_times_rate_over_bandwidth() -> None:
    s = LiveStats(decode_tps=50.0, bytes_per_token=100 * 2**20, bandwidth_bytes_per_s=100e9)
    assert s.roofline_fraction == pytest.approx(100 * 2**20 * 50 / 100e9)
    assert LiveStats(decode_tps=50.0).roofline_fraction is None
    line = LiveStats(decode_tps=5.0, ttft_s=1.25, prompt_tokens=31, reply_tokens=8, context_length=8192,
                     weight_bytes=94 * 2**20, kv_bytes=2**20, bytes_per_token=95 * 2**20,
                     bandwidth_bytes_per_s=68.25e9, bandwidth_label="68 GB/s Apple M1").render_line()
    assert line.splitlines() == [
        "5.0 tok/s │ TTFT 1.25 s │ prompt 31 · reply 8 │ ctx 39/8,192",
        "model 94.0 MiB · KV 1.0 MiB │ 0.7% of roofline · 68 GB/s Apple M1"]


def test_importing_the_app_loads_no_mlx() -> None:
    probe = ("import app.tui, app.tui.app, app.cli, sys; "
             "print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    mods = set(r.stdout.split())
    assert "textual" in mods and not {"mlx", "mlx_lm", "torch", "kernels_metal"} & mods


def _segments(text: str, min_chars: int, chunk: int) -> tuple[list[str], list[int]]:
    from app.tui.segments import MarkdownSegmenter

    seg = MarkdownSegmenter(min_chars)
    out: list[str] = []
    for i in range(0, len(text), chunk):
        for new, piece in seg.feed(text[i:i + chunk]):
            if new or not out:
                out.append("")
            out[-1] += piece
    return out, seg.cuts


@pytest.mark.parametrize("chunk", [1, 3, 17, 10_000])
def test_segmenter_cuts_only_where_separate_documents_render_alike(chunk) -> None:
    from app.tui.segments import cuts_render_alike

    segments, cuts = _segments(SEGMENTED_REPLY, 1, chunk)
    assert "".join(segments) == SEGMENTED_REPLY
    assert cuts == [len("".join(segments[:i])) for i in range(1, len(segments))]
    starts = [s.split("\n", 1)[0] for s in segments[1:]]
    # before paragraphs, lists and tables only; never before a heading, a fence, a quote, or inside a list/fence
    assert starts == ["First paragraph under the heading, long enough to pass the threshold.", "- one", "1. first",
                      "Closing paragraph after the list.", "| a | b |", "Final words."]
    assert cuts_render_alike(SEGMENTED_REPLY, cuts)
    assert _segments(SEGMENTED_REPLY, 10_000, chunk)[1] == []  # below the threshold: one segment


def test_segmenter_never_cuts_inside_a_fence() -> None:
    text = "Intro.\n\n```\ncode\n\nnot a paragraph\n\n- nor a list\n```\n\nAfter."
    segments, _ = _segments(text, 1, 1)
    # not before the fence (it has a top margin), not inside it: after it
    assert segments == ["Intro.\n\n```\ncode\n\nnot a paragraph\n\n- nor a list\n```\n\n", "After."]


def test_cuts_the_streaming_rule_cannot_see_are_caught_at_the_end() -> None:
    from app.tui.segments import cuts_render_alike

    setext = "Para.\n\nTitle\n=====\n"
    assert _segments(setext, 1, 1)[1] == [7]  # cut before "Title": it turns out to be a heading (top margin)
    assert not cuts_render_alike(setext, [7])
    refs = "See [the docs][d].\n\nMore.\n\n[d]: https://example.com\n"
    assert not cuts_render_alike(refs, _segments(refs, 1, 1)[1])  # link definitions apply to the whole reply
    assert cuts_render_alike("One.\n\nTwo.\n", [6])


def test_engine_backend_loads_every_model_with_the_cli_load_options(tmp_path) -> None:
    """`roofline chat --kv-bits 8 --block-size 32`: the app's engine backend passes them to every Engine.load."""
    from app.cli import _load_options, _parser
    from app.tui.backend import EngineBackend
    from tests.support.tiny_models import random_llama_folder

    args = _parser().parse_args(["chat", "--kv-bits", "8", "--block-size", "32"])
    assert _load_options(args) == {"kv_bits": 8, "block_size": 32}
    assert _load_options(_parser().parse_args(["chat"])) == {}
    for command in (["serve"], ["generate", "-p", "hi"]):  # the server and one-shot replies take the same options
        assert _load_options(_parser().parse_args([*command, "--kv-bits", "4", "--block-size", "32"])) == \
            {"kv_bits": 4, "block_size": 32}
    folder = random_llama_folder(tmp_path / "m", head_dim=64, hidden=128)
    engine = EngineBackend(**_load_options(args)).load(str(folder))
    with engine:
        stats = engine.kv_stats()
        assert (stats["kv_bits"], stats["block_size"]) == (8, 32)
