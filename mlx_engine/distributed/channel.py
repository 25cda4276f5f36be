"""The rank plan's wire: rank 0 broadcasts each plan's bytes to every rank, and gathers a reply from each, over
`mx.distributed` (`send`/`recv` along the ring for the plan, `all_gather` for the replies).

A plan fits one message of HEAD_BYTES in the common case (a decode step's plan is a few hundred bytes); a longer one
(a long prompt's token ids) follows in a second message of its exact size. One message, not an all-sum: on two ranks
an all-sum is two exchanges in turn, and the plan is on every step's critical path.
"""

from __future__ import annotations

import json
from typing import Any

import mlx.core as mx
import numpy as np

from mlx_engine.distributed.launch import Deadline

HEAD_BYTES = 1024
GATHER_BYTES = 16384


class PlanChannel:
    def __init__(self, group: Any, deadline: Deadline | None, peers: str):
        self.group, self.deadline, self.peers = group, deadline, peers
        self.rank, self.size = group.rank(), group.size()
        self.bytes_sent = 0  # plan bytes rank 0 has broadcast (the control plane's share of the link)
        self.num_messages = 0

    def _relay(self, buf: np.ndarray | None, nbytes: int, what: str) -> np.ndarray:
        """Rank 0 sends `buf` to rank 1, each rank passes it on to the next: N - 1 one-way messages, along the
        ring's neighbours (all the ring backend sends between)."""
        arrays = []
        if self.rank == 0:
            x = mx.array(buf)
        else:
            x = mx.distributed.recv((nbytes,), mx.uint8, self.rank - 1, group=self.group, stream=mx.cpu)
            arrays.append(x)
        if self.rank + 1 < self.size:
            arrays.append(mx.distributed.send(x, self.rank + 1, group=self.group, stream=mx.cpu))
        if self.deadline is None:
            mx.eval(arrays)
        else:
            with self.deadline.waiting(self.peers, what):
                mx.eval(arrays)
        return buf if self.rank == 0 else np.array(x, copy=False)

    def broadcast(self, payload: bytes | None, what: str = "sending a step's plan") -> bytes:
        """Rank 0 passes `payload`, the others None; every rank returns rank 0's bytes."""
        head = None
        if payload is not None:
            n = len(payload)
            head = np.zeros(HEAD_BYTES, np.uint8)
            head[:4] = np.frombuffer(n.to_bytes(4, "little"), np.uint8)
            first = payload[: HEAD_BYTES - 4]
            head[4 : 4 + len(first)] = np.frombuffer(first, np.uint8)
            self.bytes_sent += HEAD_BYTES + max(0, n - len(first))
            self.num_messages += 1
        out = self._relay(head, HEAD_BYTES, what)
        n = int.from_bytes(out[:4].tobytes(), "little")
        body = out[4 : 4 + min(n, HEAD_BYTES - 4)].tobytes()
        rest = n - len(body)
        if rest > 0:
            tail = None if payload is None else np.frombuffer(payload[HEAD_BYTES - 4 :], np.uint8).copy()
            body += self._relay(tail, rest, what).tobytes()
        return body

    def gather(self, payload: bytes, what: str = "gathering each rank's figures", bounded: bool = True) -> list[bytes]:
        """Every rank passes its bytes (at most GATHER_BYTES - 4); every rank gets all of them, by rank. Not
        `bounded`: no deadline (while the ranks load, each at its own speed)."""
        if len(payload) > GATHER_BYTES - 4:
            raise ValueError(f"a gathered reply of {len(payload)} bytes exceeds {GATHER_BYTES - 4}")
        buf = np.zeros(GATHER_BYTES, np.uint8)
        buf[:4] = np.frombuffer(len(payload).to_bytes(4, "little"), np.uint8)
        buf[4 : 4 + len(payload)] = np.frombuffer(payload, np.uint8)
        x = mx.distributed.all_gather(mx.array(buf), group=self.group, stream=mx.cpu)
        if self.deadline is None or not bounded:
            mx.eval(x)
        else:
            with self.deadline.waiting(self.peers, what):
                mx.eval(x)
        rows = np.array(x, copy=False).reshape(self.size, GATHER_BYTES)
        return [r[4 : 4 + int.from_bytes(r[:4].tobytes(), "little")].tobytes() for r in rows]

    def gather_json(self, value: Any, what: str = "gathering each rank's figures", bounded: bool = True) -> list[Any]:
        return [json.loads(b) for b in self.gather(json.dumps(value).encode(), what, bounded)]
