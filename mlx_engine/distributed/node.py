"""What every rank does at start: join the launcher's ranks, check they load the same model, keep only this rank's
shard, and agree on one KV pool size, so that block ids mean the same blocks everywhere."""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from mlx_engine.api import ModelLoadError, RooflineError
from mlx_engine.distributed.channel import PlanChannel
from mlx_engine.distributed.doorbell import Doorbell
from mlx_engine.distributed.launch import Deadline, Launch, join, timeout_s
from mlx_engine.distributed.plan import check_mode
from mlx_engine.distributed.stage import Stage

if TYPE_CHECKING:
    from mlx_engine.backends.mlx.runner import Runner

# options the other ranks do not take: rank 0 alone drafts, templates and scores
RANK0_ONLY = ("draft_model", "draft_bits", "draft_optional", "chat_template", "self_draft_layers")
REFUSED = {
    "kv_bits": "quantized KV measures its smoothing with a forward of the whole model on one rank",
    "kv_key_bits": "quantized KV measures its smoothing with a forward of the whole model on one rank",
    "kv_key_per_channel": "quantized KV measures its smoothing with a forward of the whole model on one rank",
}


@dataclass
class Node:
    """This rank: its shard's runner, its stage of a forward, the plan channel and where it stands."""

    mode: str
    group: Any
    launch: Launch
    local: Runner  # the MLX runner over this rank's shard
    stage: Stage
    channel: PlanChannel
    layers: tuple[int, int]  # this rank's decoder layers [start, end) of the whole model
    num_layers: int  # the whole model's
    doorbell: Doorbell | None = None  # the ranks' rest while rank 0 is idle (None: they wait in MLX's receive)

    @property
    def rank(self) -> int:
        return self.group.rank()

    @property
    def size(self) -> int:
        return self.group.size()

    def figures(self) -> dict[str, Any]:
        """This rank's weights, KV pool and traffic, for `kv_stats` and the bench."""
        stats = self.local.cache.stats()
        return {"rank": self.rank, "layers": list(self.layers), "weight_bytes": self.local.info.weight_bytes,
                "kv_bytes": stats.get("bytes_total", 0), "kv_budget_bytes": stats.get("bytes_budget", 0),
                "kv_heads": self.local.model.args.num_key_value_heads,
                "kv_layers": self.local.model.args.num_hidden_layers,
                "bytes_exchanged": self.stage.bytes_exchanged, "plan_bytes": self.channel.bytes_sent,
                "forwards": self.stage.num_forwards, "micro_batched_forwards": self.stage.num_micro_batched,
                "micro_batched_decodes": self.stage.num_micro_batched_decodes,
                "in_flight_forwards": self.stage.num_in_flight, "cpu_s": time.process_time(),
                "busy_s": self.stage.busy_s, "hidden": self.stage.hidden, "itemsize": self.stage.dtype.size,
                "model_layers": self.num_layers,
                "peak_memory_bytes": self.local.peak_memory_bytes()}


def _peers(launch: Launch, rank: int, size: int) -> str:
    others = [launch.describe(r) for r in range(size) if r != rank]
    return others[0] if len(others) == 1 else f"ranks {', '.join(str(r) for r in range(size) if r != rank)}"


def load_node(model: str | None, mode: str, options: dict[str, Any]) -> Node:
    """Joins the ranks and loads this rank's shard of `model` (Engine.load's options, the same on every rank)."""
    from mlx_engine.backends.common import model_fingerprint
    from mlx_engine.backends.mlx.load import pick_dtype
    from mlx_engine.backends.mlx.runner import Runner
    from mlx_engine.distributed.shard import check_shardable, pipeline_shard, tensor_shard

    mode = check_mode(mode)
    for name, why in REFUSED.items():
        if options.get(name) is not None:
            raise RooflineError(f"{name} is not available with --distributed yet: {why}")
    if options.get("paged_kv") is False:
        raise RooflineError("paged_kv=False with --distributed: the ranks keep their caches in step by block ids, "
                            "which needs the paged KV cache")
    seconds = timeout_s()
    group, launch = join(seconds)
    rank, size = group.rank(), group.size()
    deadline = Deadline(rank, seconds) if rank == 0 else None
    channel = PlanChannel(group, deadline, _peers(launch, rank, size))
    doorbell = Doorbell.open(channel, launch)
    if rank != 0:
        options = {k: v for k, v in options.items() if k not in RANK0_ONLY}
    where: dict[str, Any] = {}

    def shard(built: Any, ckpt: Any) -> None:
        name = ckpt.name
        fingerprint = model_fingerprint(ckpt, pick_dtype(options.get("dtype"), ckpt.checkpoint_dtype)).hex()
        mine = {"fingerprint": fingerprint, "path": str(ckpt.path)}
        problem = ""
        try:
            check_shardable(built, mode, name)
        except ModelLoadError as e:
            problem = str(e)
        everyone = channel.gather_json({**mine, "problem": problem}, "comparing the ranks' model files",
                                      bounded=False)
        differ = [(r, o) for r, o in enumerate(everyone) if o["fingerprint"] != everyone[0]["fingerprint"]]
        if differ:
            r, o = differ[0]
            raise ModelLoadError(f"rank {r} loaded {o['path']} (fingerprint {o['fingerprint'][:12]}) but rank 0 "
                                 f"{everyone[0]['path']} ({everyone[0]['fingerprint'][:12]}): every rank must load "
                                 "the same model file and dtype; refused")
        if problem:
            raise ModelLoadError(problem)
        where["num_layers"] = len(built.model.layers)
        if mode == "pipeline":
            where["layers"] = pipeline_shard(built.model, rank, size)
        else:
            tensor_shard(built.model, group, name)
            where["layers"] = (0, where["num_layers"])

    local = Runner.load(model, shard=shard, **options)
    if deadline is not None and mode == "tensor":
        from mlx_engine.distributed.shard import SumAcrossRanks

        for _, m in local.model.named_modules():
            if isinstance(m, SumAcrossRanks):
                m.progress = deadline.touch
    _agree_on_blocks(local, channel, options)
    stage = Stage(mode, local.model, group, local.model.args.hidden_size, getattr(mx, local.info.dtype),
                  _waiting(deadline, channel.peers), lambda layers: _kv_state(local, layers))
    return Node(mode, group, launch, local, stage, channel, where["layers"], where["num_layers"], doorbell)


def _kv_state(local: Runner, layers: list[Any]) -> list[mx.array]:
    """What a forward through `layers` writes: the cache's (`KVCache.state`), or a timing's contiguous buffers
    (`Runner.scratch_layers`, outside the cache)."""
    from mlx_engine.distributed.mirror import TrimRecorded
    from mlx_engine.kv.contiguous import ContiguousLayer

    if isinstance(layers[0], (ContiguousLayer, TrimRecorded)):
        return [c.state for c in layers]
    return local.cache.state(layers)


def _waiting(deadline: Deadline | None, peers: str) -> Any:
    def waiting(doing: str) -> Any:
        return nullcontext() if deadline is None else deadline.waiting(peers, doing)

    return waiting


def _agree_on_blocks(local: Runner, channel: PlanChannel, options: dict[str, Any]) -> None:
    """Every rank's pool gets the smallest rank's block count: the same ids must exist everywhere."""
    from mlx_engine.kv.cache import PagedCache
    from mlx_engine.kv.config import KVConfig

    stats = local.cache.stats()
    mine = stats["num_blocks"]
    fewest = min(channel.gather_json(mine, "agreeing on the KV pool's size", bounded=False))
    if mine == fewest:
        return
    config = KVConfig(options.get("block_size", 16), None, options.get("kv_group_size", 64),
                      fewest * stats["bytes_per_block"], options.get("prefix_caching", True))
    a = local.model.args
    local.cache = PagedCache.create(num_layers=a.num_hidden_layers, num_kv_heads=a.num_key_value_heads,
                                    head_dim=a.head_dim, dtype=getattr(mx, local.info.dtype),
                                    context_length=local.context_length, weight_bytes=local.info.weight_bytes,
                                    config=config, model_id=local.fingerprint)
    assert local.cache.stats()["num_blocks"] == fewest
