"""mlx-lm's model classes on the engine's KV views (`kv.protocol.MLXLayerView`): paged KV, prefix caching,
continuous batching and speculative rollback for the families without a file here.

mlx-lm's attention modules talk to their cache through two names: `cache.update_and_fetch(keys, values)`, then
`scaled_dot_product_attention(q, k, v, cache=cache, ...)` from `mlx_lm.models.base`, imported into each family's
module by name (and `self.rope(x, offset=cache.offset)` before both). Each layer here gets a `ViewCache` over the
engine's view: `update_and_fetch` hands the new k/v back untouched, and the family module's
`scaled_dot_product_attention`, routed once per module (`route_attention`), sends a `ViewCache`'s attention to the
view, which writes k/v and attends at its own positions (any other cache goes to mlx-lm's function). `offset` is
the view's: an int for a prefill chunk, (B,) positions for B sequences decoding together (mx.fast.rope takes an
array offset). The view builds its own causal mask, so mlx-lm's is not made (`make_mask` gives None).

Attention sinks (gpt-oss: `scaled_dot_product_attention(..., sinks=)`) go to the view with the queries; a family
that scores by hand (gemma2: q @ k.T, then its soft cap) gets its attention class swapped for one that, on a
`ViewCache`, asks the view for attention with `softcap=` (`_HAND_WRITTEN`). The view serves both through the
attention table's scored rows (`attention.scored`: gathered K/V, MLX ops).

A packed forward (`kv.views.PackedView`: decode rows and prefill chunks of several sequences in one (1, T) row)
has no single offset, so each attention module's `rope` is wrapped (`ViewRoPE`): while a forward runs it ropes
through the layer's view (`MLXLayerView.rope`), each part at its own positions. A family whose layers do not
each hold one `rope` module is not packed (`AdaptedModel.packs`).

What can be paged is found by a probe, one lazy forward of one token (nothing is evaluated): every layer must
attend once through its cache with K and V of one shape. A hybrid's recurrent layers (linear attention, SSM and
convolution state: mlx-lm's `ArraysCache`) keep their state in the engine's slot pool (`models.hybrid`,
`kv.state`) beside the paged attention layers; a family with another kind of cache keeps mlx-lm's caches, and
`paging_problem` says why in one line. A sliding layer's `RotatingKVCache(max_size=W)` is a window of W keys
(`EngineArgs.layer_windows`, the native families' contract), which the paged cache keeps per kind of layer
(`kv.kinds`).

Mixture-of-experts layers (mlx-lm's `SwitchGLU`, given the router's `indices`) record each decode step's routing
(`MoERouting`): the bytes a step reads are the shared weights plus the experts routed in it, over the batch their
union (`roofline.moe_step_bytes`).
"""

from __future__ import annotations

import sys
from collections import deque
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlx_engine.roofline import MoEShape, moe_step_bytes


class ViewCache:
    """mlx-lm's cache seam over one layer's engine view, for one forward."""

    def __init__(self, view: Any):
        self.view = view
        self._kv: tuple[mx.array, mx.array] | None = None

    @property
    def offset(self) -> Any:
        return self.view.offset

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self._kv = (keys, values)  # written by the view's attention, with the queries
        return keys, values

    def make_mask(self, *args: Any, **kwargs: Any) -> None:
        return None  # the view masks (causal, at its positions)

    def attend(self, queries: mx.array, scale: float, sinks: mx.array | None = None,
               softcap: float | None = None) -> mx.array:
        """The view's attention of the queries over the k/v `update_and_fetch` was given (`MLXLayerView.attention`:
        a soft cap and sinks only where the layer has them)."""
        if self._kv is None:
            raise RuntimeError("scaled_dot_product_attention before update_and_fetch on an engine view")
        (keys, values), self._kv = self._kv, None
        if softcap is None and sinks is None:
            return self.view.attention(queries, keys, values, scale)
        return self.view.attention(queries, keys, values, scale, softcap=softcap, sinks=sinks)


_ROUTED: dict[str, Any] = {}  # module name -> mlx-lm's scaled_dot_product_attention it replaced


def route_attention(model: nn.Module) -> list[str]:
    """Points `scaled_dot_product_attention` of every module that defines one of `model`'s layers at the
    router (once per module): a `ViewCache` attends through its view, anything else through mlx-lm's
    function as before. Attention modules that score by hand (`_HAND_WRITTEN`) get a class whose forward on a
    `ViewCache` asks the view. Returns the modules routed."""
    for _, m in model.named_modules():
        hand = _HAND_WRITTEN.get(f"{type(m).__module__}.{type(m).__name__}")
        if hand is not None:
            if type(m) not in _VIEW_CLASSES:
                _VIEW_CLASSES[type(m)] = hand(type(m))
            m.__class__ = _VIEW_CLASSES[type(m)]
    names = sorted({type(m).__module__ for _, m in model.named_modules()})
    routed = []
    for name in names:
        module = sys.modules.get(name)
        original = getattr(module, "scaled_dot_product_attention", None)
        if original is None:
            continue
        if name not in _ROUTED:
            _ROUTED[name] = original
            module.scaled_dot_product_attention = _router(original)
        routed.append(name)
    return routed


def _router(original: Any) -> Any:
    def scaled_dot_product_attention(queries, keys, values, cache=None, scale=1.0, mask=None, sinks=None):
        if isinstance(cache, ViewCache):
            return cache.attend(queries, scale, sinks)
        if sinks is None:
            return original(queries, keys, values, cache=cache, scale=scale, mask=mask)
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)

    return scaled_dot_product_attention


def _gemma2_attention(cls: type) -> type:
    """mlx-lm's gemma2 `Attention` scores by hand: q @ k.T, then the soft cap `attn_logit_softcapping`. On a
    `ViewCache` the same projections and rope, then the view's attention with that soft cap."""

    class Attention(cls):
        def __call__(self, x: mx.array, mask: mx.array | None = None, cache: Any = None) -> mx.array:
            if not isinstance(cache, ViewCache):
                return super().__call__(x, mask, cache)
            B, L, _ = x.shape
            q, k, v = (p(x).reshape(B, L, h, -1).transpose(0, 2, 1, 3) for p, h in
                       ((self.q_proj, self.n_heads), (self.k_proj, self.n_kv_heads), (self.v_proj, self.n_kv_heads)))
            q, k = self.rope(q, offset=cache.offset), self.rope(k, offset=cache.offset)
            cache.update_and_fetch(k, v)
            out = cache.attend(q, self.scale, softcap=self.attn_logit_softcapping)
            return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))

    Attention.__name__ = Attention.__qualname__ = cls.__name__
    return Attention


# mlx-lm's attention classes that do not call scaled_dot_product_attention: their view-aware subclass
_HAND_WRITTEN = {"mlx_lm.models.gemma2.Attention": _gemma2_attention}
_VIEW_CLASSES: dict[type, type] = {}


@dataclass(frozen=True)
class KVShape:
    num_kv_heads: int
    head_dim: int
    windows: tuple[int | None, ...] = ()  # per attention leaf: its sliding window (None: full attention)
    layout: tuple[Any, ...] = ()  # per layer its cache leaves (`models.hybrid.layout_of`)
    states: tuple[Any, ...] = ()  # per leaf: a state leaf's `kv.state.StateSpec`, None for attention


@dataclass(frozen=True)
class EngineArgs:
    """What the runner and the caches read of a model's shape (`models.llama.ModelArgs`' names)."""

    num_hidden_layers: int
    num_key_value_heads: int
    head_dim: int
    windows: tuple[int | None, ...] = ()

    @property
    def sliding_window(self) -> int | None:
        return max((w for w in self.windows if w is not None), default=None)

    def layer_windows(self) -> list[int | None]:
        """Each layer's sliding window (None: full attention)."""
        return list(self.windows) or [None] * self.num_hidden_layers


class _ProbeView:
    offset = 0

    def __init__(self) -> None:
        self.shapes: list[tuple[tuple[int, ...], tuple[int, ...]]] = []

    def attention(self, q: mx.array, k: mx.array, v: mx.array, scale: float, **scores: Any) -> mx.array:
        self.shapes.append((tuple(k.shape), tuple(v.shape)))
        return mx.zeros((*q.shape[:-1], v.shape[-1]), dtype=q.dtype)


def paging_problem(model: nn.Module) -> tuple[KVShape | None, str | None]:
    """(the K/V shape every attention leaf stores and the state leaves' specs, None) when `model`'s caches run on
    the engine's views (`models.hybrid`), else (None, why not in a few words)."""
    from mlx_lm.models.cache import KVCache

    from mlx_engine.models.hybrid import layer_caches, layout_of, leaves, state_specs, write_back

    layers = getattr(model, "layers", None)
    if not layers:
        return None, "it does not list its layers"
    if backbone_name(model) is None:
        return None, f"its decoder is none of {', '.join(_BACKBONES)}"
    caches = model.make_cache() if hasattr(model, "make_cache") else [KVCache() for _ in layers]
    layout, why = layout_of(caches)
    if layout is None:
        return None, why
    flat = leaves(layout)
    # a hybrid's layers without a mixer keep no cache (nemotron_h's MLP layers): its caches are consumed in order
    if len(caches) != len(layers) and not any(leaf.state for leaf in flat):
        return None, f"it has {len(caches)} caches for {len(layers)} layers"
    if all(leaf.state for leaf in flat):
        kinds = sorted({type(c).__name__ for c in caches})
        return None, f"its layers keep {', '.join(kinds)} state and none attends (the state pool sits beside paged KV)"
    route_attention(model)
    from mlx_engine.kv.state import ScratchState

    views = [ScratchState() if leaf.state else _ProbeView() for leaf in flat]
    built, pending = layer_caches(layout, views, ViewCache)
    try:
        model(mx.zeros((1, 1), dtype=mx.int32), cache=built)  # lazy: nothing evaluated
    except Exception as e:  # noqa: BLE001 - a family whose attention does something else with its cache
        return None, f"its attention does not go through mlx-lm's cache seam ({type(e).__name__}: {e})".splitlines()[0]
    write_back(pending)
    attention = [v for v in views if isinstance(v, _ProbeView)]
    if any(len(v.shapes) != 1 for v in attention):
        return None, "its attention is not mlx-lm's scaled_dot_product_attention on every layer"
    specs = state_specs(pending)
    if specs is None:
        return None, "a recurrent layer left part of its state empty"
    shapes = {s for v in attention for s in v.shapes}
    (k, val), = shapes if len(shapes) == 1 else ((None, None),)
    if k is None or k != val or k[0] != 1 or k[2] != 1:
        return None, f"its layers store K/V of different shapes ({sorted(shapes)})"
    it = iter(specs)
    return KVShape(num_kv_heads=k[1], head_dim=k[3], windows=tuple(x.window for x in flat if not x.state),
                   layout=tuple(layout), states=tuple(next(it) if x.state else None for x in flat)), None


class ViewRoPE(nn.Module):
    """An attention module's rope, through the layer's view while the adapter runs a forward (else as it was)."""

    def __init__(self, rope: nn.Module):
        super().__init__()
        self.rope = rope
        self.view: Any = None  # not a parameter: a plain attribute

    def __call__(self, x: mx.array, offset: Any = 0) -> mx.array:
        if self.view is None:
            return self.rope(x, offset=offset)
        return self.view.rope(self.rope, x, x)[0]  # q and k are roped in two calls here; the second output unused


def _owners_per_layer(model: nn.Module) -> list[list[nn.Module]]:
    return [[m for _, m in layer.named_modules() if isinstance(m.get("rope") if isinstance(m, dict) else None,
                                                               nn.Module)] for layer in model.layers]


def _rope_owners(model: nn.Module) -> list[nn.Module] | None:
    """Each layer's module holding its `rope`, or None when a layer does not hold exactly one."""
    found = _owners_per_layer(model)
    return [o[0] for o in found] if all(len(o) == 1 for o in found) else None


def _hybrid_rope_owners(model: nn.Module, attention_leaves: int) -> list[nn.Module] | None:
    """A hybrid's: one per attention leaf, in order (its recurrent layers hold none), or None."""
    found = _owners_per_layer(model)
    flat = [m for o in found for m in o]
    return flat if all(len(o) <= 1 for o in found) and flat and len(flat) == attention_leaves else None


def _view_ropes(owners: list[nn.Module]) -> list[ViewRoPE]:
    """Each owner's rope as a ViewRoPE (no parameters move), wrapped where it is not (yet, or any more: a loader
    may set a rope after the model is built, as GGUF's frequency factors do)."""
    for owner in owners:
        if not isinstance(owner["rope"], ViewRoPE):
            owner.rope = ViewRoPE(owner["rope"])
    return [owner["rope"] for owner in owners]


class _Passthrough:
    """Stands in for a model's backbone inside its own `__call__`: returns the hidden states it is given, so the
    family's head (tied or not, its scaling, its soft cap) runs as mlx-lm wrote it."""

    def __init__(self, inner: Any, backbone: str, hidden: mx.array):
        self._inner, self._backbone, self._hidden = inner, backbone, hidden

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._inner, name)
        return _Backbone(value, self._hidden) if name == self._backbone else value


class _Backbone:
    def __init__(self, module: Any, hidden: mx.array):
        self._module, self._hidden = module, hidden

    def __call__(self, *args: Any, **kwargs: Any) -> mx.array:
        return self._hidden

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


_BACKBONES = ("model", "transformer", "language_model", "backbone")  # where mlx-lm's classes keep the decoder


def backbone_name(model: nn.Module) -> str | None:
    """The child of `model` its `__call__` runs before the head (embeddings, layers, final norm)."""
    return next((n for n in _BACKBONES if isinstance(model.get(n), nn.Module)), None)


class AdaptedModel(nn.Module):
    """An mlx-lm model class behind the interface of ours (`models.llama.Model`): `model(inputs, views)` ->
    final hidden states, `logits(h)`, `args` with the KV shape."""

    def __init__(self, inner: nn.Module, shape: KVShape):
        super().__init__()
        self.inner = inner
        self.backbone = backbone_name(inner)
        self.model_type = getattr(inner, "model_type", None)
        self.args = EngineArgs(len(inner.layers), shape.num_kv_heads, shape.head_dim, shape.windows)
        self.routing = MoERouting.of(inner)
        object.__setattr__(self, "layout", list(shape.layout))
        # per cache leaf: a state leaf's spec (`kv.state`), None for an attention leaf; () without state leaves
        object.__setattr__(self, "state_leaves", shape.states if any(s is not None for s in shape.states) else ())
        owners = _hybrid_rope_owners(inner, len(shape.windows)) if self.state_leaves else _rope_owners(inner)
        object.__setattr__(self, "_rope_owners", owners)  # a plain attribute, not a child
        self.packs = self._rope_owners is not None  # packed forwards (decode rows and prefill chunks in one)
        if self.state_leaves and self.packs:  # a recurrent mixer runs a packed forward's parts one by one
            from mlx_engine.models.hybrid import segment_mixers

            segment_mixers(inner.layers)

    @property
    def layers(self) -> list[nn.Module]:
        return self.inner.layers

    def __call__(self, inputs: mx.array, cache: list[Any] | None = None) -> mx.array:
        if cache is None:
            from mlx_engine.kv.contiguous import Uncached

            cache = [Uncached(w) for w in self.args.layer_windows()]
        attention = cache if not self.state_leaves or len(cache) != len(self.state_leaves) else \
            [v for v, s in zip(cache, self.state_leaves) if s is None]
        if self.routing is not None:
            self.routing.begin(_decode_rows(attention[0], inputs))
        ropes = _view_ropes(self._rope_owners) if self.packs else []
        for rope, view in zip(ropes, attention):
            rope.view = view
        from mlx_engine.models.hybrid import layer_caches, write_back

        caches, pending = layer_caches(self.layout, cache, ViewCache)
        try:
            out = getattr(self.inner, self.backbone)(inputs, caches)
        finally:  # the graph is built: the ropes' positions are in it
            for rope in ropes:
                rope.view = None
        write_back(pending)  # the state leaves' new entries into their slots (lazy, in the same graph)
        return out

    def logits(self, h: mx.array) -> mx.array:
        return type(self.inner).__call__(_Passthrough(self.inner, self.backbone, h), h)


def adapt(model: nn.Module) -> tuple[nn.Module, str | None]:
    """(`model` on the engine's views, None), or (`model` as it was, why its KV cannot be paged)."""
    shape, why = paging_problem(model)
    if shape is None:
        return model, why
    return AdaptedModel(model, shape), None


# --- mixture of experts ---------------------------------------------------------------------------------------


def _recording(cls: type) -> type:
    class Recording(cls):
        """mlx-lm's expert block that hands the router's choices to the model's `MoERouting` first."""

        def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
            log = self.__dict__.get("_routing_log")  # set by MoERouting; not a parameter
            if log is not None:
                log(self, indices)
            return super().__call__(x, indices)

    Recording.__name__ = Recording.__qualname__ = cls.__name__
    return Recording


_RECORDING: dict[type, type] = {}


class MoERouting:
    """The experts each decode step of a mixture-of-experts model routes to, per layer, over its batch.

    A step's router indices stay lazy arrays in the step's graph (no host sync in decoding); `steps()` reads
    them when asked, after the step has been evaluated. The last `keep` decode steps are kept."""

    def __init__(self, blocks: list[nn.Module], shape: MoEShape, keep: int = 4096):
        self.blocks, self.shape = blocks, shape
        self._index = {id(b): i for i, b in enumerate(blocks)}
        self._steps: deque[list[mx.array | None]] = deque(maxlen=keep)
        self._decode_rows: deque[int] = deque(maxlen=keep)
        self._current: list[mx.array | None] | None = None
        for b in blocks:
            object.__setattr__(b, "_routing_log", self._log)

    @classmethod
    def of(cls, model: nn.Module) -> MoERouting | None:
        from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP

        blocks = []
        for _, m in model.named_modules():
            if isinstance(m, (SwitchGLU, SwitchMLP)):
                base = type(m) if type(m) not in _RECORDING.values() else type(m).__mro__[1]
                m.__class__ = _RECORDING.setdefault(base, _recording(base))
                blocks.append(m)
        if not blocks:
            return None
        blocks.reverse()  # named_modules lists the deepest last: layers in order after reversing
        blocks.sort(key=lambda b: _layer_index(model, b))
        return cls(blocks, MoEShape(expert_bytes=tuple(_expert_bytes(b) for b in blocks),
                                    num_experts=tuple(b.gate_proj.num_experts if hasattr(b, "gate_proj")
                                                      else b.fc1.num_experts for b in blocks),
                                    experts_per_token=_top_k(model)))

    def begin(self, decode_rows: int) -> None:
        """A forward starts whose first `decode_rows` rows (of its tokens in order) are decode rows: a
        forward with any is a decode step and its routing is recorded; a prefill's is not."""
        self._current = [None] * len(self.blocks) if decode_rows else None
        if decode_rows:
            self._steps.append(self._current)
            self._decode_rows.append(decode_rows)

    def _log(self, block: nn.Module, indices: mx.array) -> None:
        if self._current is not None:
            self._current[self._index[id(block)]] = indices

    def steps(self) -> list[tuple[int, list[list[list[int]]]]]:
        """Each recorded decode step (oldest first): (its decode rows, per MoE layer per row of the forward the
        experts the router chose for that row, sorted). The decode rows come first; a packed step's prefill
        rows follow them (they are read in the same step)."""
        out = []
        for rows, step in zip(self._decode_rows, self._steps):
            if any(i is None for i in step):
                continue  # a step whose forward did not reach every layer (failed)
            mx.eval(step)
            out.append((rows, [[sorted(row) for row in i.reshape(-1, i.shape[-1]).tolist()] for i in step]))
        return out

    def report(self, weight_bytes: int) -> dict[str, Any]:
        """The recorded steps: each row's choices, their union per layer and the bytes the step reads
        (`weight_bytes`: the weights a token reads, every expert included)."""
        steps = []
        for decode_rows, rows in self.steps():
            union = [sorted({e for row in layer for e in row}) for layer in rows]
            steps.append({"rows": rows, "decode_rows": decode_rows, "experts": union,
                          "bytes": moe_step_bytes(weight_bytes, self.shape, union)})
        return {
            "expert_bytes": list(self.shape.expert_bytes),
            "num_experts": list(self.shape.num_experts),
            "experts_per_token": self.shape.experts_per_token,
            "shared_bytes": weight_bytes - self.shape.all_experts_bytes,
            "steps": steps,
        }

    def clear(self) -> None:
        self._steps.clear()
        self._decode_rows.clear()


def _decode_rows(view: Any, inputs: mx.array) -> int:
    """How many of a forward's rows (its tokens in order) decode: a decode step's all, a packed forward's
    leading decode rows, a prefill chunk's none; on other views (contiguous), one token per row decodes."""
    from mlx_engine.kv.views import PackedView, PagedDecodeView, PagedPrefillView

    if isinstance(view, PackedView):
        return view.num_decode if view.decode is not None else 0
    if isinstance(view, PagedDecodeView):
        return inputs.shape[0]
    if isinstance(view, PagedPrefillView):
        return 0
    return inputs.shape[0] if inputs.shape[1] == 1 else 0


def _layer_index(model: nn.Module, block: nn.Module) -> int:
    for i, layer in enumerate(model.layers):
        if any(m is block for _, m in layer.named_modules()):
            return i
    return len(model.layers)


def _expert_bytes(block: nn.Module) -> int:
    """Bytes of one expert of `block`: its stacked projections (weights, biases, quantization scales) over E."""
    from mlx.utils import tree_flatten

    total = sum(v.nbytes for _, v in tree_flatten(block.parameters()))
    experts = block.gate_proj.num_experts if hasattr(block, "gate_proj") else block.fc1.num_experts
    return total // experts


def _top_k(model: nn.Module) -> int:
    args = getattr(model, "args", None)
    text = getattr(args, "text_config", None) or {}  # a text model under a multimodal config (qwen3_5_moe)
    for name in ("num_experts_per_tok", "num_experts_per_token", "top_k", "moe_top_k"):
        if getattr(args, name, None):
            return int(getattr(args, name))
        if text.get(name):
            return int(text[name])
    raise ValueError(f"{type(model).__module__}: no experts-per-token field in its ModelArgs")
