"""The engine across several machines on MLX's own runtime: ranks started by `mlx.launch`, `mx.distributed` for
every byte between them (docs/distributed.md).

Rank 0 holds the scheduler and the front end (`Engine.load(model, distributed="pipeline" | "tensor")` there returns
the engine); every other rank runs `serve_rank`, which replays rank 0's plans on its shard until rank 0 stops.
Importing this package loads no MLX: the front ends call `launched_rank` before anything else.
"""

from __future__ import annotations

from typing import Any

from mlx_engine.distributed.launch import (EXIT_RANK_LOST, NO_LAUNCHER, TIMEOUT_ENV, DistributedError, RankLostError,
                                           detect_launch, exit_if_lost, exit_now, stop_on_sigterm, watch_launcher)
from mlx_engine.distributed.plan import (MODES, RankShare, bytes_per_token, check_mode, file_tensor_sizes, link_roof,
                                         shares_on_paper)

_active: list[Any] = []  # rank 0's open DistributedRunner: one model at a time across the ranks


def launched_rank() -> int | None:
    """This process's rank when a launcher started it (MLX_RANK and its kin), else None."""
    launch = detect_launch()
    return None if launch is None else launch.rank


def _one_at_a_time() -> None:
    if any(not r.closed for r in _active):
        raise DistributedError("a distributed run holds one model at a time: close the engine first (the other "
                               "ranks load the model named on their command line)")
    _active.clear()


def load_runner(model: str | None, mode: str, **options: Any) -> Any:
    """Rank 0: joins the ranks, loads its shard and returns the runner the scheduler drives (`DistributedRunner`).
    On another rank it serves rank 0 instead and ends the process when rank 0 stops (so one script runs on all)."""
    check_mode(mode)
    launch = detect_launch()
    if launch is None:
        raise DistributedError(NO_LAUNCHER)
    if launch.rank != 0:
        raise SystemExit(serve_rank(model, mode, **options))
    from mlx_engine.distributed.node import load_node
    from mlx_engine.distributed.runner import DistributedRunner

    _one_at_a_time()
    watch_launcher(0)
    runner = DistributedRunner(load_node(model, mode, options))
    _active.append(runner)
    return runner


def serve_rank(model: str | None, mode: str, **options: Any) -> int:
    """A rank other than 0: loads its shard and replays rank 0's plans. Returns the exit status."""
    from mlx_engine.distributed.node import load_node
    from mlx_engine.distributed.worker import serve_plans

    check_mode(mode)
    from mlx_engine.api import ENGINE_OPTIONS

    # the same options as rank 0's Engine.load: its engine's own (max_seqs, chat_template) are rank 0's alone
    options = {k: v for k, v in options.items() if k not in ("backend", "device", *ENGINE_OPTIONS)}
    launch = detect_launch()
    watch_launcher(launch.rank if launch is not None else 1)
    return serve_plans(load_node(model, mode, options))


__all__ = ["EXIT_RANK_LOST", "MODES", "TIMEOUT_ENV", "DistributedError", "RankLostError", "RankShare",
           "bytes_per_token", "check_mode", "exit_if_lost", "exit_now", "file_tensor_sizes", "link_roof", "launched_rank",
           "load_runner", "serve_rank", "shares_on_paper", "stop_on_sigterm"]
