"""Engine streams on the event loop: each generation is iterated by its own thread (iterating blocks) and its
events are handed to the loop; admission is a FIFO gate of N running requests and a bounded wait queue."""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

from mlx_engine.api import GenerationEvent, Usage

from app.server.errors import APIError


class Generation:
    """One engine stream, pumped into an asyncio queue. `on_done(self, final_event)` runs on the loop once the
    engine has finished with the request (completed, failed or cancelled), never before."""

    def __init__(self, stream: Any, prompt_tokens: int, on_done: Callable[[Generation, GenerationEvent], None]):
        self._stream = stream
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[GenerationEvent] = asyncio.Queue()
        self._on_done = on_done
        self.prompt_tokens = prompt_tokens
        self.finished = False  # the engine is done with it (set on the loop)
        self.started = False  # the engine sent its first event (set by the pump thread)
        self.num_draft_accepted = 0  # tokens that came from an accepted draft (set by the pump thread)
        self._pump_thread = threading.Thread(target=self._pump, name="roofline-serve-stream", daemon=True)
        self._pump_thread.start()

    def _post(self, fn: Callable[..., None], *args: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: the server is gone, and so is the reader
            pass

    def _pump(self) -> None:
        final: GenerationEvent | None = None
        try:
            for event in self._stream:
                if event.finish_reason is not None:
                    final = event
                    break
                self.started = True
                self.num_draft_accepted += sum(event.from_draft)
                self._post(self._queue.put_nowait, event)
            else:
                final = GenerationEvent(finish_reason="error", error="the engine stream ended without a final event",
                                        usage=Usage(self.prompt_tokens, 0, 0))
        except Exception as e:  # noqa: BLE001 - the engine failed this request: it ends in error, others go on
            final = GenerationEvent(finish_reason="error", error=f"{type(e).__name__}: {e}",
                                    usage=Usage(self.prompt_tokens, 0, 0))
            self._stream.cancel()
        self._post(self._finish, final)

    def _finish(self, final: GenerationEvent) -> None:
        self.finished = True
        self._queue.put_nowait(final)
        self._on_done(self, final)

    def cancel(self) -> None:
        """Stops the generation (a no-op once it finished). Thread-safe, idempotent."""
        if not self.finished:
            self._stream.cancel()

    async def events(self) -> AsyncIterator[GenerationEvent]:
        """Events up to and including the final one."""
        while True:
            event = await self._queue.get()
            yield event
            if event.finish_reason is not None:
                return


class AdmissionGate:
    """At most `max_running` requests hold a slot; up to `max_waiting` more wait for one, in arrival order;
    beyond that a request is refused at once with 429. `max_running=None`: no limit."""

    def __init__(self, max_running: int | None, max_waiting: int):
        self.max_running = max_running
        self.max_waiting = max_waiting
        self.running = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def waiting(self) -> int:
        return sum(1 for f in self._waiters if not f.done())

    async def acquire(self) -> None:
        if self.max_running is None or (self.running < self.max_running and not self.waiting):
            self.running += 1
            return
        if self.waiting >= self.max_waiting:
            raise APIError(429, f"the server is at capacity ({self.running} requests running, {self.waiting} "
                           "waiting); retry shortly", None, "rate_limit_exceeded", headers={"Retry-After": "1"})
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await fut  # release() hands its slot over: `running` is unchanged
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()  # the slot arrived as we were cancelled: pass it on
            else:
                fut.cancel()
            raise
        finally:
            try:
                self._waiters.remove(fut)
            except ValueError:
                pass

    def fail_waiting(self, error: BaseException) -> None:
        """Every request still waiting for a slot fails with `error` (the server is shutting down)."""
        for fut in self._waiters:
            if not fut.done():
                fut.set_exception(error)

    def release(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return
        self.running -= 1


class DisconnectWatch:
    """Reads the request's ASGI channel for `http.disconnect` (the body was read already) and runs the
    registered callbacks when the client goes away. Use as `async with`; stop it before a streaming
    response takes over the channel."""

    def __init__(self, receive: Callable[[], Any]):
        self._receive = receive
        self.gone = False
        self._callbacks: list[Callable[[], Any]] = []
        self._task: asyncio.Task[None] | None = None

    def on_gone(self, fn: Callable[[], Any]) -> None:
        if self.gone:
            fn()
        else:
            self._callbacks.append(fn)

    async def _watch(self) -> None:
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                self.gone = True
                for fn in self._callbacks:
                    fn()
                return

    async def __aenter__(self) -> DisconnectWatch:
        self._task = asyncio.create_task(self._watch())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        await asyncio.wait({self._task})


def accepted_draft_tokens(gens: list[Generation], finals: list[GenerationEvent]) -> int | None:
    """Reply tokens that came from accepted drafts, where speculation verified any draft token (else None)."""
    verified = [g.num_draft_accepted for g, f in zip(gens, finals)
                if f.stats is not None and f.stats.acceptance_rate is not None]
    return sum(verified) if verified else None


def total_usage(finals: list[GenerationEvent], n: int) -> Usage:
    """A request's usage from its choices' final events, in choice order (n per prompt): every reply's tokens, and
    each prompt's once (as its first reply ran it), as OpenAI counts them."""
    def total(events: list[GenerationEvent], field: str) -> int:
        return sum(getattr(e.usage, field) for e in events if e.usage is not None)

    firsts = finals[::n]
    return Usage(prompt_tokens=total(firsts, "prompt_tokens"), completion_tokens=total(finals, "completion_tokens"),
                 cached_prompt_tokens=total(firsts, "cached_prompt_tokens"),
                 reasoning_tokens=total(finals, "reasoning_tokens"))
