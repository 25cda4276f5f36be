"""Responsiveness of the chat app while a reply streams fast: the fake engine streams N tokens at R tokens/s
into the real app (headless Textual, real rendering), while a key is typed every 50 ms.

Reports, for per-frame batching (the app's default) and for one Markdown append per token (the naive way):
  - keystroke latency: key event posted -> the input's text changed (median, p95, max), idle vs streaming
  - the app's CPU time per streamed token: process CPU while streaming, minus the fake engine's own CPU
    (measured by draining the same stream without the app), over N
  - Markdown appends and wall time to show the whole reply
  - the app's CPU per append against the reply's length, paced (a fixed chunk of text per 1/30 s frame, so a
    slow app cannot batch more tokens per append): median over the first and the last tenth of the reply

A long reply streams into several Markdown widgets (segments of about --segment-chars characters, cut at block
boundaries; see app/tui/segments.py) so that an append lays out only the last one; --segment-chars 0 streams
into a single Markdown widget, as the app did before.

    uv run python bench/tui.py                       # 3,000 tokens at 1,000 tokens/s
    uv run python bench/tui.py --tokens 5000 --rate 2000 --json
    uv run python bench/tui.py --segment-chars 0     # one Markdown widget per reply
    uv run python bench/tui.py --drafted             # 3 of 4 tokens from a speculative draft (coloured)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from textual import events  # noqa: E402
from textual.widgets import Markdown, TextArea  # noqa: E402

from app.tui.app import RooflineApp  # noqa: E402
from app.tui.store import ChatSettings  # noqa: E402
from app.tui.widgets.messages import MessageView  # noqa: E402
from mlx_engine.api import GenerationRequest, SamplingParams  # noqa: E402
from tests.support.tui_fake_engine import FakeBackend, FakeEngine, FakeReply, FakeTokenizer  # noqa: E402

KEY_INTERVAL_S = 0.05


def reply_text(num_tokens: int) -> str:
    """Markdown with paragraphs, lists and code fences; one FakeTokenizer token per word/punctuation mark."""
    blocks, n = [], 0
    i = 0
    while n < num_tokens:
        kind = i % 3
        if kind == 0:
            words = " ".join(f"word{j}" for j in range(40))
            blocks.append(f"Paragraph {i}: {words}.")
            n += 43
        elif kind == 1:
            blocks.append("\n".join(f"- item {j} of list {i}" for j in range(5)))
            n += 5 * 8
        else:
            blocks.append("```python\n" + "\n".join(f"x{j} = {j} * {i}" for j in range(6)) + "\n```")
            n += 6 * 6 + 6
        i += 1
    return "\n\n".join(blocks)


def drafted_pattern(text: str, drafted: bool) -> tuple[bool, ...]:
    """Per token of `text`: from the draft (3 of every 4 with `drafted`, as with good prompt lookup), or not."""
    return tuple(i % 4 != 0 for i in range(len(FakeTokenizer().pieces(text)))) if drafted else ()


def drafted_marks(text: str, pattern: tuple[bool, ...]) -> list[int]:
    """[start, end, ...) character ranges of `text` whose tokens are drafted in `pattern`."""
    marks: list[int] = []
    at = 0
    for piece, d in zip(FakeTokenizer().pieces(text), pattern):
        if d:
            if marks and marks[-1] == at:
                marks[-1] += len(piece)
            else:
                marks += (at, at + len(piece))
        at += len(piece)
    return marks


class BenchApp(RooflineApp):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.changed_at: list[float] = []
        self.appends = 0

    def on_text_area_changed(self, event: TextArea.Changed) -> None:
        self.changed_at.append(time.perf_counter())


def count_appends(app: BenchApp) -> None:
    original = MessageView.write

    async def write(self: MessageView, fragment: str, *args, **kwargs) -> None:
        if fragment:
            app.appends += 1
        await original(self, fragment, *args, **kwargs)

    MessageView.write = write  # type: ignore[method-assign]


async def type_keys(app: BenchApp, until: asyncio.Event, max_keys: int) -> list[float]:
    posted: list[float] = []
    while not until.is_set() and len(posted) < max_keys:
        posted.append(time.perf_counter())
        app.post_message(events.Key("a", "a"))
        await asyncio.sleep(KEY_INTERVAL_S)
    return posted


def latencies(posted: list[float], seen: list[float]) -> list[float]:
    return [(s - p) * 1000 for p, s in zip(posted, seen)]


def summary(ms: list[float]) -> dict[str, float]:
    if not ms:
        return {"n": 0}
    q = sorted(ms)
    return {"n": len(q), "median_ms": statistics.median(q), "p95_ms": q[min(len(q) - 1, int(0.95 * len(q)))],
            "max_ms": q[-1]}


async def run_case(text: str, num_tokens: int, rate: float, coalesce: bool, drafted: bool = False) -> dict:
    backend = FakeBackend(script=[FakeReply(text, drafted=drafted_pattern(text, drafted))], tokens_per_s=rate)
    app = BenchApp(backend=backend, home=tempfile.mkdtemp(prefix="roofline-bench-"),
                   default_settings=ChatSettings(temperature=0.0, max_tokens=num_tokens + 10),
                   frame_s=1 / 30 if coalesce else 0.0, coalesce_tokens=coalesce)
    count_appends(app)
    async with app.run_test(size=(100, 30)) as pilot:
        while app.engine is None:
            await pilot.pause(0.01)
        prompt = app.chat_screen.query_one("#prompt")
        prompt.focus()
        await pilot.pause(0.1)
        # idle latency: 20 keys with nothing streaming
        done = asyncio.Event()
        app.changed_at.clear()
        idle_posted = await type_keys(app, done, 20)
        await pilot.pause(0.2)
        idle_ms = latencies(idle_posted, app.changed_at)
        prompt.text = "go"
        app.changed_at.clear()
        t0, cpu0 = time.perf_counter(), time.process_time()
        app.post_message(events.Key("enter", None))
        keys = asyncio.create_task(type_keys(app, done, 10_000))
        while app.chat_screen.gen is None:
            await asyncio.sleep(0.001)
        while app.chat_screen.gen is not None:
            await asyncio.sleep(0.005)
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        done.set()
        posted = await keys
        await pilot.pause(0.3)
        stream_ms = latencies(posted, app.changed_at[1:])  # [0] is the input being cleared on send
        reply = app.chat_screen.query(MessageView).last()
        assert reply.content == text, "the reply on screen differs from the script"
        return {"coalesce": coalesce, "wall_s": wall, "cpu_s": cpu, "appends": app.appends,
                "markdown_widgets": len(reply.query_children(Markdown)),
                "keys_idle": summary(idle_ms), "keys_streaming": summary(stream_ms)}


async def paced_appends(text: str, chunk_chars: int = 150, frame_s: float = 1 / 30, drafted: bool = False
                        ) -> list[float]:
    """CPU seconds per append when `text` is written `chunk_chars` at a time, one append per frame, into a
    reply in the real chat screen (layout and rendering included)."""
    app = BenchApp(backend=FakeBackend(script=["x"]), home=tempfile.mkdtemp(prefix="roofline-bench-"))
    cpu: list[float] = []
    marks = drafted_marks(text, drafted_pattern(text, drafted))
    async with app.run_test(size=(100, 30)) as pilot:
        while app.engine is None:
            await pilot.pause(0.01)
        transcript = app.chat_screen.query_one("#transcript")
        await transcript.remove_children()
        view = MessageView("assistant", "", None, status="streaming")
        await transcript.mount(view)
        transcript.anchor()
        await pilot.pause(0.1)
        for i in range(0, len(text), chunk_chars):
            piece = text[i:i + chunk_chars]
            cut = [max(0, min(m - i, len(piece))) for m in marks]  # the drafted ranges within this piece
            cut = [x for a, b in zip(cut[::2], cut[1::2]) if a < b for x in (a, b)]
            c0 = time.process_time()
            await view.write(piece, cut)
            await asyncio.sleep(frame_s)  # not pilot.pause(): it messages every widget on the screen
            cpu.append(time.process_time() - c0)
        await view.finish("done")
    return cpu


def tenths(cpu: list[float]) -> dict[str, float]:
    k = max(1, len(cpu) // 10)
    return {"appends": len(cpu), "first_tenth_ms": statistics.median(cpu[:k]) * 1000,
            "last_tenth_ms": statistics.median(cpu[-k:]) * 1000}


def engine_cpu(text: str, rate: float, drafted: bool = False) -> tuple[float, int]:
    """CPU seconds the fake engine itself spends streaming `text` (no app), and its token count."""
    engine = FakeEngine([FakeReply(text, drafted=drafted_pattern(text, drafted))], tokens_per_s=rate)
    cpu0 = time.process_time()
    n = sum(len(e.token_ids) for e in engine.generate(
        GenerationRequest(messages=[{"role": "user", "content": "go"}],
                          sampling=SamplingParams(max_tokens=10**6, speculative="auto" if drafted else None))))
    return time.process_time() - cpu0, n


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import textual

    return f"{cpu}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}, Python {platform.python_version()}, textual {textual.__version__}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=3000)
    p.add_argument("--rate", type=float, default=1000.0, help="fake engine tokens/s")
    p.add_argument("--segment-chars", type=int, default=MessageView.segment_chars,
                   help="characters per Markdown widget of a streamed reply (0: one widget per reply)")
    p.add_argument("--drafted", action="store_true",
                   help="3 of every 4 tokens come from a speculative draft (their text is coloured)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    MessageView.segment_chars = args.segment_chars or 10**12
    text = reply_text(args.tokens)
    base_cpu, n = engine_cpu(text, args.rate, args.drafted)
    results = [asyncio.run(run_case(text, n, args.rate, coalesce, args.drafted)) for coalesce in (True, False)]
    for r in results:
        r["tokens"] = n
        r["app_cpu_per_token_us"] = (r["cpu_s"] - base_cpu) / n * 1e6
        r["tokens_per_append"] = n / max(r["appends"], 1)
    paced = tenths(asyncio.run(paced_appends(text, drafted=args.drafted)))
    out = {"command": "uv run python bench/tui.py " + " ".join(sys.argv[1:]), "machine": machine(),
           "date": time.strftime("%Y-%m-%d"), "rate_tokens_per_s": args.rate, "tokens": n,
           "segment_chars": args.segment_chars, "drafted": args.drafted, "engine_cpu_s": base_cpu, "results": results,
           "paced_append_cpu": paced}
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"{out['command']}\n{out['machine']}, {out['date']}")
    print(f"{n} tokens at {args.rate:.0f} tokens/s; the fake engine alone uses {base_cpu:.2f} s CPU\n")
    print(f"{'mode':<22}{'wall s':>8}{'appends':>9}{'tok/append':>11}{'app CPU/token':>15}"
          f"{'key idle p50/max':>19}{'key stream p50/p95/max':>26}")
    for r in results:
        ki, ks = r["keys_idle"], r["keys_streaming"]
        mode = "batched per frame" if r["coalesce"] else "append per token"
        print(f"{mode:<22}{r['wall_s']:>8.2f}{r['appends']:>9}{r['tokens_per_append']:>11.1f}"
              f"{r['app_cpu_per_token_us']:>12.0f} µs"
              f"{ki['median_ms']:>10.1f}/{ki['max_ms']:.1f} ms"
              f"{ks['median_ms']:>11.1f}/{ks['p95_ms']:.1f}/{ks['max_ms']:.1f} ms")
    print(f"\npaced, 150 characters per 1/30 s frame ({paced['appends']} appends): app CPU per append "
          f"{paced['first_tenth_ms']:.1f} ms over the first tenth of the reply, "
          f"{paced['last_tenth_ms']:.1f} ms over the last (segments of {args.segment_chars or 'unlimited'} characters)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
