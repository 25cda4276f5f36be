"""A paged cache's block bookkeeping over its storage, shared by the MLX and torch caches (each holds one).

The manager (`kv.manager.KVCacheManager`, pure Python) keeps the block tables; this class asks it for room, and
makes the storage (`kv.protocol.KVStorage`) follow: grow to the block ids handed out, perform the copy-on-write
copies the manager queued, release what a request kept beside its blocks. The caches build their views on the
tables kept here.

With a sliding window (`manager.window`) a request's slots are taken per forward rather than all at `start` or
`allocate` (`take`, the caches' views call it): a long prompt prefilled in chunks then holds the window and one
chunk, not the whole prompt. `max_step_tokens`, the most new tokens one forward of a request feeds (the scheduler's
token budget), bounds what a request holds at once (`blocks_for`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mlx_engine.api import RequestError
from mlx_engine.kv.manager import KVCacheManager, cdiv
from mlx_engine.kv.protocol import KVStorage


class KVBudgetError(RequestError):
    """A request whose KV cannot fit the pool."""


def window_blocks(window: int | None, max_step_tokens: int | None, block_size: int) -> int | None:
    """The most blocks a request holds with a sliding window: its window's before one step, and the step's (None:
    unbounded, without a window or a known largest step)."""
    if window is None or max_step_tokens is None:
        return None
    return cdiv(window - 1 + max_step_tokens, block_size) + 1


class BlockTables:
    def __init__(self, manager: KVCacheManager, storage: KVStorage, bytes_per_block: int,
                 max_step_tokens: int | None = None):
        self.manager, self.storage, self.bytes_per_block = manager, storage, bytes_per_block
        self.block_size = manager.block_size
        self.max_step_tokens = max_step_tokens
        # sliding window: per request, its tokens and how many its slots are to hold once taken (`take`)
        self._pending: dict[str, tuple[Sequence[int], int]] = {}

    @property
    def capacity_tokens(self) -> int:
        return self.storage.num_blocks * self.block_size

    def check_fits(self, num_tokens: int) -> None:
        need = self.blocks_for(num_tokens)
        if need > self.storage.num_blocks:
            raise KVBudgetError(
                f"this request needs KV for {num_tokens} tokens ({need * self.bytes_per_block:,} bytes) but the KV "
                f"budget holds {self.capacity_tokens} tokens ({self.storage.num_blocks * self.bytes_per_block:,} "
                "bytes); raise kv_budget_bytes, use kv_bits=8, or shorten the prompt"
            )

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks a request of `num_tokens` holds at its longest: with a sliding window and a known largest step,
        the blocks of a window before one step's tokens, and those tokens."""
        return min(cdiv(num_tokens, self.block_size),
                   window_blocks(self.manager.window, self.max_step_tokens, self.block_size) or num_tokens)


    def num_free_blocks(self) -> int:
        return self.manager.pool.get_num_free_blocks()

    def num_blocks_held(self, req_id: str) -> int:
        return self.manager.num_blocks_held(req_id)

    # --- allocation ---

    def cached_tokens(self, prompt_ids: list[int], max_tokens: int | None = None) -> int:
        """The prompt tokens `start` would find cached, at most `max_tokens` (nothing taken or counted)."""
        return self.manager.get_computed_blocks(prompt_ids, max_tokens, count=False)[1]

    def start(self, req_id: str, prompt_ids: list[int], reuse: bool = True, max_cached: int | None = None) -> int:
        """Allocates a new sequence's prompt blocks, the cached prefix's (prefix caching, at most `max_cached`
        tokens of it) shared unless `reuse` is False; returns the number of prompt tokens already cached."""
        computed, num_cached = self.manager.get_computed_blocks(prompt_ids, max_cached) if reuse else ([], 0)
        now = 0 if self.manager.window is not None else len(prompt_ids) - num_cached  # windowed: at `take`
        if self.manager.allocate_slots(req_id, prompt_ids, now, computed) is None:
            raise KVBudgetError(f"no free KV blocks for a {len(prompt_ids)}-token prompt")
        if self.manager.window is not None:
            self._pending[req_id] = (prompt_ids, len(prompt_ids))
        self._grow(req_id)
        self._copy_pending()
        return num_cached

    def allocate(self, req_id: str, token_ids: Sequence[int], num_new_tokens: int) -> None:
        if self.manager.window is not None:
            have = self._pending[req_id][1] if req_id in self._pending else self.manager.num_tokens(req_id)
            self._pending[req_id] = (token_ids, have + num_new_tokens)
            return
        self._allocate(req_id, token_ids, num_new_tokens)
        self._copy_pending()

    def take(self, req_id: str, end: int) -> None:
        """Slots for the request's positions up to `end` (a forward's), from what `start` or `allocate` promised it
        (sliding window; a no-op otherwise, where those took them)."""
        pending = self._pending.get(req_id)
        if pending is None:
            return
        token_ids, target = pending
        have = self.manager.num_tokens(req_id)
        if end > target:
            raise ValueError(f"{req_id}: a forward up to position {end}, but it was allocated {target} tokens")
        if end > have:
            # a promise with tokens still unknown (a verification's drafts) is taken whole: the slots of tokens
            # nobody knows yet cannot be checked against them one forward at a time
            upto = end if len(token_ids) >= target else target
            self._allocate(req_id, token_ids, upto - have)
            self._copy_pending()
        if self.manager.num_tokens(req_id) >= target:
            del self._pending[req_id]

    def _allocate(self, req_id: str, token_ids: Sequence[int], num_new_tokens: int) -> None:
        if self.manager.allocate_slots(req_id, token_ids, num_new_tokens) is None:
            raise KVBudgetError(f"the KV pool is full ({self.storage.num_blocks} blocks of {self.block_size})")
        self._grow(req_id)

    def decode_positions(self, req_ids: list[str], known_ids: list[list[int]]) -> list[int]:
        """One slot more for each sequence (a decode step); returns the positions of their new tokens."""
        for req in req_ids:  # what a windowed request was promised comes before its next token
            if req in self._pending:
                self.take(req, self._pending[req][1])
        positions = [self.manager.num_tokens(r) for r in req_ids]
        for req, known in zip(req_ids, known_ids):
            self._allocate(req, known, 1)
        self._copy_pending()
        return positions

    def _grow(self, req_id: str) -> None:
        table = self.manager.block_table(req_id)
        if table:
            self.storage.ensure_capacity(max(table) + 1)

    def _copy_pending(self) -> None:
        if self.manager.pending_copies:
            self.storage.ensure_capacity(max(max(p) for p in self.manager.pending_copies) + 1)
            self.storage.copy_blocks(self.manager.pending_copies)
            self.manager.pending_copies.clear()

    def trim(self, req_id: str, num_tokens: int) -> None:
        pending = self._pending.pop(req_id, None)
        have = self.manager.num_tokens(req_id)
        if pending is not None and have <= num_tokens <= pending[1]:  # a promise not taken yet: shrink it
            if num_tokens > have:
                self._pending[req_id] = (pending[0], num_tokens)
            return
        if pending is not None and num_tokens > pending[1]:
            raise ValueError(f"trim {req_id} to {num_tokens} tokens: it holds {pending[1]}")
        self.manager.trim(req_id, num_tokens)

    # --- leaving ---

    def record(self, req_id: str, known_ids: list[int]) -> None:
        self.manager.cache_full_blocks(req_id, known_ids)

    def free(self, req_id: str) -> None:
        self._pending.pop(req_id, None)
        self.manager.free(req_id)
        self.storage.release(req_id)

    def drop(self) -> None:
        self._pending.clear()
        for req in list(self.manager.req_to_blocks):
            self.manager.free(req)
        self.storage.release(None)

    def drop_request(self, req_id: str) -> None:
        """After a failed step: free the request's blocks and forget the prefix hashes they carried."""
        blocks = list(self.manager.req_to_blocks.get(req_id, []))
        self.free(req_id)
        for block in blocks:
            if block.ref_cnt == 0 and block.block_hash is not None:
                self.manager.pool.evict_cached_block(block)

    def stats(self) -> dict[str, Any]:
        s = self.manager.stats()
        s.update(kind="paged", bytes_per_block=self.bytes_per_block, bytes_total=self.storage.nbytes,
                 bytes_budget=self.storage.num_blocks * self.bytes_per_block,
                 bytes_used=s["used"] * self.bytes_per_block, **self.storage.format_stats())
        return s


class BlockTableCache:
    """The `KVCache` methods a paged cache serves from its block bookkeeping (`self.tables`): the MLX and the torch
    cache each hold a `BlockTables` over their storage and add their storage's views; neither overrides these."""

    tables: BlockTables

    @property
    def bytes_per_block(self) -> int:
        return self.tables.bytes_per_block

    @property
    def capacity_tokens(self) -> int:
        return self.tables.capacity_tokens

    def check_fits(self, num_tokens: int) -> None:
        self.tables.check_fits(num_tokens)

    def blocks_for(self, num_tokens: int) -> int:
        return self.tables.blocks_for(num_tokens)

    def num_free_blocks(self) -> int:
        return self.tables.num_free_blocks()

    def num_blocks_held(self, req_id: str) -> int:
        return self.tables.num_blocks_held(req_id)

    def start(self, req_id: str, prompt_ids: list[int], reuse: bool = True) -> int:
        return self.tables.start(req_id, prompt_ids, reuse)

    def allocate(self, req_id: str, token_ids: list[int], num_new_tokens: int) -> None:
        self.tables.allocate(req_id, token_ids, num_new_tokens)

    def trim(self, req_id: str, num_tokens: int) -> None:
        self.tables.trim(req_id, num_tokens)

    def record(self, req_id: str, known_ids: list[int]) -> None:
        self.tables.record(req_id, known_ids)

    def finish(self, req_id: str, fed_ids: list[int]) -> None:
        self.tables.free(req_id)

    def free(self, req_id: str) -> None:
        self.tables.free(req_id)

    def drop(self) -> None:
        self.tables.drop()

    def drop_request(self, req_id: str) -> None:
        self.tables.drop_request(req_id)

    def stats(self) -> dict[str, Any]:
        return self.tables.stats()
