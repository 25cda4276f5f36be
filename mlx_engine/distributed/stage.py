"""One forward across the ranks, the same code on each: rank 0 calls it with the step's token ids, the others
with what rank 0's plan says.

Pipeline (`plan.py` for who holds what): rank 0 embeds and sends the rows to rank 1 in one message; rank r runs
its layers over each micro-batch and sends it on; rank 0 receives them from rank N-1 and runs the last layers. A
forward over several packed parts (sequences' prefill chunks, decode rows) is cut into micro-batches at part
boundaries, so rank 1 works on the second while rank 0 works on the first; each hop carries
(1, rows, hidden) activations. Tensor parallel: every rank runs every layer on its heads and MLP columns, the model's
two all-sums per layer (`shard.SumAcrossRanks`) keep them in step.
"""

from __future__ import annotations

import time
from typing import Any

import mlx.core as mx

from mlx_engine.kv.views import PackedView

# micro-batches pay from here: below, splitting a forward costs each rank another pass over its weights (a decode
# step reads them whatever its row count) for less overlap than that pass costs
MIN_ROWS_PER_MICRO_BATCH = 32


def part_spans(layers: list[Any]) -> list[tuple[int, int]] | None:
    """Row spans of a packed forward's parts (the decode rows as one part, then each prefill chunk), or None when
    the views are not packed."""
    view = layers[0]
    if not isinstance(view, PackedView):  # the paged cache's packed views (every rank's cache is one)
        return None
    spans = [(0, view.num_decode)] if view.decode is not None else []
    return spans + list(view.spans)


def micro_batches(layers: list[Any], num_stages: int) -> list[tuple[int, int, int, int]] | None:
    """Consecutive groups of a packed forward's parts, as (first row, end row, first part, end part), balanced by
    rows, at most `num_stages` of them and none under MIN_ROWS_PER_MICRO_BATCH rows; None: one forward."""
    spans = part_spans(layers)
    if spans is None or len(spans) < 2 or num_stages < 2:
        return None
    total = spans[-1][1]
    count = min(num_stages, len(spans), total // MIN_ROWS_PER_MICRO_BATCH)
    if count < 2:
        return None
    groups, first = [], 0
    for g in range(count):
        target = total * (g + 1) / count
        end = first + 1
        while end < len(spans) - (count - g - 1) and spans[end - 1][1] < target:
            end += 1
        if g == count - 1:
            end = len(spans)
        groups.append((spans[first][0], spans[end - 1][1], first, end))
        first = end
    return groups


def sub_views(layers: list[Any], part_first: int, part_end: int) -> list[Any]:
    """Each layer's view of parts [part_first, part_end) of a packed forward."""
    out = []
    for view in layers:
        has_decode = view.decode is not None
        decode = view.decode if has_decode and part_first == 0 else None
        lo = part_first - (1 if has_decode else 0)
        hi = part_end - (1 if has_decode else 0)
        lo = max(lo, 0)
        prefills = view.prefills[lo:hi]
        lengths = [b - a for a, b in view.spans[lo:hi]]
        out.append(PackedView(decode, view.num_decode if decode is not None else 0, prefills, lengths))
    return out


def run_layers(model: Any, h: mx.array, layers: list[Any]) -> mx.array:
    """h (B, L, hidden) through this rank's decoder layers, each reading its view."""
    for layer, view in zip(model.layers, layers):
        h = layer(h, view)
    return h


class Stage:
    """This rank's part of a forward. `waiting(doing)`: a context that keeps the run's deadline on rank 0 (names the
    peer and ends the run when it passes, or when the connection is lost), a no-op elsewhere; `state(layers)` is
    what a forward through `layers` writes (the KV to evaluate)."""

    def __init__(self, mode: str, model: Any, group: Any, hidden: int, dtype: mx.Dtype, waiting: Any, state: Any):
        self.mode, self.model, self.group = mode, model, group
        self.rank, self.size = group.rank(), group.size()
        self.hidden, self.dtype = hidden, dtype
        self.waiting, self.state = waiting, state
        self.bytes_exchanged = 0  # activation bytes this rank sent (pipeline) or all-summed (tensor)
        self.num_forwards = self.num_micro_batched = 0  # forwards, and those cut into micro-batches
        self.busy_s = 0.0  # seconds spent computing this rank's layers (pipeline), not waiting for activations

    def forward(self, tokens: mx.array, layers: list[Any], groups: list[Any] | None) -> mx.array | None:
        """tokens (B, L) -> rank 0: final hidden states (B, L, hidden), evaluated; other ranks: None."""
        self.num_forwards += 1
        self.num_micro_batched += groups is not None
        if self.mode == "tensor":
            t = time.perf_counter()
            try:
                return self._tensor(tokens, layers)
            finally:
                self.busy_s += time.perf_counter() - t  # the all-sums' waits included
        return self._pipeline(tokens, layers, groups)

    def _tensor(self, tokens: mx.array, layers: list[Any]) -> mx.array | None:
        B, L = tokens.shape
        self.bytes_exchanged += 2 * len(self.model.layers) * B * L * self.hidden * self.dtype.size
        # the all-sums run inside the forward too (the CPU backend's host BLAS evaluates each projection's input)
        with self.waiting("running a forward with the other ranks"):
            h = self.model(tokens, layers)  # two all-sums per layer
            mx.eval(h, *self.state(layers))
        return h if self.rank == 0 else None

    def _pipeline(self, tokens: mx.array, layers: list[Any], groups: list[Any] | None) -> mx.array | None:
        B, L = tokens.shape
        nxt, prv = (self.rank + 1) % self.size, (self.rank - 1) % self.size
        parts = [(0, L, None)] if groups is None else [(a, b, sub_views(layers, p, q)) for a, b, p, q in groups]
        if self.rank == 0:
            h = self.model.model.embed_tokens(tokens)  # (B, L, hidden)
            self._send(h, nxt, "sending the embedded rows to rank 1")
            outs = []
            for a, b, views in parts:  # each micro-batch evaluated in turn: rank 1 works on the next meanwhile
                x = self._recv((B, b - a, self.hidden), prv)
                t = time.perf_counter()
                outs.append(run_layers(self.model, x, views or layers))
                mx.eval(outs[-1], *self.state(layers))
                self.busy_s += time.perf_counter() - t
            h = self.model.model.norm(outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=1))
            mx.eval(h)
            return h
        first = self._recv((B, L, self.hidden), prv) if self.rank == 1 else None  # rank 0 sent every row at once
        for a, b, views in parts:
            x = first[:, a:b] if first is not None else self._recv((B, b - a, self.hidden), prv)
            t = time.perf_counter()
            x = run_layers(self.model, x, views or layers)
            mx.eval(x, *self.state(layers))
            self.busy_s += time.perf_counter() - t
            self._send(x, nxt, f"sending activations to rank {nxt}")
        return None

    def _recv(self, shape: tuple[int, ...], src: int) -> mx.array:
        """The activations from `src`, evaluated: the wait is kept apart from the work (`busy_s`)."""
        x = mx.distributed.recv(shape, self.dtype, src, group=self.group)
        with self.waiting(f"waiting for rank {src}'s activations"):
            mx.eval(x)
        return x

    def _send(self, x: mx.array, dst: int, doing: str) -> None:
        self.bytes_exchanged += x.nbytes
        with self.waiting(doing):
            mx.eval(mx.distributed.send(x, dst, group=self.group))
