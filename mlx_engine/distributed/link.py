"""The link's second roof: bytes the ranks exchange per token, over the link's bandwidth measured between rank 0
and rank 1 (ring neighbours: the hop every plan and activation crosses).

Measured by ping-pong of `mx.distributed.send`/`recv`: a small message gives the latency, a large one (256 KiB, then
4 MiB where the link is fast enough to time it in a few milliseconds) the bandwidth, from the difference of the
two round trips so the latency cancels. The large one must outlast a shaper's burst (a tc token bucket lets its
burst through at the line's rate).
"""

from __future__ import annotations

import time
from typing import Any

import mlx.core as mx

SMALL, LARGE, HUGE = 8, 256 * 1024, 4 * 2**20
ROUNDS = 5


def _round_trips(group: Any, nbytes: int, rounds: int) -> float:
    """Rank 0: the fastest of `rounds` round trips of `nbytes` to rank 1 and back (seconds); rank 1 echoes; the
    others wait."""
    rank = group.rank()
    best = float("inf")
    for _ in range(rounds):
        if rank == 0:
            t = time.perf_counter()
            mx.eval(mx.distributed.send(mx.zeros((nbytes,), mx.uint8), 1, group=group, stream=mx.cpu))
            mx.eval(mx.distributed.recv((nbytes,), mx.uint8, 1, group=group, stream=mx.cpu))
            best = min(best, time.perf_counter() - t)
        elif rank == 1:
            x = mx.distributed.recv((nbytes,), mx.uint8, 0, group=group, stream=mx.cpu)
            mx.eval(mx.distributed.send(x, 0, group=group, stream=mx.cpu))
    return best


def measure_link(group: Any, channel: Any) -> dict[str, float]:
    """Every rank calls it together; rank 0 gets {latency_s, bandwidth_bytes_s, probe_bytes} (others {})."""
    small = _round_trips(group, SMALL, ROUNDS)
    large = _round_trips(group, LARGE, 2)
    # a fast link moves 64 KiB in microseconds, below the timer's resolution for a difference: try 4 MiB
    go_on = channel.broadcast(b"1" if group.rank() == 0 and large - small < 0.02 else
                              (b"0" if group.rank() == 0 else None), "measuring the link")
    size = LARGE
    if go_on == b"1":
        large, size = _round_trips(group, HUGE, 2), HUGE
    if group.rank() != 0:
        return {}
    spent = max(large - small, 1e-9)
    return {"latency_s": small / 2, "bandwidth_bytes_s": 2 * (size - SMALL) / spent, "probe_bytes": size}
