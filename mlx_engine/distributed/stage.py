"""One forward across the ranks, the same code on each: rank 0 calls it with the step's token ids, the others
with what rank 0's plan says.

Pipeline (`plan.py` for who holds what): rank 0 embeds and sends the rows to rank 1 in one message; rank r runs
its layers over each micro-batch and sends it on; rank 0 receives them from rank N-1 and runs the last layers. A
forward over several packed parts (sequences' prefill chunks, decode rows) is cut into micro-batches at part
boundaries, and a decode step over enough sequences into groups of them (`decode_cut`: only where each group's
rows make the step compute-bound), so rank 1 works on the second while rank 0 works on the first; each hop carries
(1, rows, hidden) or (sequences, 1, hidden) activations. Tensor parallel: every rank runs every layer on its heads
and MLP columns, the model's two all-sums per layer (`shard.SumAcrossRanks`) keep them in step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from mlx_engine.kv.views import PackedView, PagedDecodeView

# micro-batches pay from here: below, splitting a forward costs each rank another pass over its weights (a decode
# step reads them whatever its row count) for less overlap than that pass costs
MIN_ROWS_PER_MICRO_BATCH = 32
# decode rows are cut into groups of sequences only when each group has this many: below, a rank's step time hardly
# shrinks with its rows (a pass over its weights and each forward's fixed costs), so two micro-batches cost more than
# the overlap gains; above, the step grows with its rows and rank 1 running one group while rank 0 runs the next pays.
# Measured on two ranks on loopback (docs/distributed.md): cutting cost 1.21x at 8 sequences and 1.05x at 32, and
# gained at 64 (0.69x) and 128 (0.54x)
MIN_DECODE_ROWS_PER_MICRO_BATCH = 32


def _even(first: int, end: int, count: int) -> list[tuple[int, int]]:
    n = end - first
    return [(first + n * g // count, first + n * (g + 1) // count) for g in range(count)]


def _decode_step(view: Any) -> Any | None:
    """The decode step a layer's view reads (a plain decode step, or a packed forward's decode rows), or None."""
    decode = view.decode if isinstance(view, PackedView) else view
    return decode.step if isinstance(decode, PagedDecodeView) else None


def decode_cut(step: Any, num_stages: int, min_rows: int) -> int:
    """Groups of sequences a decode step's rows may be cut into: at most `num_stages`, each of at least `min_rows`
    rows; 1: not cut (a single sequence and per-channel keys never are: `DecodeStep.rows`)."""
    if step is None or step.all_slots is not None or step.key_plan is not None:
        return 1
    return max(1, min(num_stages, step.num_rows // max(min_rows, 1)))


def part_spans(layers: list[Any], num_stages: int = 1,
               min_decode_rows: int = MIN_DECODE_ROWS_PER_MICRO_BATCH) -> list[tuple[int, int]] | None:
    """Row spans of a forward's parts, where a micro-batch may begin: a packed forward's decode rows (one part, or
    up to `num_stages` groups of sequences by `decode_cut`), then each prefill chunk; a plain decode step's groups
    of sequences. None: the views are neither (contiguous buffers)."""
    view = layers[0]
    if isinstance(view, PagedDecodeView):
        return _even(0, view.step.num_rows, decode_cut(view.step, num_stages, min_decode_rows))
    if not isinstance(view, PackedView):  # the paged cache's views (every rank's cache is one)
        return None
    spans = []
    if view.decode is not None:
        spans = _even(0, view.num_decode, decode_cut(_decode_step(view), num_stages, min_decode_rows))
    return spans + list(view.spans)


def micro_batches(layers: list[Any], num_stages: int,
                  min_decode_rows: int = MIN_DECODE_ROWS_PER_MICRO_BATCH) -> list[tuple[int, int]] | None:
    """Consecutive groups of a forward's parts (`part_spans`), as row ranges [first, end) (the rows of a packed
    forward, the sequences of a decode step), balanced by rows, at most `num_stages` of them; a packed forward's
    none under MIN_ROWS_PER_MICRO_BATCH rows unless its decode rows alone are cut. None: one forward."""
    spans = part_spans(layers, num_stages, min_decode_rows)
    if spans is None or len(spans) < 2 or num_stages < 2:
        return None
    total = spans[-1][1]
    decode_groups = decode_cut(_decode_step(layers[0]), num_stages, min_decode_rows)
    count = min(num_stages, len(spans), max(total // MIN_ROWS_PER_MICRO_BATCH, decode_groups))
    if count < 2:
        return None
    groups, first = [], 0
    for g in range(count):
        target = total * (g + 1) / count
        end = first + 1
        # the boundary nearest the target (ties: the later one)
        while end < len(spans) - (count - g - 1) and abs(spans[end][1] - target) <= abs(spans[end - 1][1] - target):
            end += 1
        if g == count - 1:
            end = len(spans)
        groups.append((spans[first][0], spans[end - 1][1]))
        first = end
    return groups


def cuts_decode(layers: list[Any], groups: list[Any] | None) -> bool:
    """Whether `groups` (of `micro_batches`) cut a step's decode rows into groups of sequences."""
    if groups is None:
        return False
    view = layers[0]
    if isinstance(view, PagedDecodeView):
        return True
    rows = view.num_decode if isinstance(view, PackedView) and view.decode is not None else 0
    return any(0 < b < rows for _, b in groups)


def sub_views(layers: list[Any], first: int, end: int) -> list[Any]:
    """Each layer's view of rows [first, end) of a forward (a micro-batch of `micro_batches`): a decode step's
    sequences, or a packed forward's decode rows in that range and the prefill chunks inside it. The layers of one
    micro-batch share one decode step, as a whole forward's do."""
    steps: dict[int, Any] = {}

    def decode_rows(view: Any, lo: int, hi: int) -> Any:
        step = view.step
        if (lo, hi) == (0, step.num_rows):
            return view
        if id(step) not in steps:
            steps[id(step)] = step.rows(lo, hi)
        return PagedDecodeView(steps[id(step)], view.layer)

    out = []
    for view in layers:
        if isinstance(view, PagedDecodeView):
            out.append(decode_rows(view, first, end))
            continue
        nd = view.num_decode if view.decode is not None else 0
        decode = decode_rows(view.decode, first, min(end, nd)) if first < nd else None
        keep = [i for i, (a, b) in enumerate(view.spans) if first <= a and b <= end]
        out.append(PackedView(decode, min(end, nd) - first if decode is not None else 0,
                              [view.prefills[i] for i in keep], [view.spans[i][1] - view.spans[i][0] for i in keep]))
    return out


def run_layers(model: Any, h: mx.array, layers: list[Any]) -> mx.array:
    """h (B, L, hidden) through this rank's decoder layers, each reading its view."""
    for layer, view in zip(model.layers, layers):
        h = layer(h, view)
    return h


@dataclass
class InFlight:
    """Rank 0's part of a pipelined decode forward that has only started (`Stage.launch`): its rows are out on the
    ring; `received` is the recv of what rank N-1 sends back (unevaluated). Nothing of rank 0's layers is built yet:
    on MLX's CPU backend the host GEMMs compute as the graph is built, so building them would wait for the ring."""

    received: mx.array
    layers: list[Any]
    tag: Any = None
    samplers: list[Any] = field(default_factory=list)
    arrived: bool = False


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
        # forwards; those cut into micro-batches; those whose decode rows were cut into groups of sequences
        self.num_forwards = self.num_micro_batched = self.num_micro_batched_decodes = 0
        self.num_in_flight = 0  # rank 0's forwards launched in flight (`launch`)
        self.busy_s = 0.0  # seconds spent computing this rank's layers (pipeline), not waiting for activations

    def forward(self, tokens: mx.array, layers: list[Any], groups: list[Any] | None) -> mx.array | None:
        """tokens (B, L) -> rank 0: final hidden states (B, L, hidden), evaluated; other ranks: None."""
        self.num_forwards += 1
        self.num_micro_batched += groups is not None
        self.num_micro_batched_decodes += cuts_decode(layers, groups)
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
        # micro-batches cut a decode step's (B, 1) rows by sequence, a packed forward's (1, T) along its rows
        axis = 0 if isinstance(layers[0], PagedDecodeView) else 1

        def rows(a: int, b: int) -> tuple[int, ...]:
            return (b - a, L, self.hidden) if axis == 0 else (B, b - a, self.hidden)

        parts = [(0, B if axis == 0 else L, None)] if groups is None else \
            [(a, b, sub_views(layers, a, b)) for a, b in groups]
        if self.rank == 0:
            h = self.model.model.embed_tokens(tokens)  # (B, L, hidden)
            self._send(h, nxt, "sending the embedded rows to rank 1")
            outs = []
            for a, b, views in parts:  # each micro-batch evaluated in turn: rank 1 works on the next meanwhile
                x = self._recv(rows(a, b), prv)
                t = time.perf_counter()
                outs.append(run_layers(self.model, x, views or layers))
                mx.eval(outs[-1], *self.state(layers))
                self.busy_s += time.perf_counter() - t
            h = self.model.model.norm(outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=axis))
            mx.eval(h)
            return h
        first = self._recv((B, L, self.hidden), prv) if self.rank == 1 else None  # rank 0 sent every row at once
        for a, b, views in parts:
            if first is None:
                x = self._recv(rows(a, b), prv)
            else:
                x = first[a:b] if axis == 0 else first[:, a:b]
            t = time.perf_counter()
            x = run_layers(self.model, x, views or layers)
            mx.eval(x, *self.state(layers))
            self.busy_s += time.perf_counter() - t
            self._send(x, nxt, f"sending activations to rank {nxt}")
        return None

    def launch(self, tokens: mx.array, layers: list[Any]) -> InFlight:
        """Rank 0 of a pipeline: embeds a decode forward's rows and sends them to rank 1; the rest waits for
        `complete`, so that rank 0 finishes another forward while the other ranks run this one. The other ranks run
        it as any forward (`forward`, no micro-batches)."""
        B, L = tokens.shape
        self.num_forwards += 1
        self.num_in_flight += 1
        self._send(self.model.model.embed_tokens(tokens), 1 % self.size, "sending the embedded rows to rank 1")
        x = mx.distributed.recv((B, L, self.hidden), self.dtype, (self.rank - 1) % self.size, group=self.group)
        return InFlight(x, layers)

    def arrive(self, flight: InFlight) -> None:
        """Waits for a launched forward's activations from rank N-1 (under the run's deadline)."""
        if not flight.arrived:
            with self.waiting(f"waiting for rank {(self.rank - 1) % self.size}'s activations"):
                mx.eval(flight.received)
            flight.arrived = True

    def complete(self, flight: InFlight) -> mx.array:
        """A launched forward's final hidden states (B, L, hidden), evaluated: rank 0's layers over its activations
        once they are back (the KV writes too), then the norm, as `forward` computes them."""
        self.arrive(flight)
        t = time.perf_counter()
        out = run_layers(self.model, flight.received, flight.layers)
        mx.eval(out, *self.state(flight.layers))
        self.busy_s += time.perf_counter() - t
        h = self.model.model.norm(out)
        mx.eval(h)
        return h

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
