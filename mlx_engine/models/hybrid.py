"""The cache leaves of an mlx-lm model's layers: attention (paged through the engine's views) and recurrent state
(`kv.state`: the slot pool), for the hybrids (Qwen3-Next and Qwen3.5's Gated DeltaNet, Mamba 2 in Nemotron-H,
Granite 4 and Falcon-H1, LFM2's short convolutions).

mlx-lm's `make_cache` gives each layer a `KVCache` (or a `RotatingKVCache` window), an `ArraysCache` (its
`MambaCache` too) or a `CacheList` of both (falcon_h1: Mamba 2 beside attention in every layer). The layout is that
tree, its leaves in order; the engine's caches hand one view per leaf. For a forward, an attention leaf gets a
`ViewCache` over its view and a state leaf a fresh mlx-lm `ArraysCache` of its class whose entries are the view's
rows (`StateView.read`), so mlx-lm's layer runs unchanged (its gated-delta and SSM kernels are the fast paths);
what the layer leaves in it goes back to the view (`StateView.write`). No lengths and no left padding are set:
every row of a forward is a real token, so mlx-lm's state mask is None.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from mlx_engine.kv.state import ScratchState, StateSpec


@dataclass(frozen=True)
class Leaf:
    """One cache of a layer: attention (`window`: its sliding window, None: full) or state (mlx-lm's class, size)."""

    state: bool
    window: int | None = None
    cls: type | None = None
    size: int = 0


def layout_of(caches: list[Any]) -> tuple[list[Any] | None, str | None]:
    """(per layer its Leaf or tuple of Leaves, None), or (None, the cache kinds the views cannot hold)."""
    from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, RotatingKVCache

    odd: set[str] = set()

    def leaf(c: Any) -> Any:
        if type(c) is KVCache:
            return Leaf(False)
        if type(c) is RotatingKVCache and c.keep == 0:
            return Leaf(False, window=int(c.max_size))
        if isinstance(c, ArraysCache):
            return Leaf(True, cls=type(c), size=len(c.cache))
        if type(c) is CacheList:
            return tuple(leaf(x) for x in c.caches)
        odd.add(type(c).__name__)
        return None

    layout = [leaf(c) for c in caches]
    if odd:
        return None, f"its layers keep {', '.join(sorted(odd))} state"
    return layout, None


def leaves(layout: list[Any]) -> list[Leaf]:
    return [x for item in layout for x in (item if isinstance(item, tuple) else (item,))]


def _arrays_cache(leaf: Leaf) -> Any:
    from mlx_lm.models.cache import ArraysCache

    obj = leaf.cls.__new__(leaf.cls)
    ArraysCache.__init__(obj, leaf.size)
    return obj


def layer_caches(layout: list[Any], views: list[Any], attention: Callable[[Any], Any]) -> tuple[list[Any], list[Any]]:
    """mlx-lm's per-layer caches over one view per leaf (`attention(view)` for an attention leaf), and the (view,
    ArraysCache) pairs whose entries go back after the forward (`write_back`). Views for the attention leaves only
    (a contiguous forward, scoring a prompt): each state leaf starts empty (`ScratchState`)."""
    from mlx_lm.models.cache import CacheList

    flat = leaves(layout)
    if len(views) != len(flat):
        it = iter(views)
        views = [ScratchState() if leaf.state else next(it) for leaf in flat]
    pending: list[tuple[Any, Any]] = []
    it = iter(views)

    def one(leaf: Leaf) -> Any:
        view = next(it)
        if not leaf.state:
            return attention(view)
        obj = _arrays_cache(leaf)
        entries = view.read()
        if entries is not None:
            obj.cache = list(entries)
        pending.append((view, obj))
        return obj

    out = [CacheList(*(one(x) for x in item)) if isinstance(item, tuple) else one(item) for item in layout]
    return out, pending


def write_back(pending: list[Any]) -> None:
    for view, obj in pending:
        view.write(obj.cache)


def state_specs(pending: list[Any]) -> list[StateSpec] | None:
    """After a probe forward through `ScratchState`s: each state leaf's spec (None where a layer left an entry
    empty)."""
    specs = []
    for view, _ in pending:
        entries = view.read()
        if entries is None or any(e is None for e in entries):
            return None
        specs.append(StateSpec(tuple(tuple(e.shape[1:]) for e in entries), tuple(e.dtype for e in entries)))
    return specs
