"""Block pool and KV cache manager: exact block ids, ref counts, eviction order, prefix hits, COW.

In the style of vLLM's tests/v1/core/test_prefix_caching.py, on CPU with no MLX. Block ids start at 0
(no null block). The state machine at the end drives a fake KV storage by the manager's contract
(apply pending copies, then write) and checks every live sequence reads back its own tokens' KV.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import mlx_engine.kv.manager as manager_module
from mlx_engine.kv import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock, KVCacheManager, hash_block_tokens


def make_manager(num_blocks: int, block_size: int = 4, enable_caching: bool = True,
                 extra_key: bytes = b"") -> KVCacheManager:
    return KVCacheManager(BlockPool(num_blocks, enable_caching), block_size, extra_key)


def free_ids(m: KVCacheManager) -> list[int]:
    return [b.block_id for b in m.pool.free_block_queue.get_all_free_blocks()]


def ref_cnts(m: KVCacheManager, ids) -> list[int]:
    return [m.pool.blocks[i].ref_cnt for i in ids]


def prefill(m: KVCacheManager, req_id: str, token_ids: list[int]) -> tuple[list[int], int]:
    """get_computed_blocks + allocate_slots, as the scheduler does; returns (new block ids, hit tokens)."""
    computed, n = m.get_computed_blocks(token_ids)
    new = m.allocate_slots(req_id, token_ids, len(token_ids) - n, computed)
    assert new is not None
    return [b.block_id for b in new], n


# ---- hashing ----------------------------------------------------------------------------------------


def test_hash_block_tokens_format_is_pinned():
    # The encoding, spelled out: sha256(parent or NONE_HASH, u64 count, int64 ids little-endian, extra_key).
    none_hash = hashlib.sha256(b"roofline.kv.none_hash").digest()
    ids = b"".join(t.to_bytes(8, "little", signed=True) for t in (1, 2, 3, 4))
    h0 = hash_block_tokens(None, [1, 2, 3, 4], b"")
    assert h0 == hashlib.sha256(none_hash + (4).to_bytes(8, "little") + ids).digest()
    assert h0.hex() == "69f8d736a5555bdded76a1eab666736ba1c7666994bd567fd753968560927d16"
    h1 = hash_block_tokens(h0, (5, 6, 7, 8), b"model")
    assert h1.hex() == "40e760d75fe155f56d035c8764464172009f43da0638f300f086b72e3e086232"


def test_hash_block_tokens_separates_inputs():
    h = hash_block_tokens(None, [1, 2, 3, 4], b"")
    assert len(h) == 32
    assert hash_block_tokens(None, (1, 2, 3, 4), b"") == h  # list or tuple
    others = [
        hash_block_tokens(None, [1, 2, 4, 3], b""),
        hash_block_tokens(h, [1, 2, 3, 4], b""),
        hash_block_tokens(None, [1, 2, 3, 4], b"fingerprint"),
        hash_block_tokens(None, [1, 2, 3], (4).to_bytes(8, "little")),  # count guards ids | extra_key
    ]
    assert len({h, *others}) == 5


def test_hash_block_tokens_stable_across_processes():
    code = "from mlx_engine.kv import hash_block_tokens as h; print(h(h(None, [7, 8], b'x'), [9, 10], b'x').hex())"
    outs = set()
    for seed in ("0", "1", "random"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        outs.add(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                check=True).stdout.strip())
    assert outs == {hash_block_tokens(hash_block_tokens(None, [7, 8], b"x"), [9, 10], b"x").hex()}


# ---- free queue -------------------------------------------------------------------------------------


def test_free_queue_popleft_remove_append():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeKVCacheBlockQueue(blocks)
    assert q.num_free_blocks == 5
    assert q.popleft() is blocks[0]
    q.remove(blocks[2])
    assert [b.block_id for b in q.get_all_free_blocks()] == [1, 3, 4]
    q.append(blocks[0])
    q.append(blocks[2])
    assert [b.block_id for b in q.get_all_free_blocks()] == [1, 3, 4, 0, 2]
    assert q.num_free_blocks == 5
    with pytest.raises(RuntimeError):
        q.append(blocks[3])  # already queued: never twice in the list
    for i in (1, 3, 4, 0, 2):
        assert q.popleft().block_id == i
    assert q.num_free_blocks == 0 and q.get_all_free_blocks() == []
    with pytest.raises(ValueError):
        q.popleft()
    with pytest.raises(RuntimeError):
        q.remove(blocks[1])


def test_pool_rejects_empty_and_overdraw():
    with pytest.raises(ValueError):
        BlockPool(0)
    pool = BlockPool(3)
    assert [b.block_id for b in pool.get_new_blocks(2)] == [0, 1]
    with pytest.raises(ValueError):
        pool.get_new_blocks(2)
    assert pool.get_num_free_blocks() == 1 and pool.get_usage() == pytest.approx(2 / 3)


# ---- allocation, free, eviction order ---------------------------------------------------------------


def test_allocate_in_order_free_in_reverse():
    m = make_manager(10)
    a = list(range(10))
    assert prefill(m, "a", a) == ([0, 1, 2], 0)
    assert m.block_table("a") == [0, 1, 2] and m.num_tokens("a") == 10
    b = list(range(100, 105))
    assert prefill(m, "b", b) == ([3, 4], 0)
    assert m.block_table("b") == [3, 4]
    assert ref_cnts(m, range(5)) == [1, 1, 1, 1, 1]
    assert m.pool.get_num_free_blocks() == 5
    # Full blocks are cached, partial ones not: a's 0, 1 and b's 3.
    assert [i for i, blk in enumerate(m.pool.blocks) if blk.block_hash is not None] == [0, 1, 3]

    # Freed in reverse: the cached blocks (1, 0) go to the tail, the uncached partial one (2) to the head,
    # ahead of the blocks never used, so the next allocation reuses it first.
    m.free("a")
    assert free_ids(m) == [2, 5, 6, 7, 8, 9, 1, 0]
    m.free("b")
    assert free_ids(m) == [4, 2, 5, 6, 7, 8, 9, 1, 0, 3]
    assert m.pool.num_cached_blocks() == 3 and m.block_table("a") == [] and m.num_tokens("a") == 0

    # A miss that needs the whole pool takes the uncached blocks first, then the cached ones least
    # recently freed first, evicting every cached hash of a and b (then caches its own 10 full blocks).
    assert prefill(m, "c", [7] * 40) == ([4, 2, 5, 6, 7, 8, 9, 1, 0, 3], 0)
    assert m.pool.get_num_free_blocks() == 0 and free_ids(m) == []
    assert m.get_computed_blocks(a) == ([], 0)
    assert {blk.block_id for blk in m.pool.cached_block_hash_to_block.values()} == set(range(10))


def test_decode_grows_table_one_block_at_a_time():
    m = make_manager(8)
    tokens = [1, 2, 3]
    assert prefill(m, "a", tokens) == ([0], 0)
    tables = []
    for t in range(4, 11):
        tokens.append(t)
        new = m.allocate_slots("a", tokens, 1)
        assert new is not None
        tables.append((m.num_tokens("a"), m.block_table("a"), [b.block_id for b in new]))
    assert tables == [
        (4, [0], []),
        (5, [0, 1], [1]),
        (6, [0, 1], []),
        (7, [0, 1], []),
        (8, [0, 1], []),
        (9, [0, 1, 2], [2]),
        (10, [0, 1, 2], []),
    ]
    # Blocks are hashed as soon as allocate_slots covers them fully.
    h0 = hash_block_tokens(None, [1, 2, 3, 4], b"")
    assert m.pool.blocks[0].block_hash == h0
    assert m.pool.blocks[1].block_hash == hash_block_tokens(h0, [5, 6, 7, 8], b"")
    assert m.pool.blocks[1].token_ids == (5, 6, 7, 8)
    assert m.pool.blocks[2].block_hash is None


def test_eviction_is_lru_and_touch_leaves_queue():
    m = make_manager(4, block_size=2)
    prefill(m, "a", [1, 2])
    prefill(m, "b", [3, 4])
    prefill(m, "c", [5, 6])
    assert [m.block_table(r) for r in "abc"] == [[0], [1], [2]]
    m.free("b")
    m.free("a")
    m.free("c")
    assert free_ids(m) == [3, 1, 0, 2]
    assert m.pool.num_cached_blocks() == 3

    # A hit on a's block takes it out of the middle of the queue (ref_cnt 0 -> 1).
    assert prefill(m, "a2", [1, 2, 9]) == ([3], 2)
    assert m.block_table("a2") == [0, 3] and m.pool.blocks[0].ref_cnt == 1
    assert free_ids(m) == [1, 2]
    # The earliest freed block (b's) is evicted first, then c's.
    assert prefill(m, "d", [7, 8, 9]) == ([1, 2], 0)
    assert m.get_computed_blocks([3, 4, 0]) == ([], 0)
    assert m.get_computed_blocks([5, 6, 0]) == ([], 0)
    assert m.pool.num_cached_blocks() == 2  # a's block 0 and d's block 1
    assert m.pool.blocks[1].token_ids == (7, 8) and m.pool.blocks[2].block_hash is None


# ---- prefix caching ---------------------------------------------------------------------------------


def test_prefix_hit_shares_full_blocks():
    m = make_manager(11, extra_key=b"fp")
    common = [i for i in range(3) for _ in range(4)]  # 3 full blocks
    req0 = common + [3] * 3
    assert prefill(m, "0", req0) == ([0, 1, 2, 3], 0)
    parent = None
    for i in range(3):
        parent = hash_block_tokens(parent, req0[i * 4:(i + 1) * 4], b"fp")
        assert m.pool.blocks[i].block_hash == parent and m.pool.blocks[i].ref_cnt == 1
    assert m.pool.blocks[3].block_hash is None and m.pool.blocks[3].ref_cnt == 1

    # Same prefix, original still in use: the 3 full blocks are shared, the partial one never is.
    req1 = common + [3] * 2
    computed, n = m.get_computed_blocks(req1)
    assert [b.block_id for b in computed] == [0, 1, 2] and n == 12
    new = m.allocate_slots("1", req1, len(req1) - n, computed)
    assert [b.block_id for b in new] == [4]
    assert m.block_table("1") == [0, 1, 2, 4]
    assert ref_cnts(m, [0, 1, 2, 3, 4]) == [2, 2, 2, 1, 1]
    assert m.pool.get_num_free_blocks() == 6

    # An identical prompt also stops before its partial last block.
    assert [b.block_id for b in m.get_computed_blocks(req0)[0]] == [0, 1, 2]

    m.free("0")
    assert free_ids(m) == [3, 5, 6, 7, 8, 9, 10]
    m.free("1")
    assert free_ids(m) == [4, 3, 5, 6, 7, 8, 9, 10, 2, 1, 0]
    assert m.pool.get_num_free_blocks() == 11

    # Hit after the owners are gone: the cached blocks leave the free queue; the new partial block is the
    # uncached one freed last.
    req2 = common + [3]
    assert prefill(m, "2", req2) == ([4], 12)
    assert ref_cnts(m, [0, 1, 2, 4]) == [1, 1, 1, 1]
    assert free_ids(m) == [3, 5, 6, 7, 8, 9, 10]

    # A different fingerprint (extra_key) misses the same tokens.
    other = KVCacheManager(m.pool, 4, extra_key=b"other")
    assert other.get_computed_blocks(req2) == ([], 0)


def test_hash_collision_with_different_tokens_is_not_reused(monkeypatch):
    monkeypatch.setattr(manager_module, "hash_block_tokens", lambda parent, ids, extra: b"\0" * 32)
    m = make_manager(8)
    prefill(m, "a", [1, 2, 3, 4, 5, 6, 7, 8])
    # Block 1 hashes like block 0: first wins, block 1 stays uncached.
    assert m.pool.num_cached_blocks() == 1
    assert m.pool.blocks[0].block_hash == b"\0" * 32 and m.pool.blocks[1].block_hash is None
    assert m.get_computed_blocks([9, 10, 11, 12, 13]) == ([], 0)
    computed, n = m.get_computed_blocks([1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert [b.block_id for b in computed] == [0] and n == 4  # block 1's lookup finds block 0's tokens
    m.free("a")
    assert free_ids(m) == [1, 2, 3, 4, 5, 6, 7, 0]  # the uncached duplicate at the head, the cached block last


def test_first_wins_for_identical_blocks():
    m = make_manager(8)
    prefill(m, "a", [1, 2, 3, 4, 5])  # block 0 cached, 1 partial
    # b computes the same block itself (chunked in before a's block existed would do the same).
    assert m.allocate_slots("b", [1, 2, 3, 4, 5], 5) is not None
    assert m.block_table("b") == [2, 3]
    assert m.pool.blocks[2].block_hash is None  # the duplicate is not cached
    assert m.pool.cached_block_hash_to_block[m.pool.blocks[0].block_hash] is m.pool.blocks[0]
    m.free("a")
    m.free("b")
    assert free_ids(m) == [2, 3, 1, 4, 5, 6, 7, 0]  # uncached: b's 2, 3 (in id order), a's partial 1
    assert m.pool.num_cached_blocks() == 1


def test_last_token_is_never_reported_computed():
    m = make_manager(8)
    a = list(range(8))
    assert m.get_computed_blocks(a) == ([], 0)
    prefill(m, "a", a)
    assert m.pool.num_cached_blocks() == 2
    hits = []
    for prompt in (a, a + [99], a[:7], a[:5], a[:4], a[:1], []):
        computed, n = m.get_computed_blocks(prompt)
        hits.append(([b.block_id for b in computed], n))
    assert hits == [([0], 4), ([0, 1], 8), ([0], 4), ([0], 4), ([], 0), ([], 0), ([], 0)]
    s = m.stats()
    # queried 8 (a's own lookup, a miss) + 8 + 8 + 9 + 7 + 5 + 4 + 1 + 0 = 50 tokens, hit 4 + 8 + 4 + 4 = 20
    assert (s["num_queried_tokens"], s["num_hit_tokens"]) == (50, 20)
    assert s["hit_rate"] == 0.4


def test_caching_disabled():
    m = make_manager(4, enable_caching=False)
    prefill(m, "a", list(range(8)))
    assert m.pool.num_cached_blocks() == 0
    assert m.get_computed_blocks(list(range(9))) == ([], 0)
    m.free("a")
    assert free_ids(m) == [0, 1, 2, 3]  # nothing cached: a's blocks first, in id order, then the unused
    assert prefill(m, "b", list(range(10, 18))) == ([0, 1], 0)  # the same blocks again, not the unused 2, 3



def test_a_bad_free_keeps_the_blocks_freed_before_it():
    pool = BlockPool(4, enable_caching=False)
    a, b = pool.get_new_blocks(2)
    pool.free_blocks([b])
    with pytest.raises(RuntimeError, match="free of block 1 with ref_cnt 0"):
        pool.free_blocks([a, b])  # a is freed, then b a second time
    assert [blk.block_id for blk in pool.free_block_queue.get_all_free_blocks()] == [0, 1, 2, 3]
    assert pool.get_num_free_blocks() == 4 and a.ref_cnt == 0

# ---- exhaustion ------------------------------------------------------------------------------------


def snapshot(m: KVCacheManager):
    return (
        {r: [b.block_id for b in t] for r, t in m.req_to_blocks.items()},
        dict(m.req_to_num_tokens),
        {r: list(h) for r, h in m.req_to_block_hashes.items()},
        [(b.ref_cnt, b.block_hash) for b in m.pool.blocks],
        free_ids(m),
        {h: b.block_id for h, b in m.pool.cached_block_hash_to_block.items()},
        list(m.pending_copies),
    )


def test_exhaustion_returns_none_and_changes_nothing():
    m = make_manager(4)
    a = list(range(12))
    prefill(m, "a", a)
    before = snapshot(m)
    assert m.allocate_slots("b", list(range(50, 58)), 8) is None
    assert snapshot(m) == before and "b" not in m.req_to_blocks and m.num_tokens("b") == 0
    a.append(12)
    assert [b.block_id for b in m.allocate_slots("a", a, 1)] == [3]
    a += [13, 14, 15, 16]
    before = snapshot(m)
    assert m.allocate_slots("a", a, 4) is None
    assert snapshot(m) == before and m.block_table("a") == [0, 1, 2, 3] and m.num_tokens("a") == 13
    assert m.pool.get_num_free_blocks() == 0


def test_exhaustion_counts_evictable_computed_blocks():
    m = make_manager(3)
    a = list(range(8))
    prefill(m, "a", a)
    m.free("a")
    assert free_ids(m) == [2, 1, 0] and m.pool.num_cached_blocks() == 2
    # 13 tokens: 2 hit blocks (taken from the free queue) + 2 new > 3 free.
    b = a + [20, 21, 22, 23, 24]
    computed, n = m.get_computed_blocks(b)
    assert [blk.block_id for blk in computed] == [0, 1] and n == 8
    before = snapshot(m)
    assert m.allocate_slots("b", b, len(b) - n, computed) is None
    assert snapshot(m) == before and ref_cnts(m, [0, 1]) == [0, 0]
    # 9 tokens: 2 hit blocks + 1 new fits exactly.
    assert prefill(m, "c", a + [20]) == ([2], 8)
    assert m.block_table("c") == [0, 1, 2] and m.pool.get_num_free_blocks() == 0


def test_eviction_removes_hash_from_cache_map():
    m = make_manager(3, block_size=2)
    prefill(m, "a", [1, 2, 3, 4])
    m.free("a")
    a_hashes = {m.pool.blocks[0].block_hash, m.pool.blocks[1].block_hash}
    assert set(m.pool.cached_block_hash_to_block) == a_hashes
    assert prefill(m, "b", [5, 6, 7, 8, 9, 10]) == ([2, 1, 0], 0)
    h0 = hash_block_tokens(None, [5, 6], b"")
    h1 = hash_block_tokens(h0, [7, 8], b"")
    h2 = hash_block_tokens(h1, [9, 10], b"")
    assert {h: b.block_id for h, b in m.pool.cached_block_hash_to_block.items()} == {h0: 2, h1: 1, h2: 0}
    assert a_hashes.isdisjoint(m.pool.cached_block_hash_to_block)
    assert m.get_computed_blocks([1, 2, 3, 4, 5]) == ([], 0)


def test_stale_computed_blocks_are_refused():
    m = make_manager(2, block_size=2)
    prefill(m, "a", [1, 2])
    m.free("a")
    computed, _ = m.get_computed_blocks([1, 2, 3])
    assert [b.block_id for b in computed] == [0]
    prefill(m, "x", [7, 8, 9, 10])  # evicts block 0 in between
    m.free("x")
    with pytest.raises(ValueError, match="evicted"):
        m.allocate_slots("b", [1, 2, 3], 1, computed)


def test_reset_prefix_cache():
    m = make_manager(4)
    prefill(m, "a", list(range(8)))
    assert m.pool.reset_prefix_cache() is False  # blocks in use
    m.free("a")
    assert m.pool.reset_prefix_cache() is True
    assert m.pool.num_cached_blocks() == 0 and all(b.block_hash is None for b in m.pool.blocks)
    assert m.get_computed_blocks(list(range(9))) == ([], 0)


# ---- fork, copy-on-write, trim ----------------------------------------------------------------------


def test_fork_then_write_copies_shared_last_block():
    m = make_manager(8)
    p = [0, 1, 2, 3, 4, 5]
    prefill(m, "p", p)
    m.fork("p", "c")
    assert m.block_table("c") == [0, 1] and m.num_tokens("c") == 6
    assert ref_cnts(m, [0, 1]) == [2, 2]

    c = p + [100]
    assert [b.block_id for b in m.allocate_slots("c", c, 1)] == [2]
    assert m.pending_copies == [(1, 2)]
    m.pending_copies.clear()
    assert m.block_table("c") == [0, 2] and m.block_table("p") == [0, 1]
    assert ref_cnts(m, [0, 1, 2]) == [2, 1, 1]

    # The parent now owns block 1 alone: it writes in place.
    p.append(200)
    assert m.allocate_slots("p", p, 1) == []
    assert m.pending_copies == []
    # Each fills its own block 1, cached under its own tokens.
    p.append(201)
    c.append(101)
    m.allocate_slots("p", p, 1)
    m.allocate_slots("c", c, 1)
    assert m.pool.blocks[1].token_ids == (4, 5, 200, 201)
    assert m.pool.blocks[2].token_ids == (4, 5, 100, 101)
    assert m.pending_copies == []

    m.free("p")
    assert ref_cnts(m, [0, 1, 2]) == [1, 0, 1]
    m.free("c")
    assert free_ids(m) == [3, 4, 5, 6, 7, 1, 2, 0]


def test_fork_at_block_boundary_needs_no_copy():
    m = make_manager(8)
    prefill(m, "p", list(range(8)))
    m.fork("p", "c")
    assert [b.block_id for b in m.allocate_slots("c", list(range(8)) + [9], 1)] == [2]
    assert m.pending_copies == [] and m.block_table("c") == [0, 1, 2]
    with pytest.raises(ValueError):
        m.fork("p", "c")


def test_cow_under_exhaustion_returns_none():
    m = make_manager(2)
    prefill(m, "p", [1, 2, 3, 4, 5])
    m.fork("p", "c")
    before = snapshot(m)
    assert m.allocate_slots("c", [1, 2, 3, 4, 5, 6, 7, 8, 9], 4) is None  # COW + 1 new > 0 free
    assert snapshot(m) == before


def test_trim_frees_blocks_back():
    m = make_manager(8)
    a = list(range(16))
    prefill(m, "a", a)
    assert m.block_table("a") == [0, 1, 2, 3]
    m.trim("a", 10)  # rejected draft tokens: positions 10..15
    assert m.block_table("a") == [0, 1, 2] and m.num_tokens("a") == 10
    assert free_ids(m) == [4, 5, 6, 7, 3]
    m.trim("a", 9)  # within a block: nothing freed
    assert m.block_table("a") == [0, 1, 2]
    m.trim("a", 4)
    assert m.block_table("a") == [0] and free_ids(m) == [4, 5, 6, 7, 3, 2, 1]
    assert m.req_to_block_hashes["a"] == [m.pool.blocks[0].block_hash]
    m.trim("a", 0)
    assert m.block_table("a") == [] and free_ids(m) == [4, 5, 6, 7, 3, 2, 1, 0]
    assert m.pool.num_cached_blocks() == 4  # trimmed full blocks stay cached, evictable
    with pytest.raises(ValueError):
        m.trim("a", 1)
    # Regrowing after trim-to-zero reuses the LRU blocks and hits the cache like any sequence.
    assert m.allocate_slots("a", [50, 51], 2) is not None
    assert m.block_table("a") == [4]


def test_trim_into_cached_block_then_write_copies_it():
    m = make_manager(8)
    a = list(range(8))
    prefill(m, "a", a)
    cached_h1 = m.pool.blocks[1].block_hash
    m.trim("a", 6)
    assert m.block_table("a") == [0, 1] and m.pool.blocks[1].block_hash == cached_h1
    a = a[:6] + [77]
    assert [b.block_id for b in m.allocate_slots("a", a, 1)] == [2]
    assert m.pending_copies == [(1, 2)] and m.block_table("a") == [0, 2]
    m.pending_copies.clear()
    # Block 1 keeps its KV for others: evictable but still hittable.
    assert m.pool.blocks[1].ref_cnt == 0 and free_ids(m) == [3, 4, 5, 6, 7, 1]
    assert prefill(m, "b", list(range(8)) + [9]) == ([3], 8)
    assert m.block_table("b") == [0, 1, 3] and ref_cnts(m, [0, 1]) == [2, 1]
    # a refills block 2 with its own tokens; a second write into the now-private block 2 is in place.
    a += [78]
    m.allocate_slots("a", a, 1)
    assert m.pending_copies == [] and m.pool.blocks[2].token_ids == (4, 5, 77, 78)


def test_trim_uncached_private_block_writes_in_place():
    m = make_manager(4, enable_caching=False)
    prefill(m, "a", list(range(8)))
    m.trim("a", 6)
    assert m.allocate_slots("a", list(range(6)) + [9], 1) == []
    assert m.pending_copies == [] and m.block_table("a") == [0, 1]


# ---- views -----------------------------------------------------------------------------------------


def test_slot_mapping_and_stats():
    m = make_manager(8)
    a = list(range(5))
    prefill(m, "a", a)  # [0, 1]
    prefill(m, "b", [50, 51, 52, 53])  # [2]
    a += [5, 6, 7, 8]
    m.allocate_slots("a", a, 4)  # 9 tokens: [0, 1, 3]
    assert m.block_table("a") == [0, 1, 3]
    assert m.slot_mapping("a", 3, 9) == [3, 4, 5, 6, 7, 12]
    assert m.slot_mapping("b", 0, 4) == [8, 9, 10, 11]
    assert m.slot_mapping("a", 9, 9) == []
    with pytest.raises(ValueError):
        m.slot_mapping("a", 0, 10)
    s = m.stats()
    assert {k: s[k] for k in ("num_blocks", "block_size", "used", "cached", "free", "num_sequences")} == {
        "num_blocks": 8, "block_size": 4, "used": 4, "cached": 3, "free": 4, "num_sequences": 2}
    assert s["usage"] == 0.5
    assert s["fragmentation"] == pytest.approx(1 - 13 / 16)


# ---- randomized: a state machine over a fake KV storage ---------------------------------------------


class PagedKVMachine(RuleBasedStateMachine):
    """Drives the manager as the engine does and keeps a fake storage: slot -> the token prefix whose
    KV it holds (KV at position p depends on tokens[:p + 1]). Checks bookkeeping invariants and that
    every live sequence, through its block table, reads exactly its own KV."""

    prefixes = ((), (1, 2, 3, 4, 5, 6, 7, 8), (1, 2, 3, 4, 0, 0, 0, 0, 0))

    @initialize(block_size=st.sampled_from([1, 2, 4]), num_blocks=st.integers(3, 24),
                caching=st.booleans())
    def setup(self, block_size, num_blocks, caching):
        self.m = make_manager(num_blocks, block_size, caching, extra_key=b"fp")
        self.bs = block_size
        self.tokens: dict[str, list[int]] = {}
        self.storage: dict[int, tuple[int, ...]] = {}
        self.next_id = 0

    def _new_id(self) -> str:
        self.next_id += 1
        return f"r{self.next_id}"

    def _write(self, req_id: str, start: int, end: int) -> None:
        # The storage's side of the contract: copy pending blocks, then write the new positions.
        if self.m.pending_copies:
            event("copy-on-write")
        for src, dst in self.m.pending_copies:
            for j in range(self.bs):
                self.storage[dst * self.bs + j] = self.storage.get(src * self.bs + j, ())
        self.m.pending_copies.clear()
        toks = self.tokens[req_id]
        for p, slot in zip(range(start, end), self.m.slot_mapping(req_id, start, end)):
            self.storage[slot] = tuple(toks[:p + 1])

    @rule(prefix=st.sampled_from(prefixes), suffix=st.lists(st.integers(0, 2), max_size=9),
          chunk=st.integers(1, 8))
    def new_request(self, prefix, suffix, chunk):
        prompt = list(prefix) + suffix
        if not prompt:
            return
        req_id = self._new_id()
        computed, n = self.m.get_computed_blocks(prompt)
        assert n == len(computed) * self.bs and n < len(prompt)
        if n:
            event("prefix hit")
        self.tokens[req_id] = prompt
        done = n
        while done < len(prompt):  # chunked prefill
            step = min(chunk, len(prompt) - done)
            before = snapshot(self.m)
            new = self.m.allocate_slots(req_id, prompt, step, computed if done == n else ())
            if new is None:
                event("allocation refused")
                assert snapshot(self.m) == before
                self.m.free(req_id)  # the scheduler gives up on it
                del self.tokens[req_id]
                return
            self._write(req_id, done, done + step)
            done += step

    @rule(data=st.data(), new=st.lists(st.integers(0, 2), min_size=1, max_size=5))
    def decode(self, data, new):
        if not self.tokens:
            return
        req_id = data.draw(st.sampled_from(sorted(self.tokens)))
        toks = self.tokens[req_id] + new
        start = len(self.tokens[req_id])
        before = snapshot(self.m)
        if self.m.allocate_slots(req_id, toks, len(new)) is None:
            event("allocation refused")
            assert snapshot(self.m) == before
            return
        self.tokens[req_id] = toks
        self._write(req_id, start, len(toks))

    @rule(data=st.data())
    def trim(self, data):
        if not self.tokens:
            return
        req_id = data.draw(st.sampled_from(sorted(self.tokens)))
        keep = data.draw(st.integers(0, len(self.tokens[req_id])))
        self.m.trim(req_id, keep)
        del self.tokens[req_id][keep:]

    @rule(data=st.data())
    def fork(self, data):
        if not self.tokens:
            return
        parent = data.draw(st.sampled_from(sorted(self.tokens)))
        child = self._new_id()
        self.m.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])

    @rule(data=st.data())
    def free(self, data):
        if not self.tokens:
            return
        req_id = data.draw(st.sampled_from(sorted(self.tokens)))
        self.m.free(req_id)
        del self.tokens[req_id]

    @invariant()
    def bookkeeping(self):
        if not hasattr(self, "m"):
            return
        m, pool = self.m, self.m.pool
        assert set(m.req_to_blocks) == set(self.tokens)
        occurrences = [0] * pool.num_blocks
        for req_id, table in m.req_to_blocks.items():
            assert m.num_tokens(req_id) == len(self.tokens[req_id])
            assert len(table) == -(-m.num_tokens(req_id) // self.bs)
            for b in table:
                occurrences[b.block_id] += 1
            if pool.enable_caching:  # the hash chain of the sequence's full blocks, no more, no less
                toks, parent, chain = self.tokens[req_id], None, []
                for i in range(len(toks) // self.bs):
                    parent = hash_block_tokens(parent, toks[i * self.bs:(i + 1) * self.bs], b"fp")
                    chain.append(parent)
                assert m.req_to_block_hashes[req_id] == chain
        assert [b.ref_cnt for b in pool.blocks] == occurrences
        assert sum(b.ref_cnt for b in pool.blocks) == sum(len(t) for t in m.req_to_blocks.values())
        queued = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
        assert len(queued) == len(set(queued)) == pool.free_block_queue.num_free_blocks
        assert set(queued) == {b.block_id for b in pool.blocks if b.ref_cnt == 0}
        for h, b in pool.cached_block_hash_to_block.items():
            assert b.block_hash == h and len(b.token_ids) == self.bs
        assert sum(b.block_hash is not None for b in pool.blocks) == pool.num_cached_blocks()
        assert m.pending_copies == []

    @invariant()
    def every_sequence_reads_its_own_kv(self):
        if not hasattr(self, "m"):
            return
        for req_id, toks in self.tokens.items():
            slots = self.m.slot_mapping(req_id, 0, len(toks))
            assert [self.storage.get(s) for s in slots] == [tuple(toks[:p + 1]) for p in range(len(toks))]
        # A cached block holds the KV of the prefix its hash chain names.
        for h, b in self.m.pool.cached_block_hash_to_block.items():
            prefix = self.storage[b.block_id * self.bs + self.bs - 1]
            parent = None
            for i in range(len(prefix) // self.bs):
                parent = hash_block_tokens(parent, prefix[i * self.bs:(i + 1) * self.bs], b"fp")
            assert len(prefix) % self.bs == 0 and parent == h


TestPagedKVMachine = PagedKVMachine.TestCase
TestPagedKVMachine.settings = settings(max_examples=300, stateful_step_count=40, deadline=None,
                                       suppress_health_check=[HealthCheck.too_slow])
