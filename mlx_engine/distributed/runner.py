"""Rank 0's model runner: the scheduler's runner, whose every forward is one step of the rank plan.

The scheduler, prefix caching, continuous batching, chunked prefill, sampling and speculative verification run on
rank 0 unchanged: they reach the cache through `MirroredCache`, whose changing calls go to every rank with the next
forward, and each forward (`_forward`) sends the step's token ids, the views it reads and the block tables' checksum
before rank 0 runs its own part. Rank 0 samples; the other ranks never see logits. A draft model lives on rank 0.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import threading
import zlib
from collections import deque
from typing import Any

import mlx.core as mx
import numpy as np

from mlx_engine.api import RooflineError
from mlx_engine.backends.base import RunnerCapabilities
from mlx_engine.backends.phases import PlanExecution
from mlx_engine.distributed.mirror import MirroredCache, PlanLog, PlannedLayers, TrimRecorded, lockstep_figures
from mlx_engine.distributed.node import Node
from mlx_engine.distributed.stage import MIN_DECODE_ROWS_PER_MICRO_BATCH, InFlight, micro_batches
from mlx_engine.kv.views import PackedView, PagedDecodeView
from mlx_engine.switches import PIPELINE_DECODE_ROWS, PIPELINE_IN_FLIGHT, PIPELINE_MICRO_BATCHES, Variable


def _sample_rows(logits: mx.array, samplers: list[Any]) -> mx.array:
    from mlx_engine.backends.mlx.runner import _sample_rows as sample

    return sample(logits, samplers)


def _whole_env(variable: Variable, default: int) -> int:
    raw = variable.raw()
    if not raw:
        return default
    if not raw.isdigit() or int(raw) < 1:
        raise RooflineError(f"{variable.name}={raw!r}: expected a whole number >= 1")
    return int(raw)


def micro_batch_count(num_ranks: int) -> int:
    """Micro-batches a pipelined forward may be cut into: one per rank, or $ROOFLINE_PIPELINE_MICRO_BATCHES (1: never
    cut; for measuring what they gain)."""
    return _whole_env(PIPELINE_MICRO_BATCHES, num_ranks)


def min_decode_rows() -> int:
    """Sequences each micro-batch of a decode step needs: MIN_DECODE_ROWS_PER_MICRO_BATCH, or
    $ROOFLINE_PIPELINE_DECODE_ROWS (for measuring where cutting pays)."""
    return _whole_env(PIPELINE_DECODE_ROWS, MIN_DECODE_ROWS_PER_MICRO_BATCH)


def decode_groups(mode: str, num_ranks: int) -> int:
    """Groups of decoding sequences the scheduler may step in turn, each in flight while the others run: one per
    pipeline rank with $ROOFLINE_PIPELINE_IN_FLIGHT=1; else 1 (lockstep), and always for tensor parallel. Off by
    default: each group's step reads the rank's weights again, which costs more CPU per token than the overlap
    gained where the ranks share cores (measured on the 2-core box: docs/distributed.md)."""
    raw = PIPELINE_IN_FLIGHT.raw()
    if raw not in ("", "0", "1"):
        raise RooflineError(f"{PIPELINE_IN_FLIGHT.name}={raw!r}: expected 1 (a decode step of each group of sequences in "
                            "flight on the pipeline) or 0 (every rank in lockstep, the default)")
    return num_ranks if mode == "pipeline" and raw == "1" else 1


def _decode_only(layers: list[Any]) -> bool:
    view = layers[0]
    return isinstance(view, PagedDecodeView) or (isinstance(view, PackedView) and view.decode is not None
                                                 and not view.spans)


def tables_checksum(cache: Any, req_ids: list[str]) -> int:
    return zlib.crc32(json.dumps(lockstep_figures(cache, req_ids)).encode())


class DistributedRunner(PlanExecution):
    """Rank 0's side of a distributed engine (`Engine.load(..., distributed="pipeline" | "tensor")`)."""

    def __init__(self, node: Node):
        self.node = node
        self.local = local = node.local
        self.log = PlanLog()
        self.cache = MirroredCache(local.cache, self.log)
        # rank 0's paged cache holds a part of each block's KV: no files (`capabilities`, which front ends read here)
        self.tokenizer, self.info = local.tokenizer, dataclasses.replace(local.info, kv_files=False)
        self.prefill_chunk_size, self.context_length = local.prefill_chunk_size, local.context_length
        self.vocab_size, self.eos_ids, self.fingerprint = local.vocab_size, local.eos_ids, local.fingerprint
        self.draft, self.self_draft_layers = local.draft, 0
        self.capabilities = RunnerCapabilities(rollback=True, kv_files=False, self_draft=False, hidden_states=False,
                                               max_batch=local.capabilities.max_batch,
                                               decode_groups=decode_groups(node.mode, node.size), why_not={
            "kv_files": "KV files are not available with --distributed: each rank holds a part of it",
            "self_draft": "is not available with --distributed: the model's first layers are on another rank; use "
                          "'prompt-lookup' or 'draft'",
            "hidden_states": "are not available with --distributed: each rank holds only its layers"})
        self.closed = False
        self._resting = False  # the other ranks wait on the doorbell (`rest`)
        self._pending: deque[InFlight] = deque()  # forwards in flight, oldest first (`launch`)
        self._landed: list[tuple[Any, Any]] = []  # (tag, tokens) of those finished, not yet returned
        self._owner = threading.current_thread()  # the engine thread: the only one that may use the channel
        self._link: dict[str, float] | None = None
        self.micro_batches, self.min_decode_rows = micro_batch_count(node.size), min_decode_rows()
        # each rank's shard, for pricing a decode step from any thread (Engine.decode_bytes_per_token is called
        # off the engine thread, where no collective may run)
        self.shards = self.gather_figures()
        atexit.register(self._at_exit)  # the other ranks end when rank 0 does, even without Engine.close
        if node.doorbell is not None:
            from mlx_engine.engine_thread import engine_thread

            engine_thread().on_idle(self.rest)

    @property
    def model(self) -> Any:
        return self.local.model

    # --- the plan ---

    def _at_exit(self) -> None:
        if self.closed:
            return
        if threading.current_thread() is self._owner:
            self.release()
            return
        from mlx_engine.engine_thread import engine_thread

        try:  # between the engine's steps, as every collective of rank 0 runs
            engine_thread().submit(self.release).result(timeout=30)
        except Exception:  # noqa: BLE001 - exiting anyway; the other ranks then report rank 0 lost
            pass

    def rest(self) -> None:
        """The engine is idle: the other ranks wait on the doorbell, which costs them no CPU, until the next plan."""
        if self._resting or self.closed or self.node.doorbell is None or self._pending:
            return
        self._send({"do": "rest"}, "telling the ranks to rest")
        self._resting = True

    def _send(self, plan: dict[str, Any], doing: str = "sending a step's plan", settle: bool = True) -> None:
        if threading.current_thread() is not self._owner:
            raise RooflineError("a distributed runner's collectives run on the engine thread only")
        if self._resting:
            assert self.node.doorbell is not None
            try:
                self.node.doorbell.ring()
            except OSError as e:
                raise RooflineError(f"rank 0 could not wake the other ranks ({e}): a rank has ended") from None
            self._resting = False
        if settle:  # every rank takes its plans in order: the forwards in flight end before anything else
            self._finish_pending()
        plan["ops"] = self.log.take()
        self.node.channel.broadcast(json.dumps(plan, separators=(",", ":")).encode(), doing)

    def _forward(self, inputs: mx.array, layers: list[Any]) -> mx.array:
        """inputs (B, L) -> final hidden states (B, L, hidden), evaluated, after every rank ran its part."""
        if not isinstance(layers, PlannedLayers):
            raise RooflineError("a distributed forward needs views from the engine's cache (runner.cache)")
        self._finish_pending()  # the ranks take their plans in order; its tokens may have been sampled in flight
        tokens = np.array(inputs, dtype=np.int32)  # the step's ids go to every rank: read them now
        groups = micro_batches(layers, self.micro_batches, self.min_decode_rows) if self.node.mode == "pipeline" \
            else None
        self._send({"do": "forward", "views": layers.op, "tokens": tokens.tolist(), "groups": groups,
                    "crc": tables_checksum(self.local.cache, self.log.view_reqs.get(layers.op, []))})
        return self.node.stage.forward(mx.array(tokens), layers, groups)

    def launch(self, inputs: mx.array, layers: list[Any], samplers: list[Any], tag: Any) -> list[tuple[Any, Any]]:
        """`backends.base.InFlightDecode`: a plain decode forward's plan and rows go out; once `decode_groups - 1`
        are in flight, the oldest is finished while the other ranks run this one."""
        if not (isinstance(layers, PlannedLayers) and self.node.mode == "pipeline" and _decode_only(layers)):
            raise RooflineError("a forward in flight is a pipeline's decode step over views from the engine's cache")
        oldest = None
        if len(self._pending) >= self.capabilities.decode_groups - 1:
            # its rows are back before this plan goes out: on two ranks the ring never has both ranks sending
            oldest = self._pending.popleft()
            self.node.stage.arrive(oldest)
        tokens = np.array(inputs, dtype=np.int32)  # tokens that have landed: evaluated already
        self._send({"do": "forward", "views": layers.op, "tokens": tokens.tolist(), "groups": None,
                    "crc": tables_checksum(self.local.cache, self.log.view_reqs.get(layers.op, []))}, settle=False)
        flight = self.node.stage.launch(mx.array(tokens), layers)
        flight.tag, flight.samplers = tag, samplers
        self._pending.append(flight)  # first: rank 0 receives the ranks' replies in the order it sent the plans
        if oldest is not None:  # rank 0's part of the oldest while the other ranks run this one
            self._complete(oldest)
        landed, self._landed = self._landed, []
        return landed

    def settle(self) -> list[tuple[Any, Any]]:
        self._finish_pending()
        landed, self._landed = self._landed, []
        return landed

    def _finish_pending(self) -> None:
        while self._pending:
            self._complete(self._pending.popleft())

    def _complete(self, flight: InFlight) -> None:
        """Rank 0's layers, the head and sampling of a forward in flight, as a decode step samples them
        (`packed_sample` over decode rows, or `decode_sample`); its tokens wait in `_landed`."""
        h = self.node.stage.complete(flight)
        view = flight.layers[0]
        rows = h[0, mx.array(list(range(view.num_decode)), dtype=mx.int32)] if isinstance(view, PackedView) \
            else h[:, -1, :]
        tokens = _sample_rows(self.logits(rows), flight.samplers)
        mx.eval(tokens)
        self._landed.append((flight.tag, tokens))

    def gather_figures(self) -> list[dict[str, Any]]:
        """Every rank's weights, KV pool and traffic (`Node.figures`), by rank."""
        self._send({"do": "gather"}, "asking the ranks for their figures")
        return self.node.channel.gather_json(self.node.figures())

    def link(self) -> dict[str, float]:
        """The link to rank 1, measured once (`link.measure_link`): latency_s, bandwidth_bytes_s, probe_bytes."""
        if self._link is None:
            from mlx_engine.distributed.link import measure_link

            self._send({"do": "link"}, "asking the ranks to measure the link")
            with self.node.channel.deadline.waiting(self.node.channel.peers, "measuring the link"):
                self._link = measure_link(self.node.group, self.node.channel)
        return self._link

    def release(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self._send({"do": "stop"}, "telling the ranks to stop")
        except RooflineError:
            pass  # they are gone already
        if self.node.doorbell is not None:
            from mlx_engine.engine_thread import engine_thread

            engine_thread().off_idle(self.rest)
            self.node.doorbell.close()
        if self.local.draft is not None:
            self.local.draft.release()
        self.cache = self.local.cache = None
        mx.clear_cache()

    # --- forwards by phase (`backends.base.ModelRunner`) ---

    def forward(self, inputs: mx.array, layers: list[Any]) -> mx.array:
        return self._forward(inputs, layers)

    def prefill(self, inputs: mx.array, layers: list[Any]) -> None:
        self._forward(inputs, layers)

    def logits(self, h: mx.array) -> mx.array:
        return self.local.model.logits(h).astype(mx.float32)

    def _last_logits(self, inputs: mx.array, layers: list[Any]) -> mx.array:
        return self.logits(self._forward(inputs, layers)[:, -1, :])

    prefill_logits = decode_logits = _last_logits

    def decode_sample(self, inputs: mx.array, layers: list[Any], samplers: list[Any]) -> mx.array:
        return _sample_rows(self.decode_logits(inputs, layers), samplers)

    def packed_logits(self, inputs: mx.array, layers: list[Any], rows: list[int]) -> mx.array | None:
        out = self._forward(inputs, layers)
        return self.logits(out[0, mx.array(rows, dtype=mx.int32)]) if rows else None

    def packed_sample(self, inputs: mx.array, layers: list[Any], rows: list[int],
                      samplers: list[Any]) -> mx.array | None:
        logits = self.packed_logits(inputs, layers, rows)
        return None if logits is None else _sample_rows(logits, samplers)

    def verify_logits(self, inputs: mx.array, layers: list[Any]) -> mx.array:
        return self.logits(self._forward(inputs, layers))[0]

    def draft_logits(self, inputs: mx.array, layers: list[Any], num_layers: int) -> mx.array:
        raise RooflineError(f"speculative='self' {self.capabilities.reason('self_draft')}")

    def scratch_layers(self) -> list[Any]:
        """Contiguous buffers on every rank (the speculative cost curve's timing forwards)."""
        op = self.log.add(["k", "new", [], {}])
        out = PlannedLayers(TrimRecorded(self.log, op, i, c) for i, c in enumerate(self.local.scratch_layers()))
        out.op = op
        return out

    def graph_step(self, width: int, context: int) -> None:
        return None

    def timing_variant(self) -> str:
        return ""

    def forward_paths(self) -> dict[str, int]:
        return {}  # each rank runs the MLX forward; rank 0 records none of its own

    def _scratch_logits(self, ids: list[int], rows: str) -> list[np.ndarray]:
        """A forward over `ids` from an empty cache, in prefill chunks through the paged cache (every rank's):
        each chunk's logits, all rows or the last."""
        req = f"scratch-{id(ids)}-{self.log.num_ops}"
        cache = self.cache
        cache.check_fits(len(ids))
        cache.allocate(req, ids, len(ids))  # KV of its own
        out = []
        try:
            for start in range(0, len(ids), self.prefill_chunk_size):
                end = min(start + self.prefill_chunk_size, len(ids))
                h = self._forward(mx.array([ids[start:end]], dtype=mx.int32), cache.prefill_layers(req, start, end))
                out.append(np.array(self.logits(h[0] if rows == "all" else h[0, -1:])))
        finally:
            cache.free(req)
        return out

    def forward_logits(self, ids: list[int]) -> np.ndarray:
        return np.concatenate(self._scratch_logits(ids, "all"))

    def score(self, ids: list[int]) -> np.ndarray:
        from mlx_engine.sampling import target_logprobs

        logits = mx.array(self.forward_logits(ids)[:-1])
        return np.array(target_logprobs(logits, ids[1:], 0)[0]) if len(ids) > 1 else np.zeros(0, np.float32)

    def hidden_states(self, ids: list[int]) -> list[np.ndarray]:
        raise RooflineError(f"hidden states {self.capabilities.reason('hidden_states')}")

    # --- what the engine asks besides forwards ---

    def kv_stats(self) -> dict[str, Any]:
        stats = self.local.cache.stats()
        stats.update(ranks=self.gather_figures(), link=self.link(), mode=self.node.mode)
        return stats

    def decode_bytes_per_token(self, context: int) -> int:
        """Bytes every rank together reads per decode step: each rank's weights and the KV of its layers or heads."""
        from mlx_engine.roofline import decode_bytes_per_token

        total = 0
        a = self.local.shape
        for f in self.shards:
            total += decode_bytes_per_token(f["weight_bytes"], 0, False, f["kv_layers"], f["kv_heads"], a["head_dim"],
                                            context, a["kv_itemsize"]).total
        return total

    def moe_routing(self) -> None:
        return None  # sharded models are native families, all dense

    def save_kv(self, path: str, token_ids: list[int]) -> int:
        raise RooflineError("saving KV is not available with --distributed: each rank holds a part of it")

    def restore_kv(self, path: str) -> list[int]:
        raise RooflineError("restoring KV is not available with --distributed: each rank holds a part of it")

    def reset_peak_memory(self) -> None:
        self.local.reset_peak_memory()

    def peak_memory_bytes(self) -> int:
        return self.local.peak_memory_bytes()
