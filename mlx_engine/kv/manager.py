"""The KV cache manager: block tables per sequence, prefix hits, copy-on-write, rollback.

After vLLM v1's `kv_cache_manager.py`, single attention type, no lookahead slots. Pure Python; the
storage (`paged.py`) follows the tables this file keeps, and performs the copies it asks for.

Per sequence the manager keeps the block table, the number of tokens the table holds, and the hash
chain of its full blocks. Invariant after every call: len(table) == ceil(num_tokens / block_size).

Copy-on-write contract with the storage: `allocate_slots` may replace a sequence's last block (a
partial block shared by a fork, or a cached block that a trim made partial again) by a fresh one and
append (src_block_id, dst_block_id) to `pending_copies`. Before any KV write of the step, the storage
copies every pending pair in list order (whole blocks), then clears the list.

When blocks get hashed: at `allocate_slots`, as soon as the tokens it covers fill a block, that is,
before the forward pass writes their KV (as vLLM). Run the step's forward before another sequence's
`get_computed_blocks` can serve those blocks, or in the same batch.

Sliding window (`window`, after vLLM v1's SlidingWindowManager): the query at position p reads keys p - window + 1
.. p only, so at `allocate_slots` every block wholly before the window of the first new token is released
(`free_blocks`: another sequence holding it keeps it, and a cached one stays hittable until evicted) and its
table entry becomes `SKIPPED`; the table keeps its length (positions still index it). A sequence holds at most
cdiv(window - 1 + new tokens, block_size) + 1 blocks. It cannot be rolled back into a released block.
"""

from __future__ import annotations

from collections.abc import Sequence

from mlx_engine.kv.block_pool import BlockPool, KVCacheBlock, hash_block_tokens


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# The table entry of a block released because it left the sliding window: no block of the pool. Its id, 0, names
# a real block, so a table with it stays a valid kernel input; attention never reads the entries before its window.
SKIPPED = KVCacheBlock(block_id=0)


class KVCacheManager:
    """Block tables over one BlockPool, with prefix caching when the pool has it enabled."""

    def __init__(self, pool: BlockPool, block_size: int, extra_key: bytes = b"", window: int | None = None) -> None:
        if block_size < 1:
            raise ValueError(f"block_size={block_size}: must be at least 1")
        if window is not None and window < 1:
            raise ValueError(f"window={window}: must be at least 1 token")
        self.window = window
        # sliding window: leading table entries released (`SKIPPED`), per sequence
        self.req_to_num_skipped: dict[str, int] = {}
        self.pool = pool
        self.block_size = block_size
        self.extra_key = extra_key
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.req_to_num_tokens: dict[str, int] = {}
        # Hash chain of each sequence's full blocks, table order; len == num_tokens // block_size when
        # caching is on. Kept apart from block.block_hash: a first-wins loser holds no hash itself.
        self.req_to_block_hashes: dict[str, list[bytes]] = {}
        self.pending_copies: list[tuple[int, int]] = []
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

    # ---- prefix cache ------------------------------------------------------------------------------

    def get_computed_blocks(self, token_ids: Sequence[int], max_tokens: int | None = None,
                            count: bool = True) -> tuple[list[KVCacheBlock], int]:
        """The longest run of cached full blocks that matches token_ids' prefix, and the tokens it holds.

        At most len(token_ids) - 1 tokens are reported computed (and at most `max_tokens`): the last token must go
        through the model to give logits. Pass the blocks to `allocate_slots` right away (no allocation in
        between), which takes a reference to them; until then they may be evicted. `count`: into the hit rate
        (False: a look that a caller of several caches makes before it settles on a common hit).
        """
        if count:
            self.num_queried_tokens += len(token_ids)
        if not self.pool.enable_caching or not token_ids:
            return [], 0
        max_blocks = (len(token_ids) - 1) // self.block_size
        if max_tokens is not None:
            max_blocks = min(max_blocks, max_tokens // self.block_size)
        if self.window is None:
            computed = self.cached_prefix(token_ids, max_blocks)
        else:
            computed = self._window_prefix(token_ids, max_blocks)
        num_computed_tokens = len(computed) * self.block_size
        if count:
            self.num_hit_tokens += num_computed_tokens
        return computed, num_computed_tokens

    def _window_prefix(self, token_ids: Sequence[int], max_blocks: int) -> list[KVCacheBlock]:
        """With a sliding window (after vLLM v1's SlidingWindowManager): the longest prefix of k full blocks whose
        blocks inside the window of the next token (position k * block_size) are cached; the entries before that
        window come back `SKIPPED` (they need not be cached: nothing reads them)."""
        bs = self.block_size
        found: list[KVCacheBlock | None] = []
        parent: bytes | None = None
        for i in range(min(max_blocks, len(token_ids) // bs)):
            block_tokens = token_ids[i * bs:(i + 1) * bs]
            parent = hash_block_tokens(parent, block_tokens, self.extra_key)
            found.append(self.pool.get_cached_block(parent, block_tokens))
        for k in range(len(found), 0, -1):
            first = self.first_block(k * bs)
            if all(b is not None for b in found[first:k]):
                return [SKIPPED] * first + found[first:k]  # type: ignore[list-item]
        return []

    def cached_prefix(self, token_ids: Sequence[int], max_blocks: int) -> list[KVCacheBlock]:
        """The cached full blocks matching token_ids' prefix, at most max_blocks (no hit counting)."""
        bs = self.block_size
        blocks: list[KVCacheBlock] = []
        parent: bytes | None = None
        for i in range(min(max_blocks, len(token_ids) // bs)):
            block_tokens = token_ids[i * bs:(i + 1) * bs]
            parent = hash_block_tokens(parent, block_tokens, self.extra_key)
            block = self.pool.get_cached_block(parent, block_tokens)
            if block is None:
                break
            blocks.append(block)
        return blocks

    # ---- allocation --------------------------------------------------------------------------------

    def allocate_slots(self, req_id: str, token_ids: Sequence[int], num_new_tokens: int,
                       new_computed_blocks: Sequence[KVCacheBlock] = ()) -> list[KVCacheBlock] | None:
        """Make room for num_new_tokens more tokens of req_id, after its table and new_computed_blocks.

        token_ids: the sequence's tokens, through the new ones where known (a whole prompt is fine under
        chunked prefill; only full blocks within the new total are hashed). Tokens not yet known on the
        host (a queued decode step) may be missing: their blocks are hashed by `cache_full_blocks` later. Returns the newly allocated
        blocks (a copy-on-write destination first), or None, with nothing changed, when the pool cannot
        supply them.
        """
        bs = self.block_size
        table = self.req_to_blocks.get(req_id, [])
        num_tokens = self.req_to_num_tokens.get(req_id, 0)
        if new_computed_blocks and num_tokens % bs:
            raise ValueError(f"{req_id}: computed blocks must start at a block boundary ({num_tokens} tokens)")
        num_computed = num_tokens + len(new_computed_blocks) * bs
        total = num_computed + num_new_tokens
        if num_new_tokens < 0 or len(token_ids) < num_computed:
            raise ValueError(f"{req_id}: {num_new_tokens} new tokens after {num_computed}, "
                             f"but token_ids holds {len(token_ids)}")
        for i, block in enumerate(new_computed_blocks):
            j = len(table) + i
            if block is SKIPPED:  # before the window of the first new token (`_window_prefix`): never read
                continue
            if block.block_hash is None or block.token_ids != tuple(token_ids[j * bs:(j + 1) * bs]):
                raise ValueError(f"{req_id}: computed block {block.block_id} was evicted or changed "
                                 "since get_computed_blocks")

        num_new_blocks = cdiv(total, bs) - len(table) - len(new_computed_blocks)
        tail = table[-1] if table else None
        # The new tokens write into the existing last block iff it is partial; copy it first when
        # another sequence holds it (fork) or the prefix cache does (a trim made it partial again).
        needs_cow = (num_new_tokens > 0 and num_computed % bs != 0 and tail is not None
                     and (tail.ref_cnt > 1 or tail.block_hash is not None))
        # A computed block with ref_cnt 0 is taken out of the free queue by touch(): count it.
        num_evictable_computed = sum(1 for b in new_computed_blocks if b.ref_cnt == 0 and b is not SKIPPED)
        # blocks this call releases from the window before it takes new ones, and that no one else holds
        released = sum(1 for b in table[self.req_to_num_skipped.get(req_id, 0):self.first_block(num_tokens)]
                       if b.ref_cnt == 1)
        if num_new_blocks + needs_cow > self.pool.get_num_free_blocks() + released - num_evictable_computed:
            return None

        self.pool.touch(self._live(new_computed_blocks))
        self._skip_before_window(req_id, num_tokens)
        hashes = self.req_to_block_hashes.setdefault(req_id, [])
        if self.pool.enable_caching:
            for i, b in enumerate(new_computed_blocks):  # a SKIPPED entry's hash from its tokens: the chain goes on
                j = len(table) + i
                hashes.append(b.block_hash if b is not SKIPPED else  # type: ignore[arg-type]
                              hash_block_tokens(hashes[-1] if hashes else None, token_ids[j * bs:(j + 1) * bs],
                                                self.extra_key))
        if not table:  # a prefix hit's leading SKIPPED entries count as released
            lead = next((i for i, b in enumerate(new_computed_blocks) if b is not SKIPPED), len(new_computed_blocks))
            if lead:
                self.req_to_num_skipped[req_id] = lead
        table = self.req_to_blocks.setdefault(req_id, table)
        table.extend(new_computed_blocks)
        new_blocks = self.pool.get_new_blocks(num_new_blocks + needs_cow)
        if needs_cow:
            assert tail is not None
            dst = new_blocks[0]
            table[-1] = dst
            self.pending_copies.append((tail.block_id, dst.block_id))
            self.pool.free_blocks([tail])
            table.extend(new_blocks[1:])
        else:
            table.extend(new_blocks)
        self.req_to_num_tokens[req_id] = total
        self._cache_full_blocks(req_id, token_ids, min(total, len(token_ids)))
        self._skip_before_window(req_id, num_computed)  # the prefix hit's blocks the new tokens do not read
        return new_blocks

    def first_block(self, position: int) -> int:
        """The first table index a query at `position` (or later) reads: the block of position - window + 1
        (0 without a window)."""
        if self.window is None:
            return 0
        return max(0, position - self.window + 1) // self.block_size

    def _skip_before_window(self, req_id: str, position: int) -> None:
        """Releases req_id's blocks wholly before the window of a query at `position`."""
        if self.window is None or req_id not in self.req_to_blocks:
            return
        table = self.req_to_blocks[req_id]
        done = self.req_to_num_skipped.get(req_id, 0)
        end = min(self.first_block(position), len(table))
        if end <= done:
            return
        released = table[done:end]
        table[done:end] = [SKIPPED] * (end - done)
        self.req_to_num_skipped[req_id] = end
        self.pool.free_blocks(released)  # oldest first: the first evicted

    def cache_full_blocks(self, req_id: str, token_ids: Sequence[int]) -> None:
        """Registers the blocks that `token_ids` (the sequence's known tokens, up to what its table holds)
        fill. For pipelined decode, where a step is queued before its input token is known on the host:
        allocate_slots with the tokens known so far, then call this once the token is read."""
        self._cache_full_blocks(req_id, token_ids, min(len(token_ids), self.req_to_num_tokens.get(req_id, 0)))

    def _cache_full_blocks(self, req_id: str, token_ids: Sequence[int], num_tokens: int) -> None:
        if not self.pool.enable_caching:
            return
        bs, table, hashes = self.block_size, self.req_to_blocks[req_id], self.req_to_block_hashes[req_id]
        for i in range(len(hashes), num_tokens // bs):
            block_tokens = token_ids[i * bs:(i + 1) * bs]
            h = hash_block_tokens(hashes[-1] if hashes else None, block_tokens, self.extra_key)
            hashes.append(h)
            if table[i] is not SKIPPED:  # released before its tokens were known (a window shorter than a step)
                self.pool.cache_full_block(table[i], h, block_tokens)

    # ---- sequences ---------------------------------------------------------------------------------

    def fork(self, parent_id: str, child_id: str) -> None:
        """child_id shares every block of parent_id; the first write by either into the shared partial
        last block copies it (see `pending_copies`)."""
        if child_id in self.req_to_blocks:
            raise ValueError(f"fork: {child_id!r} already has a block table")
        blocks = self.req_to_blocks[parent_id]
        self.pool.touch(self._live(blocks))
        self.req_to_blocks[child_id] = list(blocks)
        if parent_id in self.req_to_num_skipped:
            self.req_to_num_skipped[child_id] = self.req_to_num_skipped[parent_id]
        self.req_to_num_tokens[child_id] = self.req_to_num_tokens[parent_id]
        self.req_to_block_hashes[child_id] = list(self.req_to_block_hashes.get(parent_id, []))

    def trim(self, req_id: str, num_tokens: int) -> None:
        """Roll req_id back to its first num_tokens tokens (rejected draft tokens). Blocks past
        ceil(num_tokens / block_size) are freed, tail first; a cached block left partial stays cached
        for others and is copied on the next write."""
        current = self.req_to_num_tokens[req_id]
        if not 0 <= num_tokens <= current:
            raise ValueError(f"trim {req_id} to {num_tokens} tokens: it holds {current}")
        table = self.req_to_blocks[req_id]
        keep = cdiv(num_tokens, self.block_size)
        skipped = self.req_to_num_skipped.get(req_id, 0)
        if 0 < num_tokens < current and self.first_block(num_tokens) < skipped:
            raise ValueError(f"trim {req_id} to {num_tokens} tokens: the next token's sliding window "
                             f"(window={self.window}) reaches block {self.first_block(num_tokens)}, "
                             f"which left the window and was released")
        if keep < skipped:  # trimmed to nothing before the window (0 tokens): the released entries go too
            self.req_to_num_skipped[req_id] = keep
        self.pool.free_blocks(reversed(self._live(table[keep:])))
        del table[keep:]
        del self.req_to_block_hashes[req_id][num_tokens // self.block_size:]
        self.req_to_num_tokens[req_id] = num_tokens

    def free(self, req_id: str) -> None:
        """Release req_id's blocks in reverse order: its tail blocks become the first evicted. Unknown
        ids are ignored."""
        table = self.req_to_blocks.pop(req_id, None)
        self.req_to_num_tokens.pop(req_id, None)
        self.req_to_block_hashes.pop(req_id, None)
        self.req_to_num_skipped.pop(req_id, None)
        if table:
            self.pool.free_blocks(reversed(self._live(table)))

    @staticmethod
    def _live(blocks: Sequence[KVCacheBlock]) -> list[KVCacheBlock]:
        return [b for b in blocks if b is not SKIPPED]

    def num_blocks_held(self, req_id: str) -> int:
        """Blocks of the pool req_id holds (released ones, past its sliding window, not counted)."""
        return len(self.req_to_blocks.get(req_id, ())) - self.req_to_num_skipped.get(req_id, 0)

    # ---- views for the storage ---------------------------------------------------------------------

    def slot_mapping(self, req_id: str, start: int, end: int) -> list[int]:
        """Flat KV slots (block_id * block_size + offset) of positions start..end-1."""
        if not 0 <= start <= end <= self.req_to_num_tokens.get(req_id, 0):
            raise ValueError(f"slot_mapping({req_id}, {start}, {end}): it holds "
                             f"{self.req_to_num_tokens.get(req_id, 0)} tokens")
        bs, table = self.block_size, self.req_to_blocks.get(req_id, [])
        if start < end and table[start // bs] is SKIPPED:
            raise ValueError(f"slot_mapping({req_id}, {start}, {end}): position {start} left the sliding window "
                             f"(window={self.window}) and its block was released")
        return [table[p // bs].block_id * bs + p % bs for p in range(start, end)]

    def block_table(self, req_id: str) -> list[int]:
        """The block ids of req_id's table; entries released past the sliding window read 0 (`SKIPPED`)."""
        return [b.block_id for b in self.req_to_blocks.get(req_id, [])]

    def num_tokens(self, req_id: str) -> int:
        return self.req_to_num_tokens.get(req_id, 0)

    def stats(self) -> dict:
        """Counts for Engine.kv_stats(): blocks total/used/cached/free, hit rate, fragmentation."""
        pool, bs = self.pool, self.block_size
        num_used = sum(1 for b in pool.blocks if b.ref_cnt > 0)
        num_slots = sum(len(t) for t in self.req_to_blocks.values()) * bs
        num_held = sum(self.req_to_num_tokens.values())
        if self.window is not None:  # what the live blocks hold: tokens from each table's first live block on
            num_slots = sum(self.num_blocks_held(r) for r in self.req_to_blocks) * bs
            num_held -= sum(n * bs for n in self.req_to_num_skipped.values())
        return {
            "num_blocks": pool.num_blocks,
            "block_size": bs,
            "used": num_used,
            "cached": pool.num_cached_blocks(),
            "free": pool.get_num_free_blocks(),
            "usage": pool.get_usage(),
            "num_sequences": len(self.req_to_blocks),
            "num_queried_tokens": self.num_queried_tokens,
            "num_hit_tokens": self.num_hit_tokens,
            "hit_rate": self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0,
            # Slots the live tables hold but no token fills (partial tail blocks), over all they hold.
            "fragmentation": 1.0 - num_held / num_slots if num_slots else 0.0,
        }
