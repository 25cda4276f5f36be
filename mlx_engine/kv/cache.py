"""The MLX paged KV cache: one block pool for every running sequence (continuous batching, prefix caching across
requests, quantized KV, a fixed memory budget, KV files), through the `kv.protocol.KVCache` contract.

The block bookkeeping is a `kv.tables.BlockTables` it holds (as the torch cache does), served through
`BlockTableCache`'s methods; this class adds the MLX storage (`kv.paged`), the views a model layer attends through
(`kv.views`) and the KV files (`kv.files`).

A sliding window (`window`: every layer of this cache attends through it) releases each sequence's blocks once they
left its window (`kv.manager`), so a long chat holds at most about window / block_size + 1 blocks per sequence; views
then read from the window's first block on. KV files are off there (the blocks before the window are gone).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from mlx_engine.api import RooflineError
from mlx_engine.kv.block_pool import BlockPool
from mlx_engine.kv.config import KVConfig, blocks_in_budget, default_budget
from mlx_engine.kv.manager import KVCacheManager
from mlx_engine.kv.paged import PagedKVStorage, bytes_per_block
from mlx_engine.kv.protocol import KVCapabilities
from mlx_engine.kv.tables import BlockTableCache, BlockTables, KVBudgetError, window_blocks
from mlx_engine.kv.views import DecodeStep, PackedView, PagedDecodeView, PagedPrefillView

__all__ = ["KVBudgetError", "PagedCache"]

NO_WINDOWED_FILES = ("KV files are not available for a model with sliding-window layers: their blocks before the "
                     "window are released")
MAX_SLOT_RUNS = 8  # on the CPU, a sequence in at most this many runs of blocks is attended in place (`_slots`)


class PagedCache(BlockTableCache):
    def __init__(self, storage: PagedKVStorage, manager: KVCacheManager, num_layers: int, bytes_per_block: int,
                 max_step_tokens: int | None = None):
        if storage.window != manager.window:
            raise ValueError(f"the storage's window {storage.window} is not the block manager's {manager.window}")
        self.storage, self.manager, self.num_layers = storage, manager, num_layers
        self.window = storage.window
        self.tables = BlockTables(manager, storage, bytes_per_block, max_step_tokens)
        self.block_size = manager.block_size
        self.capabilities = KVCapabilities(paged=True, batching=True, packed=True, rollback=True,
                                           kv_files=self.window is None,
                                           prefix_caching=manager.pool.enable_caching,
                                           quantized=storage.bits is not None)

    @classmethod
    def create(cls, *, num_layers: int, num_kv_heads: int, head_dim: int, dtype: mx.Dtype, context_length: int,
               weight_bytes: int, config: KVConfig, model_id: bytes, window: int | None = None,
               max_step_tokens: int | None = None) -> PagedCache:
        """A cache for `num_layers` layers of one kind: `window` the sliding window they all attend through (None:
        full attention). `max_step_tokens`: the most tokens one forward feeds a request (the scheduler's token
        budget), which bounds a windowed request's blocks (`BlockTables.blocks_for`); None: not bounded."""
        config.validate(head_dim)
        per_block = bytes_per_block(num_layers, config.block_size, num_kv_heads, head_dim, dtype.size,
                                    config.kv_bits, config.kv_group_size, config.kv_key_bits,
                                    config.key_per_channel(head_dim))
        budget = config.kv_budget_bytes
        if budget is None:
            budget = default_budget(context_length, config.block_size, per_block, weight_bytes,
                                    window_blocks(window, max_step_tokens, config.block_size))
        num_blocks = blocks_in_budget(budget, per_block, config.block_size, num_layers)
        return cls.of_blocks(num_layers, num_blocks, num_kv_heads, head_dim, dtype, config, model_id, window,
                             max_step_tokens)

    @classmethod
    def of_blocks(cls, num_layers: int, num_blocks: int, num_kv_heads: int, head_dim: int, dtype: mx.Dtype,
                  config: KVConfig, model_id: bytes, window: int | None = None,
                  max_step_tokens: int | None = None) -> PagedCache:
        """A cache of `num_blocks` blocks (`create` sizes them from a budget)."""
        per_block = bytes_per_block(num_layers, config.block_size, num_kv_heads, head_dim, dtype.size,
                                    config.kv_bits, config.kv_group_size, config.kv_key_bits,
                                    config.key_per_channel(head_dim))
        storage = PagedKVStorage(num_layers, num_blocks, config.block_size, num_kv_heads, head_dim, dtype,
                                 config.kv_bits, config.kv_group_size, key_bits=config.kv_key_bits,
                                 key_per_channel=config.key_per_channel(head_dim), window=window)
        manager = KVCacheManager(BlockPool(num_blocks, enable_caching=config.prefix_caching), config.block_size,
                                 extra_key=model_id, window=window)
        return cls(storage, manager, num_layers, per_block, max_step_tokens)

    def calibrate(self, model: Any, tokenizer: Any, vocab_size: int) -> None:
        """Quantized KV only: measures the model's KV smoothing (`kv.smoothing`) on the built-in calibration
        text, one short forward, before anything is stored."""
        if self.storage.bits is None:
            return
        from mlx_engine.kv.smoothing import calibrate

        self.storage.set_smoothing(calibrate(model, tokenizer, vocab_size))

    # --- views ---

    def prefill_layers(self, req_id: str, start: int, end: int) -> list[PagedPrefillView]:
        """Views for a forward over positions [start, end) of a sequence whose slots are allocated."""
        self.tables.take(req_id, end)
        slots = self.manager.slot_mapping(req_id, start, end)
        new_slots = mx.array(slots, dtype=mx.int32)
        base = self.manager.first_block(start) * self.block_size  # 0 without a window
        all_slots = self._slots(req_id, end, base)
        plan = self.storage.plan_key_writes([(req_id, s) for s in slots])
        table = self.manager.block_table(req_id)
        first = PagedPrefillView(self.storage, 0, start, new_slots, all_slots, plan, table, base=base)
        return [first] + [PagedPrefillView(self.storage, i, start, new_slots, all_slots, plan, table, first.path,
                                           base) for i in range(1, self.num_layers)]

    def _slots(self, req_id: str, n: int, start: int = 0) -> mx.array | list[slice]:
        """Slots start..n - 1 of a sequence for attention that reads them whole: on MLX's CPU backend, when their
        blocks form at most MAX_SLOT_RUNS runs of consecutive ids, one slice per run (read in place: a next turn's
        new blocks rarely follow its cached prefix's, and gathering them every layer and step costs); else their
        ids. A run of per-channel keys must start at a block's first slot: from a later `start`, ids."""
        bs = self.block_size
        table = self.manager.block_table(req_id)[start // bs:-(-n // bs)]
        if not mx.metal.is_available() and not (start % bs and self.storage.key_per_channel):
            starts = [i for i in range(len(table)) if i == 0 or table[i] != table[i - 1] + 1]
            if len(starts) <= MAX_SLOT_RUNS:
                ends = starts[1:] + [len(table)]
                first = start // bs * bs  # the position of the table's first entry here
                return [slice(table[a] * bs + max(start - first - a * bs, 0), table[a] * bs + min(n - first, b * bs)
                              - a * bs) for a, b in zip(starts, ends)]
        return mx.array(self.manager.slot_mapping(req_id, start, n), dtype=mx.int32)

    def decode_layers(self, req_ids: list[str], known_ids: list[list[int]]) -> list[PagedDecodeView]:
        """Views for one decode step: sequence b's next token goes at position num_tokens(b) (allocated
        here; its value may still be unknown to the host, so `known_ids[b]` can stop short of it)."""
        mgr = self.manager
        positions = self.tables.decode_positions(req_ids, known_ids)
        # with a window, each row from the block of its window's first key on (those before may be released)
        firsts = [mgr.first_block(p) for p in positions]
        tables = [mgr.block_table(r)[f:] for r, f in zip(req_ids, firsts)]
        width = max(len(t) for t in tables)
        block_tables = mx.array([t + [0] * (width - len(t)) for t in tables], dtype=mx.int32)  # (B, nb)
        slots = [mgr.slot_mapping(r, p, p + 1)[0] for r, p in zip(req_ids, positions)]
        new_slots = mx.array(slots, dtype=mx.int32)
        plan = self.storage.plan_key_writes(list(zip(req_ids, slots)))
        lens = [p + 1 - f * self.block_size for p, f in zip(positions, firsts)]
        seq_lens = mx.array(lens, dtype=mx.int32)
        offset = mx.array(positions, dtype=mx.int32) if len(positions) > 1 else positions[0]
        all_slots = None
        if len(req_ids) == 1 and not mx.metal.is_available():  # the keys it reads: the window's exactly
            p = positions[0]
            all_slots = self._slots(req_ids[0], p + 1, 0 if self.window is None else max(0, p - self.window + 1))
        step = DecodeStep(self.storage, offset, new_slots, block_tables, seq_lens, max(lens), all_slots, plan)
        return [PagedDecodeView(step, i) for i in range(self.num_layers)]

    def packed_layers(self, decode_ids: list[str], known_ids: list[list[int]],
                      chunks: list[tuple[str, int, int]]) -> list[PackedView]:
        """Views for one forward over packed rows: a decode step of `decode_ids` (as `decode_layers`, may be
        empty), then each (req_id, start, end) prefill chunk (as `prefill_layers`)."""
        decode = self.decode_layers(decode_ids, known_ids) if decode_ids else [None] * self.num_layers
        prefills = [self.prefill_layers(r, a, b) for r, a, b in chunks]
        lengths = [b - a for _, a, b in chunks]
        return [PackedView(decode[i], len(decode_ids), [p[i] for p in prefills], lengths)
                for i in range(self.num_layers)]

    def state(self, layers: list[Any]) -> list[mx.array]:
        return self.storage.arrays()

    def check_kernels(self) -> tuple[str, ...]:
        from mlx_engine.attention import kernel_warnings

        return kernel_warnings(self.storage)

    # --- KV files ---

    def save(self, path: str, token_ids: list[int], fingerprint: bytes) -> int:
        from mlx_engine.kv.files import save_blocks

        if self.window is not None:
            raise RooflineError(NO_WINDOWED_FILES)
        return save_blocks(self.tables, self.storage, path, token_ids, fingerprint)

    def restore(self, path: str, fingerprint: bytes) -> list[int]:
        from mlx_engine.kv.files import restore_blocks

        if self.window is not None:
            raise RooflineError(NO_WINDOWED_FILES)
        return restore_blocks(self.tables, self.storage, path, fingerprint)
