"""The cache leaves of an mlx-lm model's layers: attention (paged through the engine's views) and recurrent state
(`kv.state`: the slot pool), for the hybrids (Qwen3-Next and Qwen3.5's Gated DeltaNet, Mamba 2 in Nemotron-H,
Granite 4 and Falcon-H1, LFM2's short convolutions).

mlx-lm's `make_cache` gives each layer a `KVCache` (or a `RotatingKVCache` window), an `ArraysCache` (its
`MambaCache` too) or a `CacheList` of both (falcon_h1: Mamba 2 beside attention in every layer). The layout is that
tree, its leaves in order; the engine's caches hand one view per leaf. For a forward, an attention leaf gets a
`ViewCache` over its view and a state leaf a fresh mlx-lm `ArraysCache` of its class whose entries are the view's
rows (`StateView.read`), so mlx-lm's layer runs unchanged (its gated-delta and SSM kernels are the fast paths);
what the layer leaves in it goes back to the view (`StateView.write`). No lengths and no left padding are set:
every row of a forward is a real token, so mlx-lm's state mask is None. In a packed forward the state leaf's
cache carries a part per decode group and per prefill chunk, and the layer's mixer runs once per part
(`segment_mixers`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from mlx_engine.kv.state import PackedStateView, ScratchState, StateSpec


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
        if isinstance(view, PackedStateView):
            parts = []
            for part in view.parts:
                sub = _arrays_cache(leaf)
                sub.cache = list(part.read())
                pending.append((part, sub))
                parts.append(sub)
            return _segmented_cache(leaf, parts, view)
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


# --- packed forwards: a state leaf's mixer once per part ---------------------------------------------------------


def _segmented_cache(leaf: Leaf, parts: list[Any], view: PackedStateView) -> Any:
    """The leaf's cache in a packed forward: an `ArraysCache` of its class (so the model's masks and checks see
    what they expect: no lengths, no padding) that carries each part's own cache; the mixer wrapped by
    `segment_mixers` runs once per part."""
    obj = _arrays_cache(leaf)
    obj.parts, obj.spans, obj.batched = parts, view.spans, view.batched
    return obj


_SEGMENTED: dict[type, type] = {}


def _segmenting(cls: type) -> type:
    class Segmenting(cls):
        """mlx-lm's recurrent mixer; given a packed forward's segmented cache, run once per part: the decode
        rows as a (B, 1) batch over their slots, each prefill chunk over its own slot."""

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            import mlx.core as mx
            from mlx_lm.models.cache import ArraysCache

            seg = next((a for a in (*args, *kwargs.values()) if isinstance(a, ArraysCache) and "parts" in vars(a)),
                       None)
            if seg is None:
                return super().__call__(*args, **kwargs)

            x_at = next((i for i, a in enumerate(args) if isinstance(a, mx.array)), None)
            x_key = None if x_at is not None else next(k for k, v in kwargs.items() if isinstance(v, mx.array))
            x = args[x_at] if x_at is not None else kwargs[x_key]
            outs = []
            for sub, (lo, hi), batched in zip(seg.parts, seg.spans, seg.batched):
                part = x[:, lo:hi]
                if batched:
                    part = part.reshape(hi - lo, 1, *x.shape[2:])
                a = [part if i == x_at else (sub if v is seg else v) for i, v in enumerate(args)]
                kw = {k: (part if k == x_key else (sub if v is seg else v)) for k, v in kwargs.items()}
                y = super().__call__(*a, **kw)
                outs.append(y.reshape(1, hi - lo, *y.shape[2:]) if batched else y)
            return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=1)

    Segmenting.__name__ = Segmenting.__qualname__ = cls.__name__
    return Segmenting


def segment_mixers(layers: list[Any]) -> None:
    """Each layer's direct children that take a `cache` (a recurrent mixer, or an attention module, which passes
    through) get the class that runs a packed forward's parts one by one."""
    import inspect

    import mlx.nn as nn

    for layer in layers:
        for _, child in layer.children().items():
            if not isinstance(child, nn.Module):
                continue
            cls = type(child)
            if cls in _SEGMENTED.values():
                continue
            try:
                params = inspect.signature(cls.__call__).parameters
            except (TypeError, ValueError):
                continue
            if "cache" in params:
                child.__class__ = _SEGMENTED.setdefault(cls, _segmenting(cls))
