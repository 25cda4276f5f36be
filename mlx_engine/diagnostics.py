"""The engine's insides for benchmarks and tests: `Engine.diagnostics()`.

Front ends use `Engine`'s own methods (`mlx_engine.api.EngineLike`); a benchmark that times one forward, or a test
that checks which blocks a request holds, needs the runner, the scheduler and the KV cache behind them. This is the
one way to them: through their contracts (the runner's in `mlx_engine.backends`, the cache's in
`mlx_engine.kv.protocol`), with `call` running work on the engine thread, which owns every MLX array and the
scheduler's state between steps.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from mlx_engine.backends.base import ModelRunner
    from mlx_engine.engine import Engine
    from mlx_engine.kv.protocol import KVCache
    from mlx_engine.scheduler import Scheduler

T = TypeVar("T")


class Diagnostics:
    """One engine's runner, scheduler and cache, read when asked (so a closed engine says so), and its thread."""

    def __init__(self, engine: Engine):
        self._engine = engine

    @property
    def runner(self) -> ModelRunner:
        """The model runner (`backends.base.ModelRunner`: the MLX or torch runner, the distributed one under
        mlx.launch); its other attributes are that backend's own, for tests of that backend."""
        return self._engine._runner

    @property
    def scheduler(self) -> Scheduler:
        """The scheduler that steps this engine's requests; change its settings only inside `call`."""
        return self._engine._scheduler

    @property
    def cache(self) -> KVCache:
        """The runner's KV cache, through its contract (`capabilities` says what it can do)."""
        return self.runner.cache

    def call(self, fn: Callable[[], T]) -> T:
        """Runs `fn` on the engine thread, between scheduler steps, and returns its result (or raises its error)."""
        return self._engine._thread.call(fn)

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        """`call` without waiting: the Future of `fn`'s result."""
        return self._engine._thread.submit(fn)

    def execution(self) -> dict[str, Any]:
        """How this engine's forwards ran: "forwards", the runner's count of each (entry, path and threads, thread:
        `ModelRunner.forward_paths`); with torch imported, "torch_threads": every thread of this process that has
        run torch's CPU work (more than the engine thread changes how its OpenMP threads wait: issue 48)."""
        out: dict[str, Any] = {"forwards": self.call(self.runner.forwards().forward_paths)}
        host = sys.modules.get("mlx_engine.backends.torch.host")
        if host is not None:
            out["torch_threads"] = sorted(host.TORCH_THREADS)
        return out

    def matmul_flops(self, device: str, n: int = 2048, repeats: int = 3) -> float:
        """Peak dense matmul FLOP/s, the best of `repeats`: float16 MLX (2n x 2n) on Metal; on a CPU float32 (n x n)
        through numpy or torch, whichever is faster (all cores). On the engine thread: a torch matmul on any other
        thread gives the process a second OpenMP pool, and the engine's decode then ran at half its speed on a
        quiet 2-core EPYC (5-10x faster under load: libgomp stops spinning at barriers; issue 48)."""
        if device == "metal":
            def run() -> float:
                import mlx.core as mx

                a = mx.random.normal((2 * n, 2 * n)).astype(mx.float16)
                return 2 * (2 * n) ** 3 / best_time(lambda: mx.eval(a @ a), repeats)

            return self.call(run)

        def run_cpu() -> float:
            import importlib.util

            import numpy as np

            a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
            best = best_time(lambda: a @ a, repeats)
            if importlib.util.find_spec("torch") is not None:  # torch's CPU matmul (oneDNN/MKL) can beat numpy's BLAS
                from mlx_engine.backends.torch.host import cpu_matmul_seconds

                best = min(best, cpu_matmul_seconds(a, repeats, best_time))
            return 2 * n**3 / best

        return self.call(run_cpu)


def best_time(fn: Callable[[], Any], repeats: int) -> float:
    """The fastest of `repeats` timed calls of `fn`, after one untimed."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best
