"""The link between rank 0 and rank 1 (ring neighbours: the hop every plan and activation crosses), measured for the
second roof beside memory bandwidth: bytes exchanged per token over this bandwidth (`plan.link_roof`).

Measured by ping-pong of `mx.distributed.send`/`recv`: a small message gives the latency, the largest of 64 KiB, 1 MiB
and 8 MiB that a round trip moves within LONG_S the bandwidth, from the difference of the two round trips so the
latency cancels. The large probe must outlast a shaper's burst (a tc token bucket lets its burst through at the
line's rate) and a loaded machine's scheduling hiccups (milliseconds on the shared 2-core box).
"""

from __future__ import annotations

import time
from typing import Any

import mlx.core as mx

SMALL = 8
PROBES = (64 * 1024, 2**20, 8 * 2**20)  # bytes, tried in turn until a round trip takes LONG_S
LONG_S = 0.25


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
    small = _round_trips(group, SMALL, 7)
    size, took = PROBES[0], 0.0
    for i, size in enumerate(PROBES):
        took = _round_trips(group, size, 3 if i < len(PROBES) - 1 else 2)
        last = i == len(PROBES) - 1 or (group.rank() == 0 and took >= LONG_S)
        # rank 0 tells the others whether a larger probe follows (a slow link: it would take seconds)
        if channel.broadcast((b"1" if last else b"0") if group.rank() == 0 else None, "measuring the link") == b"1":
            break
    if group.rank() != 0:
        return {}
    return {"latency_s": small / 2, "bandwidth_bytes_s": 2 * (size - SMALL) / max(took - small, 1e-9),
            "probe_bytes": size}
