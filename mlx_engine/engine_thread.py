"""The engine thread: one per process, it owns every MLX array and runs the schedulers' steps, with the jobs front
ends and runners submit run between them. Its own module, so a runner (the distributed one) can hand it work
without importing the engine that loads runners."""

from __future__ import annotations

import atexit
import contextlib
import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from mlx_engine.backends.mlx.host_blas import one_blas_thread

T = TypeVar("T")
log = logging.getLogger(__name__)


class EngineThread:
    """One thread owns all MLX work (MLX streams are per thread). Between scheduler steps it runs the
    submitted jobs (new requests, forward passes, KV saves), so requests join at the next step.

    One per process, a daemon that never exits: MLX 0.32 on Linux aborts the process ("terminate called
    without an active exception") at exit when a thread that ran MLX work has ended before it. Nor may it
    be inside a native call when the interpreter finalizes: a daemon thread that takes the GIL back then is
    ended by pthread_exit, whose unwinding through MLX's or OpenBLAS's C++ frames aborts the same way. So
    at exit it parks: it finishes the step it is in and then waits, forever, on an event nobody sets.
    """

    PARK_TIMEOUT_S = 10.0

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future]] = queue.SimpleQueue()
        self._schedulers: list[Any] = []
        self._idle_hooks: list[Callable[[], None]] = []  # run when no scheduler has work, before the thread waits
        self._stopping = False
        self._parked = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="roofline-engine", daemon=True)
        self._thread.start()
        atexit.register(self.park)

    def park(self) -> None:
        """Called at interpreter exit: returns once the engine thread is idle for good (or after
        PARK_TIMEOUT_S, if a step hangs)."""
        self._stopping = True
        self._jobs.put((lambda: None, Future()))  # wakes it if it waits for a job
        self._parked.wait(self.PARK_TIMEOUT_S)

    def _run(self, job: tuple[Callable[[], Any], Future]) -> None:
        fn, future = job
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn())
        except BaseException as e:  # noqa: BLE001 - delivered to the caller
            future.set_exception(e)

    def _loop(self) -> None:
        while True:
            if self._stopping:
                self._parked.set()
                threading.Event().wait()  # never returns: the process is exiting
            busy = [s for s in self._schedulers if s.has_work()]
            if not busy:
                for hook in self._idle_hooks:
                    try:
                        hook()
                    except Exception as e:  # noqa: BLE001 - a hook's failure is its runner's, reported at its next use
                        log.warning("an engine idle hook failed: %s", e)
                self._run(self._jobs.get())
                continue
            while True:  # every job waiting now runs before the next step
                try:
                    self._run(self._jobs.get_nowait())
                except queue.Empty:
                    break
            blas = any(s.runner.capabilities.host_blas for s in busy)
            with one_blas_thread() if blas else contextlib.nullcontext():  # once a step, not per host GEMM
                for scheduler in busy:
                    scheduler.step()

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        future: Future[T] = Future()
        self._jobs.put((fn, future))
        return future

    def call(self, fn: Callable[[], T]) -> T:
        return self.submit(fn).result()

    def register(self, scheduler: Any) -> None:
        self.call(lambda: self._schedulers.append(scheduler))

    def on_idle(self, hook: Callable[[], None]) -> None:
        """`hook` runs on this thread whenever it is about to wait with no scheduler's work left (a distributed
        runner rests its other ranks then). It must return quickly and be harmless to call twice. Callable from any
        thread, this one included (a runner loads on it): the loop reads a copy of the list."""
        self._idle_hooks = [*self._idle_hooks, hook]

    def off_idle(self, hook: Callable[[], None]) -> None:
        self._idle_hooks = [h for h in self._idle_hooks if h != hook]

    def unregister(self, scheduler: Any) -> None:
        self.call(lambda: self._schedulers.remove(scheduler) if scheduler in self._schedulers else None)


_shared_thread: EngineThread | None = None
_shared_lock = threading.Lock()


def engine_thread() -> EngineThread:
    global _shared_thread
    with _shared_lock:
        if _shared_thread is None:
            _shared_thread = EngineThread()
        return _shared_thread
