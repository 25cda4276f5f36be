"""Running one reply: the generation worker, the per-frame hand-off of its tokens into the transcript, live
stats, and the end of the reply (saved, its KV persisted). `ReplyRunner` is mixed into the chat screen."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from textual import work
from textual.containers import VerticalScroll
from textual.message import Message

from mlx_engine.api import EngineLike, GenerationRequest, RooflineError

from app.tui.screens.settings import sampling_params
from app.tui.streaming import TokenBuffer
from app.tui.widgets.messages import MessageView
from app.tui.widgets.stats import LiveStats

if TYPE_CHECKING:
    from app.tui.app import RooflineApp
    from app.tui.store import Chat

SAVE_PARTIAL_EVERY_S = 1.0
FINISH_STATUS = {"stop": "done", "length": "length", "cancelled": "stopped", "error": "error"}
KV_SAVED_STATUSES = ("done", "stopped", "length")


def model_messages(system_prompt: str, turns: Iterable[tuple[str, str, str]]) -> list[dict[str, str]]:
    """The chat as the model sees it: the system prompt, then every (role, content, status) turn but failed
    or empty replies. A reply's reasoning is never among them: chat templates drop earlier turns' thinking."""
    msgs: list[dict[str, str]] = []
    if system_prompt.strip():
        msgs.append({"role": "system", "content": system_prompt})
    for role, content, status in turns:
        if role == "assistant" and (status == "error" or not content):
            continue
        msgs.append({"role": role, "content": content})
    return msgs


def reasoning_figures(gen: Generation, final: Any = None) -> dict[str, Any]:
    """What the store keeps of a reply's thinking beside its text: its tokens (the final usage's where there is one)
    and seconds; nothing for a reply without thinking."""
    buffer = gen.buffer
    if not gen.view.reasoning:
        return {}
    usage = final.usage if final is not None else None
    tokens = usage.reasoning_tokens if usage is not None else buffer.reasoning_tokens
    return {"reasoning_tokens": tokens, "reasoning_s": round(buffer.reasoning_s, 3)}


def no_tokenizer_notice(name: str) -> str:
    """What the app says of a model without tokenizer files (the engine's own message is for API callers)."""
    return (f"{name} came without a tokenizer (no tokenizer.json or tokenizer.model beside its weights), so it "
            "cannot read or write text and cannot chat. Pick a model with its tokenizer files: ctrl+l.")


@dataclass
class Generation:
    """One reply in flight."""

    chat_id: int
    message_id: int
    view: MessageView
    engine: EngineLike
    buffer: TokenBuffer = field(default_factory=TokenBuffer)
    stream: Any = None
    cancel_requested: bool = False
    prompt_tokens: int = 0
    started_at: float = field(default_factory=time.perf_counter)
    last_saved: float = field(default_factory=time.perf_counter)
    last_drain: float = 0.0
    drain_timer: Any = None
    finished: bool = False
    offer: Any = None  # tool_runner.Offer: the MCP tools offered, and the reply read back through the tool format

    def cancel(self) -> None:
        self.cancel_requested = True
        if self.stream is not None:
            self.stream.cancel()


class ReplyTokens(Message):
    """The generation worker pushed tokens into an empty buffer."""

    def __init__(self, gen: Generation) -> None:
        super().__init__()
        self.gen = gen


class ReplyFailed(Message):
    """The request was refused before streaming (RequestError) or the engine raised."""

    def __init__(self, gen: Generation, error: str) -> None:
        super().__init__()
        self.gen = gen
        self.error = error


class ReplyRunner:
    """The chat screen's reply logic (a mixin on a Screen: it posts messages to itself and runs workers)."""

    chat: Chat | None
    gen: Generation | None
    stats: LiveStats

    @property
    def rapp(self) -> RooflineApp:
        return self.app  # type: ignore[attr-defined]

    async def start_reply(self) -> None:
        assert self.chat is not None
        engine = self.rapp.engine
        if engine is None:
            self.notify("No model is loaded: ctrl+l picks one.", severity="error")  # type: ignore[attr-defined]
            return
        if not engine.info.has_tokenizer:  # said at load; nothing is saved into the chat
            self.notify(no_tokenizer_notice(engine.info.name), severity="error")  # type: ignore[attr-defined]
            return
        messages = self.history()  # type: ignore[attr-defined]
        # a model without reasoning is sent no effort: the chat may keep one from a model that had it
        effort = self.chat.settings.reasoning_effort if engine.info.reasoning is not None else None
        try:
            request = GenerationRequest(messages=messages, sampling=sampling_params(self.chat.settings),
                                        reasoning_effort=effort)
        except RooflineError as e:
            self.notify(f"Chat settings: {e}", severity="error")  # type: ignore[attr-defined]
            return
        offer = self.tool_offer(engine)  # type: ignore[attr-defined]
        if offer is not None:
            request = offer.request(request)
        row = self.rapp.store.add_message(self.chat.id, "assistant", "", status="streaming")
        view = MessageView("assistant", "", row.id, status="streaming")
        transcript = self.query_one("#transcript", VerticalScroll)  # type: ignore[attr-defined]
        await transcript.mount(view)
        transcript.anchor()
        self.gen = Generation(self.chat.id, row.id, view, engine, offer=offer)
        self.refresh_bindings()  # type: ignore[attr-defined]
        self.stats = LiveStats(streaming=True, model=engine.info.name)
        self.show_stats()  # type: ignore[attr-defined]
        self.run_generation(self.gen, request)

    @work(thread=True, exclusive=True, group="generate")
    def run_generation(self, gen: Generation, request: GenerationRequest) -> None:
        post = self.post_message  # type: ignore[attr-defined]
        try:
            variables = request.chat_template_kwargs or {}  # the tools, for a template that renders them
            gen.prompt_tokens = len(gen.engine.tokenizer.encode_chat(request.messages, **variables))
            gen.stream = gen.engine.generate(request)
        except RooflineError as e:
            post(ReplyFailed(gen, str(e)))
            return
        except Exception as e:  # noqa: BLE001 - an engine bug is shown in the message, never crashes the app
            post(ReplyFailed(gen, f"{type(e).__name__}: {e}"))
            return
        if gen.cancel_requested:
            gen.stream.cancel()
        coalesce = self.rapp.coalesce_tokens
        try:
            for event in gen.stream:
                if gen.buffer.push(event) or not coalesce:
                    post(ReplyTokens(gen))
        except Exception as e:  # noqa: BLE001
            post(ReplyFailed(gen, f"{type(e).__name__}: {e}"))

    async def on_reply_tokens(self, message: ReplyTokens) -> None:
        gen = message.gen
        if gen.drain_timer is not None or gen.finished:
            return
        wait = gen.last_drain + self.rapp.frame_s - time.perf_counter()
        if wait > 0:  # at most one Markdown append per frame
            gen.drain_timer = self.set_timer(wait, lambda: self.drain(gen))  # type: ignore[attr-defined]
            return
        await self.drain(gen)

    async def drain(self, gen: Generation) -> None:
        gen.drain_timer = None
        if gen.finished:
            return
        gen.last_drain = time.perf_counter()
        d = gen.buffer.drain()
        await self.show_reasoning(gen, d.reasoning)
        if gen.offer is not None:  # a call's JSON is not shown; the reply's text is
            d.text, d.drafted = gen.offer.feed(d.text), []
        if d.text and gen.view.is_attached:
            await gen.view.write(d.text, d.drafted)
        elif d.text:
            gen.view.content += d.text
        if d.final is not None:
            await self.finish(gen, d.final.finish_reason, d.final.error, d.final)
            return
        self.update_live_stats(gen)
        now = time.perf_counter()
        if now - gen.last_saved >= SAVE_PARTIAL_EVERY_S:
            gen.last_saved = now
            self.rapp.store.update_message(gen.message_id, gen.view.content, "streaming", reasoning_figures(gen),
                                           reasoning=gen.view.reasoning)

    async def show_reasoning(self, gen: Generation, fragment: str) -> None:
        """New thinking into the reply's thought block, and its figures while it streams (tags give no text)."""
        view, buffer = gen.view, gen.buffer
        if not fragment and (view.thought is None or not view.thought.streaming):
            return
        if not view.is_attached:
            view.reasoning += fragment
            return
        new = view.thought is None
        await view.write_reasoning(fragment, buffer.reasoning_tokens, buffer.reasoning_s,
                                   done=buffer.reasoning_ended_at is not None)
        if new:
            self.refresh_bindings()  # type: ignore[attr-defined]  # the key that expands it applies now

    def update_live_stats(self, gen: Generation) -> None:
        n = gen.buffer.total_tokens
        first = gen.buffer.first_token_at
        s = self.stats
        s.streaming = True
        s.prompt_tokens = gen.prompt_tokens
        s.reply_tokens = n
        s.reasoning_tokens = gen.buffer.reasoning_tokens
        if first is not None:
            s.ttft_s = first - gen.started_at
            elapsed = time.perf_counter() - first
            if n > 1 and elapsed > 0:
                s.decode_tps = (n - 1) / elapsed
        self.fill_bytes(gen.engine, s)
        self.show_stats()  # type: ignore[attr-defined]

    def fill_bytes(self, engine: EngineLike, s: LiveStats) -> None:
        ctx = s.prompt_tokens + s.reply_tokens
        try:
            s.bytes_per_token = engine.decode_bytes_per_token(ctx)
            s.kv_bytes = s.bytes_per_token - engine.decode_bytes_per_token(0)
        except Exception:  # noqa: BLE001 - a closed engine: keep the last figures
            pass

    async def on_reply_failed(self, message: ReplyFailed) -> None:
        await self.finish(message.gen, "error", message.error, None)

    async def finish(self, gen: Generation, reason: str | None, error: str | None, final: Any) -> None:
        if gen.finished:
            return
        gen.finished = True
        if gen.drain_timer is not None:
            gen.drain_timer.stop()
        rest = gen.buffer.drain()
        await self.show_reasoning(gen, rest.reasoning)
        if gen.offer is not None:
            rest.text, rest.drafted = gen.offer.feed(rest.text) + gen.offer.finish(), []
        if rest.text and gen.view.is_attached:
            await gen.view.write(rest.text, rest.drafted)
        elif rest.text:
            gen.view.content += rest.text
        status = FINISH_STATUS.get(reason or "error", "error")
        calls = gen.offer.calls() if gen.offer is not None and status == "done" else []
        stats: dict[str, Any] = {}
        if error:
            stats["error"] = error
        if final is not None and final.usage is not None and final.stats is not None:
            u, st = final.usage, final.stats
            s = self.stats
            s.prompt_tokens, s.reply_tokens, s.cached_tokens = u.prompt_tokens, u.completion_tokens, u.cached_prompt_tokens
            s.ttft_s, s.decode_tps = st.ttft_s, st.decode_tps
            s.acceptance_rate, s.mean_accepted_tokens = st.acceptance_rate, st.mean_accepted_tokens
            s.target_forwards = st.target_forwards
            s.reasoning_tokens = u.reasoning_tokens
            stats.update(s.to_saved())
            self.fill_bytes(gen.engine, s)
        stats.update(reasoning_figures(gen, final))
        self.stats.streaming = False
        store = self.rapp.store
        store.update_message(gen.message_id, gen.view.content, status, stats, reasoning=gen.view.reasoning)
        store.touch(gen.chat_id)
        if status in KV_SAVED_STATUSES:
            self.save_kv(gen)
        if gen.view.is_attached:
            await gen.view.finish(status, error, stats.get("reasoning_tokens"), stats.get("reasoning_s"))
            # a reply that only called tools: the calls below say it all (its thinking, if any, stays)
            gen.view.display = not (calls and not gen.view.content and not gen.view.reasoning)
        if self.gen is gen:
            self.gen = None
            self.refresh_bindings()  # type: ignore[attr-defined]
        self.show_stats()  # type: ignore[attr-defined]
        if error:
            self.notify(error, title="Reply failed", severity="error", timeout=6)  # type: ignore[attr-defined]
        if calls and self.chat is not None and self.chat.id == gen.chat_id:
            self.run_tool_calls(gen.chat_id, calls)  # type: ignore[attr-defined]

    def save_kv(self, gen: Generation) -> None:
        """Persists the conversation's KV, reply included, from the store (the chat may no longer be on screen)."""
        store = self.rapp.store
        chat = store.get_chat(gen.chat_id)
        if chat is None:
            return
        turns = [(m.role, m.content, m.status) for m in store.messages(gen.chat_id)]
        self.rapp.chat_kv.save(gen.engine, gen.chat_id, model_messages(chat.settings.system_prompt, turns))
