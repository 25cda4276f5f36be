"""A rank other than 0: it replays rank 0's plans on its shard until rank 0 says stop (or is gone)."""

from __future__ import annotations

import json
import sys
from typing import Any

import mlx.core as mx

from mlx_engine.distributed.launch import EXIT_RANK_LOST
from mlx_engine.distributed.mirror import Replayer
from mlx_engine.distributed.node import Node
from mlx_engine.distributed.runner import tables_checksum


def serve_plans(node: Node) -> int:
    """Runs rank 0's plans; returns the exit status (0 when rank 0 stopped the run)."""
    from mlx_engine.backends.mlx.host_blas import one_blas_thread

    local = node.local
    replay = Replayer(local.cache, local.scratch_layers)
    rank = node.rank
    while True:
        try:
            plan = json.loads(node.channel.broadcast(None))
        except RuntimeError as e:
            return _fail(rank, f"lost rank 0 while waiting for its next plan ({e}): rank 0 has ended or its host is "
                         "unreachable")
        try:
            with one_blas_thread():
                for op in plan["ops"]:
                    replay.apply(op)
                kind = plan["do"]
                if kind == "stop":
                    return 0
                if kind == "rest" and node.doorbell is not None and not node.doorbell.wait():
                    return _fail(rank, "rank 0 ended while this rank rested (its doorbell connection closed)")
                if kind == "gather":
                    node.channel.gather_json(node.figures())
                elif kind == "forward":
                    _forward(node, replay, plan)
                elif kind == "link":
                    from mlx_engine.distributed.link import measure_link

                    measure_link(node.group, node.channel)
        except RuntimeError as e:
            return _fail(rank, f"lost a peer during a step ({e})")
        except _OutOfStep as e:
            return _fail(rank, str(e))


class _OutOfStep(Exception):
    pass


def _forward(node: Node, replay: Replayer, plan: dict[str, Any]) -> None:
    layers = replay.views.get(plan["views"])
    if layers is None:
        raise _OutOfStep(f"rank 0's step reads views {plan['views']} this rank never made: the ranks are out of step")
    crc = tables_checksum(node.local.cache, replay.view_reqs.get(plan["views"], []))
    if crc != plan["crc"]:
        raise _OutOfStep("this rank's KV block tables differ from rank 0's: the ranks are out of step")
    node.stage.forward(mx.array(plan["tokens"], dtype=mx.int32), layers, plan["groups"])


def _fail(rank: int, message: str) -> int:
    print(f"roofline: error: rank {rank}: {message}; stopping", file=sys.stderr, flush=True)
    return EXIT_RANK_LOST
