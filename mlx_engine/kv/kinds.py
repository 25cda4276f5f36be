"""A paged KV cache for a model whose layers attend differently: one `kv.cache.PagedCache` per kind of layer (its
sliding window, or full attention), each with its own storage and block pool, behind the one `KVCache` contract.

Gemma 2/3 and gpt-oss alternate sliding and global layers, qwen2 slides from `max_window_layers` on: a sliding
layer's blocks go back to its pool once they left the window (`kv.manager`), a global layer's stay. Each kind's
views come back in the model's layer order, so a layer attends through its own kind's view and never asks which.

Sizing: by default a kind's pool gets `kv.config.default_blocks` (a sliding kind: the windows of several requests,
not a full context); a given budget is split in proportion to what one request of the full context holds in each
kind (a sliding kind: its window's blocks and one step's, `BlockTables.blocks_for`). The scheduler's admission counts one number of
blocks, so `blocks_for`, `num_free_blocks` and `num_blocks_held` report in units of the first kind's blocks, each
kind's figure scaled by the pools' ratio, the tightest kind counting (needs rounded up, what is free rounded down).
A prompt's cached prefix is the longest every kind holds (`start`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import mlx.core as mx

from mlx_engine.api import RooflineError
from mlx_engine.kv.cache import NO_WINDOWED_FILES, PagedCache
from mlx_engine.kv.config import DEFAULT_MEMORY_FRACTION, KVConfig, available_memory_bytes, default_blocks
from mlx_engine.kv.manager import cdiv
from mlx_engine.kv.paged import bytes_per_block
from mlx_engine.kv.protocol import KVCapabilities
from mlx_engine.kv.tables import KVBudgetError, window_blocks


class LayerKindsCache:
    def __init__(self, kinds: list[PagedCache], layers: list[list[int]]):
        """kinds[i] serves the model's layers `layers[i]` (its local layer j is the model's layers[i][j])."""
        order = sorted(i for group in layers for i in group)
        if order != list(range(len(order))) or len(kinds) != len(layers) or not kinds:
            raise ValueError(f"layer kinds {layers}: expected every layer 0..n-1 in exactly one kind")
        for cache, group in zip(kinds, layers):
            if cache.num_layers != len(group):
                raise ValueError(f"a kind of {cache.num_layers} layers serves layers {group}")
        self.kinds, self.layers, self.num_layers = kinds, layers, len(order)
        self.windows = [c.window for c in kinds]
        caps = [c.capabilities for c in kinds]
        self.capabilities = KVCapabilities(paged=True, batching=True, packed=True, rollback=True,
                                           kv_files=all(c.kv_files for c in caps),
                                           prefix_caching=all(c.prefix_caching for c in caps),
                                           quantized=caps[0].quantized)
        self._unit = [kinds[0].tables.storage.num_blocks / c.tables.storage.num_blocks for c in kinds]

    @classmethod
    def create(cls, *, layer_windows: list[int | None], num_kv_heads: int, head_dim: int, dtype: mx.Dtype,
               context_length: int, weight_bytes: int, config: KVConfig, model_id: bytes,
               max_step_tokens: int | None = None) -> LayerKindsCache | PagedCache:
        """Per layer its sliding window (None: full attention); one kind's layers alike get a plain `PagedCache`.
        Pools sized as the module docstring says."""
        config.validate(head_dim)
        # full attention first (admission counts in its blocks), then the windows as the layers have them
        windows = sorted(dict.fromkeys(layer_windows), key=lambda w: w is not None)
        if len(windows) == 1:
            return PagedCache.create(num_layers=len(layer_windows), num_kv_heads=num_kv_heads, head_dim=head_dim,
                                     dtype=dtype, context_length=context_length, weight_bytes=weight_bytes,
                                     config=config, model_id=model_id, window=windows[0],
                                     max_step_tokens=max_step_tokens)
        layers = [[i for i, w in enumerate(layer_windows) if w == window] for window in windows]
        per_layer = bytes_per_block(1, config.block_size, num_kv_heads, head_dim, dtype.size, config.kv_bits,
                                    config.kv_group_size, config.kv_key_bits, config.key_per_channel(head_dim))
        full = cdiv(context_length, config.block_size)
        # blocks one request of the full context holds in each kind
        need = [min(full, window_blocks(w, max_step_tokens, config.block_size) or full) for w in windows]
        bytes_of = [len(group) * per_layer for group in layers]  # a block of each kind, its layers
        budget = config.kv_budget_bytes
        if budget is None:  # `kv.config.default_blocks` per kind, within half the free memory
            blocks = [default_blocks(context_length, config.block_size, window_blocks(w, max_step_tokens,
                                                                                       config.block_size))
                      for w in windows]
            cap = int(available_memory_bytes(weight_bytes) * DEFAULT_MEMORY_FRACTION)
            total = sum(n * b for n, b in zip(blocks, bytes_of))
            blocks = [int(n * min(1.0, cap / total)) for n in blocks]
        else:  # as one request of the full context holds blocks in each kind
            requests = budget / sum(n * b for n, b in zip(need, bytes_of))
            blocks = [int(requests * n) for n in need]
        kinds = []
        for group, window, num_blocks in zip(layers, windows, blocks):
            if num_blocks < 1:
                raise RooflineError(f"kv_budget_bytes={budget or 'default'}: too small for one KV block of each "
                                    f"kind of layer ({per_layer * len(group)} bytes for the {len(group)} layers "
                                    f"with window {window})")
            kinds.append(PagedCache.of_blocks(len(group), num_blocks, num_kv_heads, head_dim, dtype, config, model_id,
                                              window, max_step_tokens))
        return cls(kinds, layers)

    def _in_order(self, views: list[list[Any]]) -> list[Any]:
        out: list[Any] = [None] * self.num_layers
        for group, vs in zip(self.layers, views):
            for i, v in zip(group, vs):
                out[i] = v
        return out

    # --- admission, in the first kind's blocks ---

    def check_fits(self, num_tokens: int) -> None:
        for cache in self.kinds:
            cache.check_fits(num_tokens)

    def blocks_for(self, num_tokens: int) -> int:
        return max(math.ceil(c.blocks_for(num_tokens) * u) for c, u in zip(self.kinds, self._unit))

    def num_free_blocks(self) -> int:
        return min(int(c.num_free_blocks() * u) for c, u in zip(self.kinds, self._unit))

    def num_blocks_held(self, req_id: str) -> int:
        return min(int(c.num_blocks_held(req_id) * u) for c, u in zip(self.kinds, self._unit))

    # --- requests ---

    def start(self, req_id: str, prompt_ids: list[int], reuse: bool = True) -> int:
        """Every kind starts the request from the longest prefix all of them hold cached (a sliding kind needs only
        its window's blocks before it, so the kinds' own hits differ)."""
        common = None
        if reuse:
            while True:
                hits = [c.tables.cached_tokens(prompt_ids, common) for c in self.kinds]
                if min(hits) == max(hits):
                    common = hits[0]
                    break
                common = min(hits)
        started: list[PagedCache] = []
        try:
            for cache in self.kinds:
                cached = cache.tables.start(req_id, prompt_ids, reuse, common)
                started.append(cache)
                if reuse and cached != common:  # what the look saw was evicted since: nothing is
                    raise KVBudgetError(f"{req_id}: a cached prefix changed while it started")
        except Exception:
            for cache in started:
                cache.free(req_id)
            raise
        return common or 0

    def allocate(self, req_id: str, token_ids: list[int], num_new_tokens: int) -> None:
        for cache in self.kinds:
            cache.allocate(req_id, token_ids, num_new_tokens)

    def trim(self, req_id: str, num_tokens: int) -> None:
        for cache in self.kinds:
            cache.trim(req_id, num_tokens)

    def prefill_layers(self, req_id: str, start: int, end: int) -> list[Any]:
        return self._in_order([c.prefill_layers(req_id, start, end) for c in self.kinds])

    def decode_layers(self, req_ids: list[str], known_ids: list[list[int]]) -> list[Any]:
        return self._in_order([c.decode_layers(req_ids, known_ids) for c in self.kinds])

    def packed_layers(self, decode_ids: list[str], known_ids: list[list[int]],
                      chunks: list[tuple[str, int, int]]) -> list[Any]:
        return self._in_order([c.packed_layers(decode_ids, known_ids, chunks) for c in self.kinds])

    def state(self, layers: list[Any]) -> list[mx.array]:
        return [a for c in self.kinds for a in c.storage.arrays()]

    def record(self, req_id: str, known_ids: list[int]) -> None:
        for cache in self.kinds:
            cache.record(req_id, known_ids)

    def finish(self, req_id: str, fed_ids: list[int]) -> None:
        for cache in self.kinds:
            cache.finish(req_id, fed_ids)

    def free(self, req_id: str) -> None:
        for cache in self.kinds:
            cache.free(req_id)

    def drop_request(self, req_id: str) -> None:
        for cache in self.kinds:
            cache.drop_request(req_id)

    def drop(self) -> None:
        for cache in self.kinds:
            cache.drop()

    def calibrate(self, model: Any, tokenizer: Any, vocab_size: int) -> None:
        """Quantized KV: the model's smoothing, measured once, each kind given its layers'."""
        if self.kinds[0].storage.bits is None:
            return
        from mlx_engine.kv.smoothing import calibrate

        sm = calibrate(model, tokenizer, vocab_size)
        for cache, group in zip(self.kinds, self.layers):
            cache.storage.set_smoothing(dataclasses.replace(sm, key_offset=sm.key_offset[group],
                                                            key_scale=sm.key_scale[group],
                                                            value_offset=sm.value_offset[group]))

    def check_kernels(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(w for c in self.kinds for w in c.check_kernels()))

    def stats(self) -> dict[str, Any]:
        """The kinds' counts summed (blocks of different kinds hold other layers: `kinds` has each one's)."""
        each = [c.stats() for c in self.kinds]
        out = dict(each[0])
        for key in ("num_blocks", "used", "cached", "free", "bytes_total", "bytes_budget", "bytes_used",
                    "bytes_staging"):
            out[key] = sum(s[key] for s in each)
        out["usage"] = out["used"] / out["num_blocks"]
        out["bytes_per_block"] = sum(s["bytes_per_block"] for s in each)
        out["kinds"] = [{"window": w, "layers": g, **s} for w, g, s in zip(self.windows, self.layers, each)]
        return out

    def save(self, path: str, token_ids: list[int], fingerprint: bytes) -> int:
        raise RooflineError(NO_WINDOWED_FILES)

    def restore(self, path: str, fingerprint: bytes) -> list[int]:
        raise RooflineError(NO_WINDOWED_FILES)
