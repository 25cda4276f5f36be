"""The block pool: fixed-size KV blocks, ref counts, an LRU free queue and the prefix-cache map.

Pure Python bookkeeping after vLLM v1 (`vllm/v1/core/block_pool.py`, `kv_cache_utils.py`): a block id
names block_size KV slots in the storage that `paged.py` owns; this file never touches the storage.

A block is in one of three states:
  in use        ref_cnt > 0, not in the free queue (maybe cached: shared by a prefix hit);
  free, cached  ref_cnt == 0, in the free queue, block_hash set: evictable, still hittable;
  free          ref_cnt == 0, in the free queue, block_hash None.
Invariant: block.block_hash is not None  <=>  cached_block_hash_to_block[block.block_hash] is block.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import pairwise

# The parent of a sequence's first block: a fixed 32 bytes, so a hash is stable across processes
# (vLLM seeds its NONE_HASH randomly unless PYTHONHASHSEED is set; we want persisted caches to match).
NONE_HASH = hashlib.sha256(b"roofline.kv.none_hash").digest()


def hash_block_tokens(parent_block_hash: bytes | None, token_ids: Sequence[int], extra_key: bytes) -> bytes:
    """sha256 over (parent hash, number of tokens, the tokens as little-endian int64, extra_key).

    The parent hash chains a block to its whole prefix; extra_key carries whatever else the KV depends
    on (the model fingerprint, the KV dtype). Every field before extra_key has a fixed or stated length,
    so no two inputs share an encoding.
    """
    parent = NONE_HASH if parent_block_hash is None else parent_block_hash
    n = len(token_ids)
    return hashlib.sha256(
        parent + struct.pack(f"<Q{n}q", n, *token_ids) + extra_key
    ).digest()


@dataclass(eq=False)
class KVCacheBlock:
    """One block of block_size KV slots. Compared by identity (eq=False), like vLLM's."""

    block_id: int
    ref_cnt: int = 0
    # Set while the block is a full block in the prefix cache; token_ids are its tokens, compared on a
    # hit so that a hash collision is never served.
    block_hash: bytes | None = None
    token_ids: tuple[int, ...] | None = None
    # Links of the free queue; only FreeKVCacheBlockQueue touches them. Both None <=> not in the queue.
    prev_free_block: KVCacheBlock | None = None
    next_free_block: KVCacheBlock | None = None

    def reset_hash(self) -> None:
        self.block_hash = None
        self.token_ids = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash is not None else None
        return f"KVCacheBlock(block_id={self.block_id}, ref_cnt={self.ref_cnt}, block_hash={h})"


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks in eviction order: popleft() gives the next to reuse.

    Linked through the blocks' own prev/next fields (two sentinels, no per-op allocation), so a prefix
    hit removes a block from the middle in O(1). Starts in block-id order; a freed block goes to the
    tail (a cached one, to be evicted least recently used first) or to the head (`appendleft`).
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        self.fake_free_list_head = KVCacheBlock(block_id=-1)
        self.fake_free_list_tail = KVCacheBlock(block_id=-1)
        chain = [self.fake_free_list_head, *blocks, self.fake_free_list_tail]
        for a, b in pairwise(chain):
            a.next_free_block, b.prev_free_block = b, a

    def popleft(self) -> KVCacheBlock:
        block = self.fake_free_list_head.next_free_block
        if block is self.fake_free_list_tail or block is None:
            raise ValueError("No free blocks available")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise RuntimeError(f"remove() of block {block.block_id}, which is not in the free queue")
        prev.next_free_block, nxt.prev_free_block = nxt, prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        if block.prev_free_block is not None or block.next_free_block is not None:
            raise RuntimeError(f"append() of block {block.block_id}, which is already in the free queue")
        last = self.fake_free_list_tail.prev_free_block
        assert last is not None
        last.next_free_block, block.prev_free_block = block, last
        block.next_free_block, self.fake_free_list_tail.prev_free_block = self.fake_free_list_tail, block
        self.num_free_blocks += 1

    def appendleft(self, blocks: Sequence[KVCacheBlock]) -> None:
        """`blocks` ahead of every free block, in their order: the next ones popleft() gives."""
        for block in reversed(blocks):
            if block.prev_free_block is not None or block.next_free_block is not None:
                raise RuntimeError(f"appendleft() of block {block.block_id}, which is already in the free queue")
            first = self.fake_free_list_head.next_free_block
            assert first is not None
            self.fake_free_list_head.next_free_block, block.prev_free_block = block, self.fake_free_list_head
            block.next_free_block, first.prev_free_block = first, block
            self.num_free_blocks += 1

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        out = []
        block = self.fake_free_list_head.next_free_block
        while block is not None and block is not self.fake_free_list_tail:
            out.append(block)
            block = block.next_free_block
        return out


class BlockPool:
    """All KV blocks of one model: allocation, freeing, and the prefix cache (hash -> block)."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks!r}: a pool needs at least one block")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks: list[KVCacheBlock] = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        # One block per hash: the first full block registered under a hash wins; a later identical
        # block stays uncached (block tables are append-only, so we never swap it for the cached one).
        self.cached_block_hash_to_block: dict[bytes, KVCacheBlock] = {}

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Pop n blocks from the free queue's head (freed uncached blocks, then never used ones, then cached
        ones least recently used first), evicting any cached hash they carry; each returns with ref_cnt 1."""
        if n > self.free_block_queue.num_free_blocks:
            raise ValueError(f"Cannot get {n} free blocks from the pool ({self.get_num_free_blocks()} free)")
        out = []
        for _ in range(n):
            block = self.free_block_queue.popleft()
            self.evict_cached_block(block)
            assert block.ref_cnt == 0
            block.ref_cnt = 1
            out.append(block)
        return out

    def evict_cached_block(self, block: KVCacheBlock) -> bool:
        """Forgets the block's prefix hash, if it has one (vLLM's `_maybe_evict_cached_block`)."""
        if block.block_hash is None:
            return False
        if self.cached_block_hash_to_block.get(block.block_hash) is block:
            del self.cached_block_hash_to_block[block.block_hash]
        block.reset_hash()
        return True

    def get_cached_block(self, block_hash: bytes, token_ids: Sequence[int]) -> KVCacheBlock | None:
        """The cached block for block_hash if its tokens equal token_ids too, else None."""
        block = self.cached_block_hash_to_block.get(block_hash)
        if block is None or block.token_ids != tuple(token_ids):
            return None
        return block

    def cache_full_block(self, block: KVCacheBlock, block_hash: bytes, token_ids: Sequence[int]) -> None:
        """Register a full block under block_hash. First wins: if another block already holds the hash,
        this one stays uncached (and is freed as a plain block later)."""
        if not self.enable_caching:
            return
        if block.block_hash is not None:
            if block.block_hash != block_hash:
                raise ValueError(f"block {block.block_id} is already cached under another hash")
            return
        if block_hash in self.cached_block_hash_to_block:
            return
        block.block_hash, block.token_ids = block_hash, tuple(token_ids)
        self.cached_block_hash_to_block[block_hash] = block

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """ref_cnt += 1 for each block (a prefix hit or a fork); a free block leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """ref_cnt -= 1 for each block; one that reaches 0 joins the free queue: a cached block at the tail,
        in the given order (the first given is evicted first), where it stays hittable until evicted; an
        uncached one at the head, in block-id order (a next table's blocks follow one another), reused before
        any block never written. So a pool's requests cycle through the fewest blocks (a CPU pool's pages are
        resident once written: the torch backend's mapped pools), and a cached block outlives every uncached
        one."""
        uncached = []
        try:
            for block in ordered_blocks:
                if block.ref_cnt <= 0:
                    raise RuntimeError(f"free of block {block.block_id} with ref_cnt {block.ref_cnt}")
                block.ref_cnt -= 1
                if block.ref_cnt == 0:
                    if block.block_hash is None:
                        uncached.append(block)
                    else:
                        self.free_block_queue.append(block)
        finally:  # the blocks freed before a bad one stay freed, as they did one by one
            self.free_block_queue.appendleft(sorted(uncached, key=lambda b: b.block_id))

    def get_num_free_blocks(self) -> int:
        """Blocks an allocation can take now, evictable cached blocks included."""
        return self.free_block_queue.num_free_blocks

    def num_cached_blocks(self) -> int:
        return len(self.cached_block_hash_to_block)

    def get_usage(self) -> float:
        return 1.0 - self.get_num_free_blocks() / self.num_blocks

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash (after a weight change, or to benchmark cold). Refused, returning
        False, while any block is in use."""
        if self.get_num_free_blocks() != self.num_blocks:
            return False
        self.cached_block_hash_to_block.clear()
        for block in self.blocks:
            block.reset_hash()
        return True
