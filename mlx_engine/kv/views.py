"""What a model layer sees of the MLX paged cache in one forward: views that rope at their positions, write the
new K/V into the pool and attend through the path the attention table picked for the step (`mlx_engine.attention`).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from mlx_engine.attention import Path, choose, scored_path, storage_case
from mlx_engine.kv.paged import KeyWritePlan, PagedKVStorage


class PagedPrefillView:
    """One layer's view of a prefill chunk (or a speculative verification) of one sequence, positions
    [offset, offset + L). `all_slots` are the slots of positions [base, offset + L): every earlier one (base 0), or
    with a sliding window (`storage.window`) from a block boundary at or before offset - window + 1."""

    def __init__(self, storage: PagedKVStorage, layer: int, offset: int, new_slots: mx.array,
                 all_slots: mx.array | list[slice], key_plan: KeyWritePlan | None = None,
                 table: list[int] | None = None, path: Path | None = None, base: int = 0):
        self.storage, self.layer, self.offset, self.base = storage, layer, offset, base
        self.new_slots, self.all_slots = new_slots, all_slots  # (L,), (offset + L - base,) ids or runs of slots
        self.key_plan = key_plan  # per-channel keys: the chunk's `plan_key_writes`
        self.table = table  # the sequence's block ids (the path's twin reads through them)
        self.path = path or choose(storage_case("prefill", storage))

    def rope(self, rope: Any, q: mx.array, k: mx.array) -> tuple[mx.array, mx.array]:
        return rope(q, offset=self.offset), rope(k, offset=self.offset)

    def attention(self, q: mx.array, k: mx.array, v: mx.array, scale: float, softcap: float | None = None,
                  sinks: mx.array | None = None) -> mx.array:
        """q (1, Hq, L, D), k/v (1, Hkv, L, D) after rope -> (1, Hq, L, D); writes k/v to the pool."""
        st = self.storage
        st.write(self.layer, self.new_slots, k[0].transpose(1, 0, 2), v[0].transpose(1, 0, 2), self.key_plan)
        q = st.queries(self.layer, q)
        if softcap is None and sinks is None:
            return st.outputs(self.layer, self.path.run(self, q, scale))
        path = scored_path("prefill", softcap is not None, sinks is not None)
        return st.outputs(self.layer, path.run(self, q, scale, softcap=softcap, sinks=sinks))


class DecodeStep:
    """What every layer's view shares in one decode step of B sequences (one new token each), and the path the
    attention table picked for it. With a sliding window (`storage.window`) the block tables and lengths may start
    at a later block of each sequence (the same number of blocks dropped from both: a sequence's table row j, its
    lengths counted from there); `offset` stays the new tokens' positions."""

    def __init__(self, storage: PagedKVStorage, offset: mx.array | int, new_slots: mx.array, block_tables: mx.array,
                 seq_lens: mx.array, max_seq_len: int, all_slots: mx.array | list[slice] | None = None,
                 key_plan: KeyWritePlan | None = None):
        self.storage, self.offset = storage, offset  # offset: (B,) positions of the new tokens (one: an int)
        self.new_slots, self.block_tables, self.seq_lens = new_slots, block_tables, seq_lens  # (B,), (B, nb), (B,)
        self.max_seq_len = max_seq_len
        self.all_slots = all_slots  # (S,) every slot of a single sequence, on MLX's CPU backend
        self.key_plan = key_plan  # per-channel keys: the step's `plan_key_writes`
        self.path = choose(storage_case("decode", storage, single=all_slots is not None,
                                        runs=isinstance(all_slots, list)))
        self._host_tables: tuple[np.ndarray, np.ndarray] | None = None

    @property
    def num_rows(self) -> int:
        return int(self.new_slots.shape[0])

    def rows(self, first: int, end: int) -> DecodeStep:
        """The step of sequences [first, end) alone (a pipeline's micro-batch of decode rows). The block tables keep
        the whole step's width and `max_seq_len`, so each row attends over the same padded keys as in the whole
        step (the same numbers). A step of one sequence (`all_slots`) or with per-channel keys (one `key_plan`
        for every row) is not cut."""
        if self.all_slots is not None or self.key_plan is not None or not 0 <= first < end <= self.num_rows:
            raise ValueError(f"decode rows [{first}, {end}) of a step of {self.num_rows} rows: not a cut this step "
                             "allows (one sequence, or per-channel keys)")
        offset = self.offset[first:end] if isinstance(self.offset, mx.array) else self.offset
        return DecodeStep(self.storage, offset, self.new_slots[first:end], self.block_tables[first:end],
                          self.seq_lens[first:end], self.max_seq_len)

    def host_tables(self) -> tuple[np.ndarray, np.ndarray]:
        """The step's slots (B, T) and padding mask (B, T) in numpy, for the host path: made once, every layer's
        view reads them."""
        if self._host_tables is None:
            bs = self.storage.block_size
            tables, lens = np.asarray(self.block_tables), np.asarray(self.seq_lens)
            slots = (tables[:, :, None] * bs + np.arange(bs)[None, None, :]).reshape(tables.shape[0], -1)
            cols = np.arange(slots.shape[1])[None, :]
            padding = cols >= lens[:, None]
            if self.storage.window is not None:
                padding |= cols < lens[:, None] - self.storage.window
            self._host_tables = (slots, padding)
        return self._host_tables


class PagedDecodeView:
    """One layer's view of a decode step."""

    def __init__(self, step: DecodeStep, layer: int):
        self.step, self.layer, self.offset = step, layer, step.offset

    def rope(self, rope: Any, q: mx.array, k: mx.array) -> tuple[mx.array, mx.array]:
        return rope(q, offset=self.offset), rope(k, offset=self.offset)

    def attention(self, q: mx.array, k: mx.array, v: mx.array, scale: float, softcap: float | None = None,
                  sinks: mx.array | None = None) -> mx.array:
        """q (B, Hq, 1, D), k/v (B, Hkv, 1, D) after rope -> (B, Hq, 1, D); writes k/v to the pool."""
        step, st = self.step, self.step.storage
        st.write(self.layer, step.new_slots, k[:, :, 0, :], v[:, :, 0, :], step.key_plan)
        q = st.queries(self.layer, q)
        if softcap is None and sinks is None:
            return st.outputs(self.layer, step.path.run(step, self.layer, q, scale))
        path = scored_path("decode", softcap is not None, sinks is not None, step.all_slots is not None)
        return st.outputs(self.layer, path.run(step, self.layer, q, scale, softcap=softcap, sinks=sinks))


class PackedView:
    """One layer's view of a forward over packed rows (1, T) of several sequences, vLLM's mixed batch: first
    one decode row per decoding sequence, then each prefill chunk's rows. The projections and the MLP run
    once over all T rows (one GEMM each, rather than one forward per prefill chunk); rope and attention go
    per part, through the decode view and each prefill chunk's view."""

    offset = 0  # each part ropes and attends at its own positions

    def __init__(self, decode: Any | None, num_decode: int, prefills: list[Any], lengths: list[int]):
        self.decode, self.num_decode, self.prefills = decode, num_decode, prefills
        starts = [num_decode + sum(lengths[:i]) for i in range(len(lengths))]
        self.spans = [(a, a + n) for a, n in zip(starts, lengths)]

    def _parts(self, x: mx.array) -> list[mx.array]:
        """(1, H, T, D) -> the decode rows as (B, H, 1, D), then each chunk's (1, H, L_i, D)."""
        parts = [x[0, :, :self.num_decode].swapaxes(0, 1)[:, :, None, :]] if self.decode is not None else []
        return parts + [x[:, :, lo:hi] for lo, hi in self.spans]

    def _join(self, parts: list[mx.array]) -> mx.array:
        if self.decode is not None:
            parts = [parts[0][:, :, 0, :].swapaxes(0, 1)[None], *parts[1:]]  # (B, H, 1, D) -> (1, H, B, D)
        return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=2)

    def _views(self) -> list[Any]:
        return ([self.decode] if self.decode is not None else []) + list(self.prefills)

    def rope(self, rope: Any, q: mx.array, k: mx.array) -> tuple[mx.array, mx.array]:
        """q (1, Hq, T, D), k (1, Hkv, T, D) -> each part roped at its own positions."""
        pairs = [view.rope(rope, qp, kp) for view, qp, kp in zip(self._views(), self._parts(q), self._parts(k))]
        qs, ks = [a for a, _ in pairs], [b for _, b in pairs]
        out = self._join(qs), self._join(ks)
        self._roped = (*out, qs, ks)  # `attention` of these very arrays takes the parts as they are
        return out

    _roped: tuple[mx.array, mx.array, list[mx.array], list[mx.array]] | None = None

    def attention(self, q: mx.array, k: mx.array, v: mx.array, scale: float, **scores: Any) -> mx.array:
        """q (1, Hq, T, D), k/v (1, Hkv, T, D) after rope -> (1, Hq, T, D); writes every row's k/v (`scores`:
        `softcap`, `sinks`, handed to each part's view)."""
        roped = self._roped
        if roped is not None and roped[0] is q and roped[1] is k:
            qs, ks = roped[2], roped[3]
        else:
            qs, ks = self._parts(q), self._parts(k)
        self._roped = None
        parts = zip(self._views(), qs, ks, self._parts(v))
        return self._join([view.attention(qp, kp, vp, scale, **scores) for view, qp, kp, vp in parts])
