"""The contiguous KV cache: per-layer buffers of one sequence at a time, for models the paged cache does not cover
(mlx-lm's model classes, sliding-window attention). A next request reuses the previous one's prefix by trimming.

For our models each layer's buffer is a view (`ContiguousLayer`: mlx-lm's `KVCache` that ropes and attends), as
the paged cache's are; mlx-lm's classes get mlx-lm's own cache objects, which they drive themselves.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from mlx_engine._mlx_lm import bare_package

bare_package()  # before mlx-lm's cache module: without its package __init__ (mlx_engine._mlx_lm)

from mlx_lm.models.cache import KVCache  # noqa: E402

from mlx_engine.api import RooflineError  # noqa: E402
from mlx_engine.attention import contiguous_attention  # noqa: E402
from mlx_engine.kv.protocol import KVCapabilities  # noqa: E402


class ContiguousLayer(KVCache):
    """One layer's K/V of one sequence in mlx-lm's growing buffer, as a layer's view: rope at its offset, attention
    over what it holds (the last `window` keys of each query, with a sliding window). Trimmable, as mlx-lm's."""

    def __init__(self, window: int | None = None):
        super().__init__()
        self.window = window

    def rope(self, rope: Any, q: mx.array, k: mx.array) -> tuple[mx.array, mx.array]:
        return rope(q, offset=self.offset), rope(k, offset=self.offset)

    def attention(self, q: mx.array, k: mx.array, v: mx.array, scale: float, **scores: Any) -> mx.array:
        """q (B, Hq, L, D), k/v (B, Hkv, L, D) after rope -> (B, Hq, L, D); appends k/v to the buffer."""
        offset = self.offset
        keys, values = self.update_and_fetch(k, v)  # (B, Hkv, offset + L, D)
        return contiguous_attention(q, keys, values, scale, offset, self.window, **scores)


class Uncached:
    """A layer's view that keeps nothing: a forward over a whole sequence from position 0 (hidden states)."""

    offset = 0

    def __init__(self, window: int | None = None):
        self.window = window

    def rope(self, rope: Any, q: mx.array, k: mx.array) -> tuple[mx.array, mx.array]:
        return rope(q, offset=0), rope(k, offset=0)

    def attention(self, q: mx.array, k: mx.array, v: mx.array, scale: float, **scores: Any) -> mx.array:
        return contiguous_attention(q, k, v, scale, 0, self.window, **scores)


def new_contiguous_layers(model: Any, native: bool) -> list[Any]:
    """Empty per-layer buffers: views for our models, mlx-lm's own cache objects for its classes."""
    if native:
        return [ContiguousLayer(w) for w in model.args.layer_windows()]
    from mlx_lm.models.cache import make_prompt_cache

    return make_prompt_cache(model)


def untrimmable_kinds(model: Any, native: bool) -> list[str]:
    """The mlx-lm cache classes of `model` that cannot be trimmed at every length (none for our models)."""
    if native:
        return []
    return sorted({type(c).__name__ for c in new_contiguous_layers(model, native) if type(c) is not KVCache})


class ContiguousCache:
    def __init__(self, model: Any, native: bool):
        self.model, self.native = model, native
        self._layers: list[Any] | None = None
        self._tokens: list[int] = []  # the tokens whose K/V the buffers hold, in order
        self._req: str | None = None  # the request `start` last took the buffers for
        self._side: dict[str, list[Any]] = {}  # other requests, with buffers of their own (`allocate`: scoring)
        self.num_queried = self.num_hit = 0
        self.capabilities = KVCapabilities(paged=False, batching=False, packed=False,
                                           rollback=not untrimmable_kinds(model, native), kv_files=False,
                                           prefix_caching=False, quantized=False)

    def _new(self) -> list[Any]:
        return new_contiguous_layers(self.model, self.native)

    def _trim_layers(self, layers: list[Any], n: int) -> bool:
        from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

        return can_trim_prompt_cache(layers) and trim_prompt_cache(layers, n) == n

    def _trim(self, n: int) -> bool:
        return self._trim_layers(self._layers, n)

    def check_fits(self, num_tokens: int) -> None:
        pass

    def blocks_for(self, num_tokens: int) -> int:
        return 0

    def num_free_blocks(self) -> int:
        return 0

    def num_blocks_held(self, req_id: str) -> int:
        return 0

    def start(self, req_id: str, prompt_ids: list[int], reuse: bool = True) -> int:
        """Keeps the longest common prefix with what the buffers hold (at least the last prompt token
        is recomputed; none unless `reuse`); returns its length."""
        self._req = req_id
        if self._layers is None:
            self._layers, self._tokens = self._new(), []
        n, limit = 0, min(len(prompt_ids) - 1, len(self._tokens)) if reuse else 0
        while n < limit and prompt_ids[n] == self._tokens[n]:
            n += 1
        extra = len(self._tokens) - n
        if extra:
            if self._trim(extra):
                del self._tokens[n:]
            else:
                self._layers, self._tokens, n = self._new(), [], 0
        self.num_queried += len(prompt_ids)
        self.num_hit += n
        return n

    def _of(self, req_id: str) -> list[Any]:
        return self._side.get(req_id, self._layers)

    def allocate(self, req_id: str, token_ids: list[int], num_new_tokens: int) -> None:
        """The running sequence's buffers grow as they are written; another request gets buffers of its own."""
        if req_id != self._req and req_id not in self._side:
            self._side[req_id] = self._new()

    def trim(self, req_id: str, num_tokens: int) -> None:
        layers = self._of(req_id)
        over = layers[0].offset - num_tokens
        if over > 0 and not self._trim_layers(layers, over):
            raise RooflineError(f"this model's KV cache cannot be trimmed by {over} tokens")

    def prefill_layers(self, req_id: str, start: int, end: int) -> list[Any]:
        return self._of(req_id)

    def decode_layers(self, req_ids: list[str], known_ids: list[list[int]]) -> list[Any]:
        if len(req_ids) != 1:
            raise RooflineError("the contiguous KV cache runs one sequence at a time")
        return self._of(req_ids[0])

    def packed_layers(self, decode_ids: list[str], known_ids: list[list[int]],
                      chunks: list[tuple[str, int, int]]) -> list[Any]:
        raise RooflineError("the contiguous KV cache runs one sequence at a time (capabilities.packed is False)")

    def state(self, layers: list[Any]) -> list[Any]:
        return [c.state for c in layers]

    def check_kernels(self) -> tuple[str, ...]:
        return ()  # its attention launches no kernel of ours

    def record(self, req_id: str, known_ids: list[int]) -> None:
        pass

    def finish(self, req_id: str, fed_ids: list[int]) -> None:
        """The buffers may hold one step more than was fed (a pipelined step): trim to `fed_ids`."""
        if req_id in self._side:
            return self.free(req_id)
        # mlx-lm's recurrent caches (its ArraysCache) keep no offset: nothing to trim there
        offset = getattr(self._layers[0], "offset", len(fed_ids)) if self._layers else 0
        over = offset - len(fed_ids)
        if over > 0 and not self._trim(over):
            self._layers, self._tokens = None, []
            return
        self._tokens = list(fed_ids)

    def free(self, req_id: str) -> None:
        self._side.pop(req_id, None)

    def drop(self) -> None:
        self._layers, self._tokens = None, []
        self._side.clear()

    def drop_request(self, req_id: str) -> None:
        if req_id in self._side:
            return self.free(req_id)
        self._layers, self._tokens = None, []

    def calibrate(self, model: Any, tokenizer: Any, vocab_size: int) -> None:
        pass  # unquantized

    def stats(self) -> dict[str, Any]:
        return {"kind": "contiguous", "num_tokens": len(self._tokens), "num_queried_tokens": self.num_queried,
                "num_hit_tokens": self.num_hit,
                "hit_rate": self.num_hit / self.num_queried if self.num_queried else 0.0}

    def save(self, path: str, token_ids: list[int], fingerprint: bytes) -> int:
        raise RooflineError("saving KV needs the paged KV cache, which this model does not use")

    def restore(self, path: str, fingerprint: bytes) -> list[int]:
        raise RooflineError("restoring KV needs the paged KV cache, which this model does not use")
