"""Prefix caching for recurrent state: snapshots of every state leaf at block boundaries of a sequence (vLLM's
aligned mamba prefix caching, llama.cpp's context checkpoints).

A hybrid's cached prefix is of use only with the state at its end, and a state holds only its newest position.
So while a sequence runs, whenever its state has read a multiple of `every` tokens (N blocks, N set by how many
snapshots fit: `snapshot_interval`), its slot is copied under the hash of the tokens it read (the same chain of
block hashes the block pool keys the prefix's blocks by). A prompt then reuses the longest cached prefix of the
attention blocks that ends where a snapshot is kept, and its slot starts from that snapshot.

Snapshots are kept least recently used first out, at most `capacity`; one whose blocks were evicted is dropped
when a lookup finds them gone. A snapshot taken before its tokens are known (a pipelined decode step reads its
token a step later) waits with its position until they are.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import mlx.core as mx

from mlx_engine.kv.block_pool import hash_block_tokens
from mlx_engine.kv.manager import cdiv


def snapshot_interval(context_length: int, block_size: int, capacity: int) -> int:
    """Blocks between snapshots: a sequence of the whole context keeps at most `capacity` of them."""
    return max(1, cdiv(cdiv(context_length, block_size), max(1, capacity)))


def prefix_key(token_ids: list[int], block_size: int, extra_key: bytes) -> bytes:
    """The block pool's chain hash of the full blocks of `token_ids` (its length a multiple of block_size)."""
    parent = None
    for i in range(0, len(token_ids), block_size):
        parent = hash_block_tokens(parent, token_ids[i:i + block_size], extra_key)
    return parent or b""


class Snapshots:
    def __init__(self, capacity: int, every: int, block_size: int, extra_key: bytes):
        self.capacity, self.every, self.block_size, self.extra_key = capacity, every, block_size, extra_key
        self.store: OrderedDict[bytes, list[list[mx.array]]] = OrderedDict()
        self._waiting: dict[str, list[tuple[int, list[list[mx.array]]]]] = {}
        self._taken: dict[str, set[int]] = {}
        self.num_taken = self.num_restored = 0

    def _key(self, token_ids: list[int]) -> bytes:
        return prefix_key(token_ids, self.block_size, self.extra_key)

    def due(self, req_id: str, position: int) -> bool:
        """Whether the state at `position` of the request is to be kept (and is not yet)."""
        return (self.capacity > 0 and position > 0 and position % self.every == 0
                and position not in self._taken.get(req_id, ()))

    def take(self, req_id: str, position: int, entries: list[list[mx.array]], token_ids: list[int]) -> None:
        """Keeps the request's state at `position` (its arrays, own copies); stored once its tokens are known."""
        self._taken.setdefault(req_id, set()).add(position)
        self._waiting.setdefault(req_id, []).append((position, entries))
        self.settle(req_id, token_ids)

    def settle(self, req_id: str, token_ids: list[int]) -> None:
        """Stores the request's waiting snapshots whose tokens `token_ids` now covers."""
        waiting = self._waiting.get(req_id)
        if not waiting:
            return
        keep = []
        for position, entries in waiting:
            if len(token_ids) < position:
                keep.append((position, entries))
                continue
            key = self._key(list(token_ids[:position]))
            self.store[key] = entries
            self.store.move_to_end(key)
            self.num_taken += 1
            while len(self.store) > self.capacity:
                self.store.popitem(last=False)
        self._waiting[req_id] = keep

    def forget(self, req_id: str) -> None:
        self._waiting.pop(req_id, None)
        self._taken.pop(req_id, None)

    def best(self, prompt_ids: list[int], cached: int) -> tuple[int, list[list[mx.array]] | None]:
        """The longest prefix of at most `cached` tokens (what the attention blocks hold) with a snapshot at its
        end: (its length, the snapshot), or (0, None)."""
        p = cached - cached % self.every
        while p > 0:
            key = self._key(list(prompt_ids[:p]))
            if key in self.store:
                self.store.move_to_end(key)
                return p, self.store[key]
            p -= self.every
        return 0, None

    def drop_uncached(self, prompt_ids: list[int], cached: int) -> None:
        """Snapshots of this prompt's prefixes past what the blocks still hold: their blocks were evicted."""
        p = cached - cached % self.every + self.every
        while p <= len(prompt_ids) - 1:
            self.store.pop(self._key(list(prompt_ids[:p])), None)
            p += self.every

    def put(self, token_ids: list[int], state: list[list[mx.array]]) -> None:
        """A snapshot from elsewhere (a KV file) after `token_ids`."""
        if self.capacity:
            self.store[self._key(list(token_ids))] = state
            self.store.move_to_end(self._key(list(token_ids)))
            while len(self.store) > self.capacity:
                self.store.popitem(last=False)

    def clear(self) -> None:
        self.store.clear()
        self._waiting.clear()
        self._taken.clear()

    @property
    def count(self) -> int:
        return len(self.store)


def own_copy(arrays: list[list[Any]], slot: int) -> list[list[mx.array]]:
    """The slot's row of each array as its own buffers (a slice would keep the whole pool's buffer alive)."""
    rows = [[mx.array(a[slot]) * 1 for a in entries] for entries in arrays]
    mx.eval(rows)
    return rows


def add_state_to_file(path: str, state: list[list[mx.array]], num_tokens: int) -> None:
    """Adds a snapshot (the recurrent state after the file's `num_tokens` tokens) to a KV file `save` wrote,
    rewritten whole beside it and renamed over it (a cut-short write leaves the file as it was)."""
    from mlx_engine.kv.files import write_safetensors

    arrays, meta = mx.load(path, format="safetensors", return_metadata=True)
    for leaf, entries in enumerate(state):
        for j, a in enumerate(entries):
            arrays[f"state.{leaf}.{j}"] = a
    write_safetensors(path, arrays, {**meta, "state_tokens": str(num_tokens), "state_leaves": str(len(state))})


def state_from_file(path: str, arrays: list[list[mx.array]]) -> list[list[mx.array]]:
    """The snapshot a KV file holds, checked against the pool's `arrays` (a row of each); KVRestoreError, one line,
    where it has none or another shape (the file's other checks are `kv.files.restore_blocks`')."""
    from mlx_engine.kv.files import KVRestoreError

    try:
        loaded, meta = mx.load(path, format="safetensors", return_metadata=True)
    except (RuntimeError, ValueError, OSError) as e:
        raise KVRestoreError(f"saved KV refused: {path}: cannot read ({e})") from None
    num_tokens = meta.get("num_tokens")
    if meta.get("state_tokens") != num_tokens or meta.get("state_leaves") != str(len(arrays)):
        raise KVRestoreError(f"saved KV refused: {path} holds no recurrent state for its {num_tokens} tokens "
                             f"(state_tokens={meta.get('state_tokens')}, state_leaves={meta.get('state_leaves')}; "
                             f"this model has {len(arrays)} state layers)")
    out = []
    for leaf, entries in enumerate(arrays):
        row = []
        for j, pool in enumerate(entries):
            a = loaded.get(f"state.{leaf}.{j}")
            if a is None or a.shape != pool.shape[1:] or a.dtype != pool.dtype:
                raise KVRestoreError(f"saved KV refused: {path}: tensor state.{leaf}.{j} is missing or has the wrong "
                                     f"shape (expected {pool.shape[1:]} {pool.dtype})")
            row.append(a)
        out.append(row)
    return out
