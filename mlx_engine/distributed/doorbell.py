"""Rest for the other ranks while rank 0 has nothing to run.

A rank waiting for rank 0's next plan waits inside MLX's ring `recv`, whose communication thread polls its socket:
an idle `roofline serve` kept a core of every other rank 40-90% busy. So when rank 0's engine goes idle it sends a
"rest" plan, and each rank then blocks on a plain TCP connection to rank 0 (the doorbell) instead, in `select`,
costing nothing; rank 0 writes one byte to every connection before its next plan. The connection carries no data,
only the wake-up, so MLX's runtime still carries every byte of the run. Its close is news too: a resting rank whose
rank 0 has ended sees the connection close at once, rather than never hearing from rank 0 again.

Only the ring backend names the ranks' addresses (its hostfile); with the others there is no doorbell and the ranks
wait in MLX's receive as before.
"""

from __future__ import annotations

import select
import socket
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mlx_engine.distributed.channel import PlanChannel
    from mlx_engine.distributed.launch import Launch

CONNECT_TIMEOUT_S = 10.0


class Doorbell:
    """Rank 0's side holds a connection to every other rank; another rank's side, its one connection to rank 0."""

    def __init__(self, connections: list[socket.socket]):
        self.connections = connections

    @classmethod
    def open(cls, channel: PlanChannel, launch: Launch) -> Doorbell | None:
        """Collective, on every rank at the same point of the start: the doorbell, or None on every rank when one of
        them could not make its connection (the ranks then wait in MLX's receive)."""
        host = launch.peers[0].rsplit(":", 1)[0].strip("[]") if launch.peers else ""
        listener: socket.socket | None = None
        port = 0
        if channel.rank == 0 and host:
            try:
                listener = socket.create_server((host, 0), backlog=channel.size)
                listener.settimeout(CONNECT_TIMEOUT_S)
                port = listener.getsockname()[1]
            except OSError:
                listener = None
        port = int(channel.broadcast(str(port).encode() if channel.rank == 0 else None, "opening the doorbell"))
        connections: list[socket.socket] = []
        try:
            if port and channel.rank != 0:
                conn = socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S)
                conn.settimeout(None)
                connections.append(conn)
            elif listener is not None:
                for _ in range(channel.size - 1):
                    conn, _ = listener.accept()
                    conn.settimeout(None)
                    connections.append(conn)
        except OSError:
            pass
        finally:
            if listener is not None:
                listener.close()
        ok = channel.gather_json(bool(port) and len(connections) == (channel.size - 1 if channel.rank == 0 else 1),
                                 "opening the doorbell")
        if not all(ok):
            for conn in connections:
                conn.close()
            return None
        for conn in connections:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return cls(connections)

    def ring(self) -> None:
        """Rank 0: wakes every resting rank (its next plan follows)."""
        for conn in self.connections:
            conn.sendall(b"\x01")

    def wait(self) -> bool:
        """Another rank: blocks until rank 0 rings (True) or its connection closes (False: rank 0 has ended)."""
        conn = self.connections[0]
        while True:
            select.select([conn], [], [])
            try:
                data = conn.recv(64)
            except OSError:
                return False
            return bool(data)

    def close(self) -> None:
        for conn in self.connections:
            conn.close()
