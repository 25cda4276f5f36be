"""The recurrent state of a hybrid model's state layers (Gated DeltaNet, Mamba 2, short convolutions) in a slot
pool beside the paged KV of its attention layers (vLLM's mamba state beside its KV blocks).

A model's layers hold cache leaves in order (`models.adapter`: a layer holds one, falcon_h1's two: Mamba 2 beside
attention). An attention leaf is paged as in every other family; a state leaf keeps, per sequence, the fixed arrays
mlx-lm's `ArraysCache` holds for it (a convolution window, an SSM or delta-rule state). `StatePool` holds them as
(slots, ...) arrays, one slot per running sequence, taken when it starts and given back when it ends, zeroed when
taken (mlx-lm's layers read None as zeros). A forward's `StateView` reads its rows' slots (gathered, in the step's
row order) and writes what the layer left there back (scattered), lazily, in the same graph.

`StateCache` is the `KVCache` contract over both: the paged cache of the attention leaves and the pool. The pool's
slot count caps the batch (`KVCapabilities.state_slots`, the scheduler's `max_seqs`) and its bytes come out of the
KV budget. Prefix caching keeps snapshots of the state at block boundaries (`kv.state_snapshots`): a prompt reuses
the longest cached prefix that ends at one, its slot starting from it. Rollback is exact by recomputation
(`kv.protocol.StateKVCache`): each prefill forward (a verification among them) keeps the state its slot held before
it; a trim below the state's position restores that and names the kept positions after it, which the caller feeds
again. In a packed forward (`packed_layers`) a state leaf's view has a part per decode group and per prefill chunk
(`PackedStateView`), each read and written over its own slots. KV files carry the snapshot at the end of the saved
prefix (`save` / `restore`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import mlx.core as mx

from mlx_engine.api import RooflineError
from mlx_engine.kv.kinds import LayerKindsCache
from mlx_engine.kv.protocol import KVCapabilities
from mlx_engine.kv.state_snapshots import Snapshots, own_copy, snapshot_interval
from mlx_engine.kv.tables import KVBudgetError

NO_STATE_FILES = ("KV files are not available for this model: its recurrent state goes in them as a prefix-cache "
                  "snapshot, which is off (sliding-window layers, prefix caching off, or no room in the budget)")


@dataclass(frozen=True)
class StateSpec:
    """One state leaf's arrays for one sequence: each entry's shape (no batch axis) and dtype."""

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[Any, ...]

    @property
    def nbytes(self) -> int:
        total = 0
        for shape, dtype in zip(self.shapes, self.dtypes):
            n = dtype.size
            for d in shape:
                n *= d
            total += n
        return total


class StatePool:
    """Per state leaf, per entry, a (slots, ...) array; a slot per running sequence."""

    def __init__(self, specs: list[StateSpec], num_slots: int):
        if num_slots < 1:
            raise ValueError("a state pool needs a slot")
        self.specs, self.num_slots = specs, num_slots
        self.arrays = [[mx.zeros((num_slots, *s), dtype=d) for s, d in zip(spec.shapes, spec.dtypes)]
                       for spec in specs]
        self.slots: dict[str, int] = {}
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def slot_bytes(self) -> int:
        return sum(s.nbytes for s in self.specs)

    @property
    def nbytes(self) -> int:
        return self.slot_bytes * self.num_slots

    def take(self, req_id: str) -> int:
        """A zeroed slot for the request (its own where it holds one)."""
        if req_id in self.slots:
            return self.slots[req_id]
        if not self._free:
            raise KVBudgetError(f"{req_id}: every one of the {self.num_slots} recurrent-state slots is in use")
        slot = self._free.pop()
        for entries in self.arrays:
            for a in entries:
                a[slot] = mx.zeros(a.shape[1:], dtype=a.dtype)
        self.slots[req_id] = slot
        return slot

    def give(self, req_id: str) -> None:
        slot = self.slots.pop(req_id, None)
        if slot is not None:
            self._free.append(slot)

    def reset(self) -> None:
        for req_id in list(self.slots):
            self.give(req_id)

    def view(self, leaf: int, req_ids: list[str]) -> StateView:
        return StateView(self, leaf, [self.slots[r] for r in req_ids])

    def all_arrays(self) -> list[mx.array]:
        return [a for entries in self.arrays for a in entries]


class StateView:
    """One state leaf's rows for one forward: `read` their slots, run the layer, `write` what it left."""

    def __init__(self, pool: StatePool, leaf: int, slots: list[int]):
        self.pool, self.leaf, self.slots = pool, leaf, slots
        self._index = mx.array(slots, dtype=mx.int32)

    def read(self) -> list[mx.array]:
        return [a[self._index] for a in self.pool.arrays[self.leaf]]

    def write(self, entries: list[Any]) -> None:
        arrays = self.pool.arrays[self.leaf]
        for j, e in enumerate(entries):
            if e is not None:
                arrays[j][self._index] = e.astype(arrays[j].dtype)


class PackedStateView:
    """One state leaf's rows of a packed forward (1, T): the decode rows (one each, read as one (B, ...) batch of
    their slots), then each prefill chunk's rows (one slot). `parts[i]` serves rows `spans[i]`."""

    def __init__(self, parts: list[StateView], spans: list[tuple[int, int]], batched: list[bool]):
        self.parts, self.spans, self.batched = parts, spans, batched


class ScratchState:
    """A state leaf of a forward outside the pool (scoring a prompt once): starts empty, kept only by the object."""

    def __init__(self) -> None:
        self.entries: list[Any] | None = None

    def read(self) -> list[Any] | None:
        return self.entries

    def write(self, entries: list[Any]) -> None:
        self.entries = list(entries)


def slots_in_budget(budget: int | None, slot_bytes: int, max_slots: int) -> int:
    """Slots of `slot_bytes` for `max_slots` sequences, within a quarter of a given KV budget (the rest pages the
    attention leaves)."""
    if budget is None or slot_bytes == 0:
        return max_slots
    return max(0, min(max_slots, budget // 4 // slot_bytes))


class StateCache:
    """The `KVCache` contract over a paged cache of a model's attention leaves and a `StatePool` of its state
    leaves. `leaves[i]` is state leaf i's spec, or None for an attention leaf."""

    def __init__(self, inner: Any, pool: StatePool, leaves: list[StateSpec | None], snapshots: int = 0,
                 context_length: int = 0, notes: tuple[str, ...] = ()):
        """`snapshots`: how many states at block boundaries prefix caching keeps (0: prefix caching off)."""
        self.inner, self.pool, self.leaves, self.notes = inner, pool, leaves, notes
        self._kinds = inner.kinds if isinstance(inner, LayerKindsCache) else [inner]
        first = self._kinds[0]
        on = snapshots > 0 and inner.capabilities.prefix_caching
        self.snapshots = Snapshots(snapshots if on else 0, first.block_size
                                   * snapshot_interval(context_length, first.block_size, snapshots),
                                   first.block_size, first.manager.extra_key)
        self.capabilities = dataclasses.replace(inner.capabilities, prefix_caching=on,
                                                kv_files=inner.capabilities.kv_files and on,
                                                state_slots=pool.num_slots)
        self._tokens: dict[str, list[int]] = {}  # each request's tokens as far as known
        self._read: dict[str, int] = {}  # tokens each request's state has read
        self._before: dict[str, tuple[int, list[list[mx.array]]]] = {}  # its last prefill: start, state there
        self._replay: dict[str, tuple[int, int]] = {}

    @classmethod
    def create(cls, leaves: list[StateSpec | None], config: Any, max_slots: int, context_length: int,
               make_inner: Callable[[Any], Any]) -> StateCache:
        """`make_inner(config)`: the paged cache of the attention leaves within what the slots leave of the budget.
        Slots first, then as many snapshots (prefix caching) as the slots, within a quarter of a given budget."""
        if config.kv_bits is not None or config.kv_key_bits is not None or config.kv_key_per_channel:
            raise RooflineError("quantized KV (kv_bits, kv_key_bits, kv_key_per_channel) is not available for a "
                                "model with recurrent layers")
        specs = [s for s in leaves if s is not None]
        slot_bytes = sum(s.nbytes for s in specs)
        budget = config.kv_budget_bytes
        slots = slots_in_budget(budget, slot_bytes, max_slots)
        if slots < 1:
            raise RooflineError(f"kv_budget_bytes={budget}: too small for one sequence's recurrent state "
                                f"({slot_bytes} bytes, within a quarter of the budget)")
        snaps, notes = slots, ()
        if budget is not None:
            snaps = min(slots, (budget // 4 - slots * slot_bytes) // slot_bytes)
            if snaps < 1 and config.prefix_caching:
                notes = (f"prefix caching is off: kv_budget_bytes={budget} leaves no room for a snapshot of the "
                         f"recurrent state ({slot_bytes} bytes) beside its {slots} slots",)
            config = dataclasses.replace(config, kv_budget_bytes=budget - (slots + max(0, snaps)) * slot_bytes)
        return cls(make_inner(config), StatePool(specs, slots), leaves, max(0, snaps), context_length, notes)

    # --- views, in leaf order ---

    def _merge(self, attention: list[Any], req_ids: list[str]) -> list[Any]:
        out, it, k = [], iter(attention), 0
        for spec in self.leaves:
            if spec is None:
                out.append(next(it))
            else:
                out.append(self.pool.view(k, req_ids))
                k += 1
        return out

    def prefill_layers(self, req_id: str, start: int, end: int) -> list[Any]:
        views = self._merge(self.inner.prefill_layers(req_id, start, end), [req_id])
        before = own_copy(self.pool.arrays, self.pool.slots[req_id])  # the state before this forward writes it
        self._checkpoint(req_id, before)
        self._before[req_id] = (start, before)
        self._read[req_id] = end
        return views

    def decode_layers(self, req_ids: list[str], known_ids: list[list[int]]) -> list[Any]:
        for r, known in zip(req_ids, known_ids):
            self._know(r, known)
            self._checkpoint(r)
            self._read[r] = self._read.get(r, 0) + 1
        return self._merge(self.inner.decode_layers(req_ids, known_ids), req_ids)

    # --- prefix caching: the state at block boundaries ---

    def state_slot(self, req_id: str) -> int:
        return self.pool.slots[req_id]

    def split_at(self, start: int, end: int) -> int | None:
        every = self.snapshots.every
        last = (end - 1) // every * every
        return last if self.snapshots.capacity and last > start else None

    def _know(self, req_id: str, token_ids: list[int]) -> None:
        if len(token_ids) >= len(self._tokens.get(req_id, ())):
            self._tokens[req_id] = list(token_ids)
        self.snapshots.settle(req_id, self._tokens[req_id])

    def _checkpoint(self, req_id: str, state: list[list[mx.array]] | None = None) -> None:
        """Before the request's state moves on: kept where it stands at a snapshot boundary."""
        position = self._read.get(req_id, 0)
        if req_id in self.pool.slots and self.snapshots.due(req_id, position):
            state = state or own_copy(self.pool.arrays, self.pool.slots[req_id])
            self.snapshots.take(req_id, position, state, self._tokens.get(req_id, []))

    def _start_from(self, req_id: str, prompt_ids: list[int]) -> int:
        """The attention leaves started from the longest cached prefix with a state snapshot at its end (or from
        nothing), the slot holding that state. Returns the prefix's length."""
        cached = min(c.tables.cached_tokens(prompt_ids) for c in self._kinds)
        self.snapshots.drop_uncached(prompt_ids, cached)
        length, state = self.snapshots.best(prompt_ids, cached)
        if state is None:
            return self.inner.start(req_id, prompt_ids, reuse=False)
        started: list[Any] = []
        try:
            for c in self._kinds:
                got = c.tables.start(req_id, prompt_ids, True, length)
                started.append(c)
                if got != length:  # a kind holds less of it (a sliding window's own hit): none is reused
                    break
        except Exception:
            for c in started:
                c.free(req_id)
            raise
        if len(started) < len(self._kinds) or got != length:
            for c in started:
                c.free(req_id)
            return self.inner.start(req_id, prompt_ids, reuse=False)
        slot = self.pool.slots[req_id]
        for entries, saved in zip(self.pool.arrays, state):
            for a, b in zip(entries, saved):
                a[slot] = b
        self.snapshots.num_restored += 1
        return length

    def packed_layers(self, decode_ids: list[str], known_ids: list[list[int]],
                      chunks: list[tuple[str, int, int]]) -> list[Any]:
        attention = self.inner.packed_layers(decode_ids, known_ids, chunks)
        for r, known in zip(decode_ids, known_ids):
            self._know(r, known)
            self._checkpoint(r)
            self._read[r] = self._read.get(r, 0) + 1
        spans, batched, row = [], [], len(decode_ids)
        if decode_ids:
            spans.append((0, row))
            batched.append(True)
        for req_id, start, end in chunks:
            self._checkpoint(req_id)
            self._read[req_id] = end
            spans.append((row, row + end - start))
            batched.append(False)
            row += end - start
        groups = ([decode_ids] if decode_ids else []) + [[c[0]] for c in chunks]
        out, it, k = [], iter(attention), 0
        for spec in self.leaves:
            if spec is None:
                out.append(next(it))
            else:
                out.append(PackedStateView([self.pool.view(k, g) for g in groups], spans, batched))
                k += 1
        return out

    def state(self, layers: list[Any]) -> list[Any]:
        attention = [v for v in layers if not isinstance(v, (StateView, PackedStateView))]
        return self.inner.state(attention) + self.pool.all_arrays()

    # --- admission and requests ---

    def check_fits(self, num_tokens: int) -> None:
        self.inner.check_fits(num_tokens)

    def blocks_for(self, num_tokens: int) -> int:
        return self.inner.blocks_for(num_tokens)

    def num_free_blocks(self) -> int:
        return self.inner.num_free_blocks()

    def num_blocks_held(self, req_id: str) -> int:
        return self.inner.num_blocks_held(req_id)

    def start(self, req_id: str, prompt_ids: list[int], reuse: bool = True) -> int:
        """A slot and the attention leaves' blocks: from the longest cached prefix with a state snapshot at its end
        where `reuse` (its state restored into the slot), else from nothing."""
        self._forget(req_id)
        self.pool.take(req_id)
        try:
            cached = self._start_from(req_id, prompt_ids) if reuse and self.snapshots.capacity else \
                self.inner.start(req_id, prompt_ids, reuse=False)
        except Exception:
            self.pool.give(req_id)
            raise
        self._read[req_id], self._tokens[req_id] = cached, list(prompt_ids)
        return cached

    def allocate(self, req_id: str, token_ids: list[int], num_new_tokens: int) -> None:
        fresh = req_id not in self.pool.slots
        self.pool.take(req_id)  # a request not started (scoring) gets its slot here
        try:
            self.inner.allocate(req_id, token_ids, num_new_tokens)
        except Exception:
            if fresh:
                self.pool.give(req_id)
            raise

    def trim(self, req_id: str, num_tokens: int) -> None:
        read = self._read.get(req_id, 0)
        if num_tokens < read:
            start, before = self._before.get(req_id, (read, []))
            if start > num_tokens:
                raise RooflineError(f"{req_id}: its recurrent state cannot go back to {num_tokens} tokens (it "
                                    f"holds the state at {start} and at {read})")
            slot = self.pool.slots[req_id]
            for entries, saved in zip(self.pool.arrays, before):
                for a, b in zip(entries, saved):
                    a[slot] = b
            self._read[req_id] = start
            if num_tokens > start:
                self._replay[req_id] = (start, num_tokens)
        self.inner.trim(req_id, num_tokens)

    def replay(self, req_id: str) -> tuple[int, int] | None:
        return self._replay.pop(req_id, None)

    def _forget(self, req_id: str) -> None:
        self.pool.give(req_id)
        self.snapshots.forget(req_id)
        for d in (self._read, self._before, self._replay, self._tokens):
            d.pop(req_id, None)

    def record(self, req_id: str, known_ids: list[int]) -> None:
        self._know(req_id, known_ids)
        self.inner.record(req_id, known_ids)

    def finish(self, req_id: str, fed_ids: list[int]) -> None:
        if req_id in self.pool.slots:  # its state at the end: the next turn's prefix
            self._know(req_id, fed_ids)
            self._checkpoint(req_id)
        self._forget(req_id)
        self.inner.finish(req_id, fed_ids)

    def free(self, req_id: str) -> None:
        self._forget(req_id)
        self.inner.free(req_id)

    def drop_request(self, req_id: str) -> None:
        self._forget(req_id)
        self.inner.drop_request(req_id)

    def drop(self) -> None:
        for req_id in list(self.pool.slots):
            self._forget(req_id)
        self.snapshots.clear()
        self.inner.drop()

    def calibrate(self, model: Any, tokenizer: Any, vocab_size: int) -> None:
        pass  # unquantized (`create` refuses quantized KV)

    def check_kernels(self) -> tuple[str, ...]:
        return self.inner.check_kernels()

    def stats(self) -> dict[str, Any]:
        out = dict(self.inner.stats())
        snaps = self.snapshots
        out.update(state_slots=self.pool.num_slots, state_slots_used=len(self.pool.slots),
                   state_bytes_per_slot=self.pool.slot_bytes, bytes_state=self.pool.nbytes,
                   state_snapshots=snaps.count, state_snapshot_capacity=snaps.capacity,
                   state_snapshot_every=snaps.every, state_snapshots_restored=snaps.num_restored,
                   bytes_state_snapshots=snaps.count * self.pool.slot_bytes)
        return out

    def save(self, path: str, token_ids: list[int], fingerprint: bytes) -> int:
        """The attention blocks of the longest cached prefix of `token_ids` that ends at a state snapshot, and
        that snapshot."""
        from mlx_engine.kv.state_snapshots import add_state_to_file

        if not self.capabilities.kv_files:
            raise RooflineError(NO_STATE_FILES)
        cached = min(c.tables.cached_tokens(list(token_ids) + [0]) for c in self._kinds)
        length, state = self.snapshots.best(list(token_ids), cached)
        if state is None:
            raise RooflineError("nothing to save: no cached prefix of these tokens has its recurrent state kept "
                                f"(kept every {self.snapshots.every} tokens)")
        n = self.inner.save(path, list(token_ids[:length]), fingerprint)
        add_state_to_file(path, state, n)
        return n

    def restore(self, path: str, fingerprint: bytes) -> list[int]:
        from mlx_engine.kv.state_snapshots import state_from_file

        if not self.capabilities.kv_files:
            raise RooflineError(NO_STATE_FILES)
        from pathlib import Path

        from mlx_engine.api import ModelLoadError
        from mlx_engine.kv.files import KVRestoreError
        from mlx_engine.loading.safetensors_file import validate_safetensors

        try:
            validate_safetensors(Path(path))
        except ModelLoadError as e:
            raise KVRestoreError(f"saved KV refused: {e}") from None
        state = state_from_file(path, self.pool.arrays)  # checked before any block is written
        tokens = self.inner.restore(path, fingerprint)
        self.snapshots.put(tokens, state)
        return tokens
