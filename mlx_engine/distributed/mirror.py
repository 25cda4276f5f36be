"""Caches in lockstep: rank 0's cache records every call that changes it, and the other ranks replay the calls on
their own caches, which hold only their layers or heads.

The block bookkeeping is deterministic pure Python, so the same calls in the same order give every rank the same
block ids, tables and prefix-cache hits; each forward's plan carries a checksum of what rank 0's cache holds for it
(`lockstep_figures`), and a rank whose own differs stops with an error rather than compute on other blocks. A call
is recorded before rank 0 makes it: one that raises there raises the same way on every rank. Token lists travel as
the tail that is new since the request's last call (a decode step's plan is a few hundred bytes, not its whole
context).
"""

from __future__ import annotations

from typing import Any

VIEW_METHODS = frozenset({"prefill_layers", "decode_layers", "packed_layers"})
# the KVCache protocol's calls that change a cache (kv.protocol); its reads pass through
CACHE_CALLS = VIEW_METHODS | {"start", "allocate", "trim", "record", "finish", "free", "drop_request", "drop"}
# which argument holds the request's tokens (the list-of-lists ones hold one list per request of argument 0)
_TOKEN_ARG = {"start": 1, "record": 1, "finish": 1, "allocate": 1}
_TOKEN_LISTS = {"decode_layers": 1, "packed_layers": 1}
_ENDS = frozenset({"finish", "free", "drop_request"})
MAX_KEPT_VIEWS = 8  # views a rank keeps for forwards to come (a timing's contiguous buffers serve several)


class PlannedLayers(list):
    """A forward's per-layer views and the plan entry that made them: each rank builds its own from that entry."""

    op: int = -1


class PlanLog:
    """Rank 0's record of the calls since the last plan went out."""

    def __init__(self) -> None:
        self.ops: list[list[Any]] = []
        self.num_ops = 0
        self._sent: dict[str, list[int]] = {}  # req -> its tokens as the other ranks know them
        self.view_reqs: dict[int, list[str]] = {}  # a views entry -> the requests whose blocks it reads

    def add(self, op: list[Any]) -> int:
        self.num_ops += 1
        self.ops.append([self.num_ops, *op])
        return self.num_ops

    def take(self) -> list[list[Any]]:
        ops, self.ops = self.ops, []
        return ops

    def tokens(self, req: str, ids: list[int]) -> list[Any]:
        prev = self._sent.get(req, [])
        keep = min(len(prev), len(ids))
        if prev[:keep] != ids[:keep]:
            keep = next(i for i, (a, b) in enumerate(zip(prev, ids)) if a != b)
        self._sent[req] = list(ids)
        return [req, keep, list(ids[keep:])]

    def forget(self, req: str | None) -> None:
        if req is None:
            self._sent.clear()
        else:
            self._sent.pop(req, None)

    def encode(self, method: str, args: tuple[Any, ...]) -> list[Any]:
        out = list(args)
        if method in _TOKEN_ARG and len(out) > _TOKEN_ARG[method]:
            i = _TOKEN_ARG[method]
            out[i] = self.tokens(out[0], list(out[i]))
        elif method in _TOKEN_LISTS:
            i = _TOKEN_LISTS[method]
            out[i] = [self.tokens(r, list(ids)) for r, ids in zip(out[0], out[i])]
        if method in _ENDS:
            self.forget(out[0])
        elif method == "drop":
            self.forget(None)
        return out


class MirroredCache:
    """Rank 0's cache: the local one (a `kv.protocol.KVCache`), its changing calls recorded for the other ranks;
    reads (stats, state, capabilities, free blocks) pass through."""

    def __init__(self, cache: Any, log: PlanLog):
        object.__setattr__(self, "_log", log)
        object.__setattr__(self, "local", cache)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self.local, name)
        if name not in CACHE_CALLS:
            return value

        def call(*args: Any, **kwargs: Any) -> Any:
            op = self._log.add(["c", name, self._log.encode(name, args), kwargs])
            result = value(*args, **kwargs)
            if name in VIEW_METHODS:
                result = PlannedLayers(result)
                result.op = op
                self._log.view_reqs = {op: view_reqs(name, list(args))}  # only the newest is read
            return result

        return call


class TrimRecorded:
    """One layer of contiguous buffers on rank 0 (the cost curve's timing forwards): its trims are recorded."""

    def __init__(self, log: PlanLog, op: int, index: int, layer: Any):
        object.__setattr__(self, "_log", log)
        object.__setattr__(self, "_op", op)
        object.__setattr__(self, "_index", index)
        object.__setattr__(self, "_layer", layer)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._layer, name)

    def trim(self, n: int) -> int:
        self._log.add(["k", "trim", [self._op, self._index, n], {}])
        return self._layer.trim(n)


class Replayer:
    """A rank's side: replays rank 0's calls on its own cache and keeps the views they made."""

    def __init__(self, cache: Any, fresh_contiguous: Any):
        c = cache  # the KVCache protocol's changing calls, by name
        self.calls = {"start": c.start, "allocate": c.allocate, "trim": c.trim, "record": c.record,
                      "finish": c.finish, "free": c.free, "drop_request": c.drop_request, "drop": c.drop,
                      "prefill_layers": c.prefill_layers, "decode_layers": c.decode_layers,
                      "packed_layers": c.packed_layers}
        assert set(self.calls) == CACHE_CALLS
        self.fresh_contiguous = fresh_contiguous  # () -> this rank's empty contiguous buffers
        self.tokens: dict[str, list[int]] = {}
        self.views: dict[int, list[Any]] = {}
        self.view_reqs: dict[int, list[str]] = {}

    def _decode(self, t: list[Any]) -> list[int]:
        req, keep, tail = t
        ids = self.tokens.get(req, [])[:keep] + tail
        self.tokens[req] = ids
        return ids

    def apply(self, op: list[Any]) -> None:
        op_id, target, method, args, kwargs = op
        if target == "k":
            if method == "new":
                self._keep(op_id, self.fresh_contiguous())
            else:  # trim
                layers, index, n = args
                self.views[layers][index].trim(n)
            return
        if method in _TOKEN_ARG and len(args) > _TOKEN_ARG[method]:
            args[_TOKEN_ARG[method]] = self._decode(args[_TOKEN_ARG[method]])
        elif method in _TOKEN_LISTS:
            i = _TOKEN_LISTS[method]
            args[i] = [self._decode(t) for t in args[i]]
            if method == "packed_layers":
                args[2] = [tuple(c) for c in args[2]]
        try:
            result = self.calls[method](*args, **kwargs)
        except Exception:  # noqa: BLE001 - rank 0 raised the same from the same state, and handles it
            result = None
        if method in VIEW_METHODS and result is not None:
            self._keep(op_id, result)
            self.view_reqs[op_id] = view_reqs(method, args)
        if method in _ENDS:
            self.tokens.pop(args[0], None)
        elif method == "drop":
            self.tokens.clear()

    def _keep(self, op_id: int, layers: list[Any]) -> None:
        self.views[op_id] = layers
        while len(self.views) > MAX_KEPT_VIEWS:
            self.view_reqs.pop(old := next(iter(self.views)), None)
            self.views.pop(old)


def view_reqs(method: str, args: list[Any]) -> list[str]:
    """The requests whose blocks a views call's forward reads."""
    if method == "prefill_layers":
        return [args[0]]
    if method == "decode_layers":
        return list(args[0])
    return list(args[0]) + [c[0] for c in args[2]]  # packed_layers


def lockstep_figures(cache: Any, req_ids: list[str]) -> list[int]:
    """What the ranks' caches must agree on before a forward, read through the KVCache protocol: the blocks each
    request of the forward holds, and the blocks free."""
    return [cache.num_blocks_held(r) for r in req_ids] + [cache.num_free_blocks()]
