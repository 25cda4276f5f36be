"""CUDA graphs of the torch backend's decode step, as vLLM and gpt-fast capture theirs.

A decode step of a small model is hundreds of tiny kernels (SmolLM2: 30 layers of projections, norms, rope,
KV writes and paged attention); launched one by one from Python, the host's launch cost, not the GPU's memory
bandwidth, sets the speed. A graph replays the whole step with one launch.

A graph is fixed to its tensors' shapes and addresses, so:
- Graphs are keyed by (batch bucket, table-width bucket, pool capacity). A step of B sequences replays the
  graph of the smallest bucket >= B; its padding rows decode token 0 at position 0 into the pool's scratch
  block (`TorchKVStorage.scratch_block`, never handed out), so they write nothing a sequence reads. Block
  tables are padded to a power-of-two width (>= MIN_WIDTH blocks) with the scratch block's id. When the pool
  grows its tensors move, and the graphs made over the old ones are dropped.
- Inputs travel in one host-to-device copy of an int64 buffer [ids | positions | slots | tables]; the int32
  table and the sequence lengths are made from it inside the graph.
- A new key costs one eager step on a side stream (Triton compiles there, outside the capture; the step's
  K/V writes are idempotent, as the replay writes the same values) and the capture.

`capture=False` runs the same static-buffer step eagerly (the CPU tests of the padding and the keys).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from mlx_engine.backends.torch.kv import DecodeStep, DecodeView, TorchKVStorage

BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
MIN_WIDTH = 8  # blocks: a table-width bucket covers at least 128 tokens of 16
MAX_GRAPHS = 48  # least recently used graphs beyond this are dropped


def batch_bucket(batch: int) -> int | None:
    """The smallest captured batch size >= batch; None above the largest (that step runs eagerly)."""
    return next((b for b in BATCH_BUCKETS if b >= batch), None)


def width_bucket(blocks: int) -> int:
    return max(MIN_WIDTH, 1 << max(0, (blocks - 1).bit_length()))


class _Graph:
    def __init__(self, bucket: int, width: int, inputs: torch.Tensor, host: torch.Tensor):
        self.bucket, self.width = bucket, width
        self.inputs, self.host = inputs, host  # static device inputs; their host staging (pinned on CUDA)
        self.graph: Any = None  # torch.cuda.CUDAGraph; None: run eagerly (capture=False)
        self.out: torch.Tensor | None = None


class DecodeGraphs:
    def __init__(self, model: Any, storage: TorchKVStorage, capture: bool = True):
        self.model, self.storage, self.capture = model, storage, capture
        self.graphs: OrderedDict[tuple[int, int, int], _Graph] = OrderedDict()
        self.pool = torch.cuda.graph_pool_handle() if capture else None  # one memory pool for all graphs
        self.captures = 0  # graphs made (tests and the bench read these)
        self.replays = 0

    def supports(self, batch: int) -> bool:
        return batch_bucket(batch) is not None

    def host_inputs(self, ids: np.ndarray, step: DecodeStep, bucket: int, width: int) -> np.ndarray:
        """[ids | positions | slots | tables] (int64), padding rows and table columns filled as the module
        docstring says."""
        B, scratch = len(ids), self.storage.scratch_block
        buf = np.empty(3 * bucket + bucket * width, dtype=np.int64)
        buf[:bucket] = 0
        buf[:B] = ids
        buf[bucket:2 * bucket] = 0
        buf[bucket:bucket + B] = step.position_list
        buf[2 * bucket:3 * bucket] = scratch * self.storage.block_size
        buf[2 * bucket:2 * bucket + B] = step.slot_list
        tables = buf[3 * bucket:].reshape(bucket, width)
        tables[:] = scratch
        for row, table in zip(tables, step.tables):
            row[:len(table)] = table
        return buf

    def logits(self, ids: np.ndarray, step: DecodeStep) -> torch.Tensor:
        """The decode step of `step` (its tables, positions and new slots) for token ids (B,) -> float32 logits
        (B, V), a view of the graph's output (read it before the next step)."""
        B = len(ids)
        bucket = batch_bucket(B)
        if bucket is None:
            raise ValueError(f"batch {B}: above the largest captured batch {BATCH_BUCKETS[-1]}")
        width = width_bucket(max(len(t) for t in step.tables))
        key = (bucket, width, self.storage.capacity)
        host = self.host_inputs(ids, step, bucket, width)
        g = self.graphs.get(key)
        if g is None:
            g = self._make(key, host)
        else:
            self.graphs.move_to_end(key)
            g.host.numpy()[:] = host
            g.inputs.copy_(g.host, non_blocking=True)
            self._run(g)
        self.replays += 1
        assert g.out is not None
        return g.out[:B]

    def _run(self, g: _Graph) -> None:
        if g.graph is not None:
            g.graph.replay()
        else:
            g.out = self._step(g.inputs, g.bucket, g.width)

    def _step(self, inputs: torch.Tensor, bucket: int, width: int) -> torch.Tensor:
        """The captured work: the static inputs -> logits (bucket, V) float32."""
        ids = inputs[:bucket].view(bucket, 1)
        positions = inputs[bucket:2 * bucket].view(bucket, 1)
        slots = inputs[2 * bucket:3 * bucket]
        tables = inputs[3 * bucket:].view(bucket, width).to(torch.int32)
        seq_lens = (positions[:, 0] + 1).to(torch.int32)
        step = DecodeStep.static(self.storage, positions, slots, tables, seq_lens)
        h = self.model(ids, [DecodeView(step, i) for i in range(self.storage.num_layers)])
        return self.model.logits(h[:, -1, :]).float()

    def _make(self, key: tuple[int, int, int], host: np.ndarray) -> _Graph:
        bucket, width, capacity = key
        for old in [k for k in self.graphs if k[2] != capacity]:  # made over the pool's old tensors
            del self.graphs[old]
        while len(self.graphs) >= MAX_GRAPHS:
            self.graphs.popitem(last=False)
        dev = self.storage.device
        pinned = self.capture and dev.type == "cuda"
        staging = torch.from_numpy(host.copy())
        staging = staging.pin_memory() if pinned else staging
        g = _Graph(bucket, width, staging.to(dev, copy=True), staging)
        if not self.capture:
            g.out = self._step(g.inputs, bucket, width)
        else:
            side = torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):  # warm-up: compiles the Triton kernels; the real step, idempotent
                self._step(g.inputs, bucket, width)
            torch.cuda.current_stream(dev).wait_stream(side)
            g.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g.graph, pool=self.pool):
                g.out = self._step(g.inputs, bucket, width)
            g.graph.replay()
        self.graphs[key] = g
        self.captures += 1
        return g
