"""The resident models of a multi-model server: loaded just in time when a request names one, kept while requests
use them, unloaded after an idle keep-alive or to make room for another, least recently used first, never one with
requests in flight (Ollama's scheduler, LM Studio's just-in-time loading, llama.cpp's router, in one place).

Everything here runs on the event loop; loads, unloads and the fit check run on worker threads. A model is keyed
by its ref and load options, so two names for the same model share one engine. Requests for a model that is loading
wait for that one load (at most `max_waiting` of them, then 429, as the admission gate counts). The memory budget is
the loader's own fit check (`catalog.check_fit`, through `fits`), asked before each load while other models are
resident; `max_models` caps the count too. Idle expiry is a timer per model: an idle server wakes for nothing.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Callable
from typing import Any

from mlx_engine.api import EngineLike, RooflineError

from app.server.errors import APIError
from app.server.model_table import ModelTable, Preset
from app.server.served import Served

SERVER_DEFAULT = "server"  # a keep-alive that defers to the server's --keep-alive
_UNSET: Any = object()


def preset_key(p: Preset) -> str:
    return p.ref + "|" + json.dumps(p.load, sort_keys=True)


class Resident:
    """A loaded model: its engine (`served`), the requests using it, when it was last used and how long it stays
    once idle (`keep_alive` seconds; None: forever)."""

    def __init__(self, key: str, preset: Preset, served: Served, keep_alive: float | None, pinned: bool = False):
        self.key = key
        self.preset = preset
        self.served = served
        self.keep_alive = keep_alive
        self.pinned = pinned  # the one model of `serve -m`: never unloaded
        self.in_flight = 0
        self.last_used = time.monotonic()
        self.loaded_at = time.time()
        self.expires_at: float | None = None  # wall-clock time of its idle unload, while one is due
        self.timer: asyncio.TimerHandle | None = None

    def cancel_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.expires_at = None


class ModelPool:
    """`load(preset)` -> an engine (blocking); `fits(preset)` -> None, or why it does not fit now (blocking);
    `close(engine)` closes one and hands its memory back (blocking). `table` None: one pinned model (`single`)."""

    def __init__(self, table: ModelTable | None, load: Callable[[Preset], EngineLike], *,
                 close: Callable[[EngineLike], Any] | None = None, fits: Callable[[Preset], str | None] | None = None,
                 max_models: int | None = None, keep_alive_s: float | None = 300.0, max_waiting: int = 64,
                 wait_s: float = 300.0, log: Callable[[str], None] | None = None):
        self.table = table
        self._load_fn = load
        self._close_fn = close or (lambda engine: engine.close())
        self._fits = fits
        self.max_models = max_models
        self.keep_alive_s = keep_alive_s
        self.max_waiting = max_waiting
        self.wait_s = wait_s
        self._log = log or (lambda line: print(f"roofline: {line}", file=sys.stderr, flush=True))
        self.residents: dict[str, Resident] = {}
        self._loading: dict[str, asyncio.Future[Resident]] = {}
        self.waiting = 0  # requests waiting for a model to load
        self._load_lock: asyncio.Lock | None = None
        self._released: asyncio.Event | None = None
        self.loads = 0
        self.unloads = 0

    @classmethod
    def single(cls, served: Served) -> ModelPool:
        pool = cls(None, lambda p: served.engine)
        pool.residents[served.model_id] = Resident(served.model_id, Preset(served.model_id, served.info.name), served,
                                                  None, pinned=True)
        return pool

    @property
    def multi(self) -> bool:
        return self.table is not None

    def recent(self) -> Resident | None:
        """The most recently used resident model (None: none is loaded)."""
        return max(self.residents.values(), key=lambda r: r.last_used, default=None)

    # ---- a request's hold on a model ---------------------------------------------------------------------

    async def checkout(self, name: Any, keep_alive: Any = _UNSET) -> tuple[Resident, str]:
        """The resident model `name` reaches (loaded now if it is not), held for one request until `release`;
        with the name replies carry. `keep_alive`: the request's (seconds, None: forever), which then stays the
        model's. Raises APIError."""
        if self.table is None:
            res = next(iter(self.residents.values()))
            if isinstance(name, str) and name not in res.served.model_names:
                raise APIError(404, f"The model '{name}' does not exist: this server serves '{res.served.model_id}' "
                               "(also reachable as 'default')", "model", "model_not_found")
            res.in_flight += 1
            return res, res.served.model_id
        preset = await asyncio.to_thread(self.table.resolve, name)
        key = preset_key(preset)
        while True:
            res = self.residents.get(key)
            if res is None:
                await self._loaded(preset, key)
                continue  # resumed after the load: take it if it is still there (not evicted meanwhile)
            res.in_flight += 1
            res.last_used = time.monotonic()
            res.cancel_timer()
            if keep_alive is not _UNSET:
                res.keep_alive = keep_alive
            return res, preset.name

    def release(self, res: Resident) -> None:
        """A request is done with `res`: once none is, its keep-alive starts (0: unloaded now)."""
        res.in_flight -= 1
        res.last_used = time.monotonic()
        if self._released is not None:
            self._released.set()
        if res.in_flight == 0 and not res.pinned and self.residents.get(res.key) is res:
            self._schedule_expiry(res)

    def _schedule_expiry(self, res: Resident) -> None:
        res.cancel_timer()
        if res.keep_alive is None:
            return
        if res.keep_alive <= 0:
            asyncio.ensure_future(self._expire(res))
            return
        res.expires_at = time.time() + res.keep_alive
        res.timer = asyncio.get_running_loop().call_later(res.keep_alive,
                                                          lambda: asyncio.ensure_future(self._expire(res)))

    async def _expire(self, res: Resident) -> None:
        if res.in_flight == 0 and self.residents.get(res.key) is res:
            await self.unload(res, f"idle for {res.keep_alive:g} s")

    # ---- loading and unloading -----------------------------------------------------------------------------

    async def _loaded(self, preset: Preset, key: str) -> Resident:
        fut = self._loading.get(key)
        if fut is None:
            fut = asyncio.ensure_future(self._load(preset, key))
            self._loading[key] = fut
            fut.add_done_callback(lambda f: self._loading.pop(key, None))
        elif self.waiting >= self.max_waiting:
            raise APIError(429, f"the server is at capacity ({self.waiting} requests waiting for models to load); "
                           "retry shortly", None, "rate_limit_exceeded", headers={"Retry-After": "1"})
        self.waiting += 1
        try:
            return await asyncio.shield(fut)
        finally:
            self.waiting -= 1

    async def _load(self, preset: Preset, key: str) -> Resident:
        if self._load_lock is None:
            self._load_lock = asyncio.Lock()
        async with self._load_lock:  # one load at a time: each one's fit check sees the memory the last one took
            await self._make_room(preset)
            t0 = time.perf_counter()
            try:
                engine = await asyncio.to_thread(self._load_fn, preset)
            except RooflineError as e:
                raise APIError(500, f"cannot load '{preset.name}': {e}", "model", "model_load_failed") from None
            keep = self.keep_alive_s if preset.keep_alive == SERVER_DEFAULT else preset.keep_alive
            res = Resident(key, preset, Served(engine, preset.name), keep)  # type: ignore[arg-type]
            self.residents[key] = res
            self.loads += 1
            self._log(f"loaded {preset.name} in {time.perf_counter() - t0:.1f} s ({len(self.residents)} resident)")
            if not res.in_flight:  # nobody may come for it: it still goes after its keep-alive
                self._schedule_expiry(res)
            return res

    async def _make_room(self, preset: Preset) -> None:
        """Unloads idle models, least recently used first, until `preset` fits (count and memory); waits for a busy
        one to finish when only busy ones are left, up to `wait_s`."""
        if self._released is None:
            self._released = asyncio.Event()
        deadline = time.monotonic() + self.wait_s
        while True:
            if self.max_models is not None and len(self.residents) >= self.max_models:
                why = f"{len(self.residents)} models are loaded (--max-models {self.max_models})"
            elif self._fits is not None and self.residents:
                why = await asyncio.to_thread(self._fits, preset)
            else:
                return
            if why is None:
                return
            idle = [r for r in self.residents.values() if r.in_flight == 0 and not r.pinned]
            if idle:
                await self.unload(min(idle, key=lambda r: r.last_used), f"to make room for {preset.name}")
                continue
            left = deadline - time.monotonic()
            if left <= 0:
                raise APIError(503, f"cannot load '{preset.name}' now: {why}, and every loaded model has requests "
                               "running; retry shortly", "model", "models_busy", headers={"Retry-After": "5"})
            self._released.clear()
            try:
                await asyncio.wait_for(self._released.wait(), left)
            except TimeoutError:
                pass

    async def unload(self, res: Resident, why: str) -> None:
        """Closes an idle model and hands its memory back (no-op for one already gone or pinned)."""
        if res.pinned or self.residents.get(res.key) is not res:
            return
        del self.residents[res.key]
        res.cancel_timer()
        await asyncio.to_thread(self._close_fn, res.served.engine)
        self.unloads += 1
        self._log(f"unloaded {res.preset.name} ({why})")

    async def close_all(self) -> None:
        for res in list(self.residents.values()):
            await self.unload(res, "the server is stopping")


def pool_cards(pool: ModelPool, created: int) -> list[dict[str, Any]]:
    """Blocking: every model the pool serves, with whether it is loaded (and the loaded one's own card)."""
    assert pool.table is not None
    residents = list(pool.residents.values())  # a copy: the loop may change the dict meanwhile
    loaded = {r.preset.name: r for r in residents}
    loaded_refs = {r.preset.ref for r in residents}
    out = []
    for e in pool.table.entries():
        s = e.summary
        card = {"id": e.name, "object": "model", "created": created, "owned_by": "roofline", "ref": e.ref,
                "name": s.name if s else e.name, "context_length": s.context_length if s else None,
                "quantization": s.quantization if s else None, "model_type": s.model_type if s else None,
                "num_parameters": s.num_parameters if s else None, "size_bytes": s.size_bytes if s else None,
                "loaded": e.name in loaded or (e.name not in pool.table.presets and e.ref in loaded_refs)}
        if e.name in loaded:
            card.update({k: v for k, v in loaded[e.name].served.model_card().items() if k != "id"})
        out.append(card)
    return out
