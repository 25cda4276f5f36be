"""Joining the ranks that `mlx.launch` started, and ending a run cleanly when one of them is gone.

MLX's runtime does the transport and `mlx.launch` the launching; this module only finds out which launcher
started this process, initialises `mx.distributed` under a deadline, and turns a lost or silent peer into one
line that names it. Two facts of MLX 0.32 shape it: `mx.distributed.init` holds the GIL while it waits for the
ring's peers (so its deadline is kept by a helper process), while evaluating a collective releases it (so a
thread keeps the deadline of every later one).
"""

from __future__ import annotations

import faulthandler
import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, NoReturn

from mlx_engine.api import RooflineError
from mlx_engine.distributed.plan import hostfile_text, read_hostfile_peers
from mlx_engine.switches import DISTRIBUTED_TIMEOUT

TIMEOUT_ENV = DISTRIBUTED_TIMEOUT.name
DEFAULT_TIMEOUT_S = 30.0
EXIT_RANK_LOST = 3  # the exit status of a run stopped because a rank is gone
NO_LAUNCHER = ("--distributed needs its ranks started by mlx.launch, e.g. `mlx.launch --hostfile hosts.json -- "
               "roofline serve --distributed pipeline` (or `--backend ring -n 2 --hosts 127.0.0.1` on one machine); "
               "this process has no rank from a launcher (MLX_RANK, MLX_HOSTFILE)")


class DistributedError(RooflineError):
    """A distributed run that cannot start or go on (the message names the rank)."""


class RankLostError(DistributedError):
    """A peer that died or stopped answering mid-run."""


@dataclass(frozen=True)
class Launch:
    """What the launcher told this process: MLX's backend name, this rank, and each rank's address (the ring's
    hostfile; empty for the other backends)."""

    backend: str
    rank: int
    peers: tuple[str, ...]

    def describe(self, rank: int) -> str:
        where = self.peers[rank] if rank < len(self.peers) else ""
        return f"rank {rank}" + (f" ({where})" if where else "")


def detect_launch(env: dict[str, str] | None = None) -> Launch | None:
    """The launcher's environment, or None when no launcher started this process."""
    env = os.environ if env is None else env
    if "MLX_JACCL_COORDINATOR" in env or "MLX_IBV_DEVICES" in env:
        return Launch("jaccl", int(env.get("MLX_RANK", "0") or 0), ())
    if "OMPI_COMM_WORLD_RANK" in env or "PMI_RANK" in env:
        return Launch("mpi", int(env.get("OMPI_COMM_WORLD_RANK", env.get("PMI_RANK", "0"))), ())
    if "MLX_RANK" in env and "MLX_HOSTFILE" in env:
        return Launch("ring", int(env["MLX_RANK"]), tuple(read_hostfile_peers(hostfile_text(env["MLX_HOSTFILE"]))))
    return None


def timeout_s() -> float:
    raw = DISTRIBUTED_TIMEOUT.raw()
    try:
        value = float(raw) if raw else DEFAULT_TIMEOUT_S
    except ValueError:
        raise DistributedError(f"{TIMEOUT_ENV}={raw!r}: expected seconds (default {DEFAULT_TIMEOUT_S:.0f})") from None
    if value <= 0:
        raise DistributedError(f"{TIMEOUT_ENV}={raw!r}: expected a positive number of seconds")
    return value


# The helper that says why init ran out of time: it reads stdin until the parent writes (joined) or the deadline
# passes, then names the missing ranks. The parent, stuck in MLX's accept loop holding the GIL, is ended a moment
# later by faulthandler's C watchdog (exit status 1); the helper kills it should that fail.
_INIT_WATCHDOG = """
import os, select, signal, sys, time
pid, seconds, message = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
ready, _, _ = select.select([sys.stdin], [], [], seconds)
if not ready:
    sys.stderr.write(message + "\\n")
    sys.stderr.flush()
    ready, _, _ = select.select([sys.stdin], [], [], 5.0)
    if not ready:
        os.kill(pid, signal.SIGKILL)
"""
_devnull: Any = None


def join(deadline_s: float | None = None) -> tuple[Any, Launch]:
    """mx.distributed's group of every rank the launcher started, within `deadline_s` (default: timeout_s())."""
    import mlx.core as mx

    launch = detect_launch()
    if launch is None:
        raise DistributedError(NO_LAUNCHER)
    seconds = timeout_s() if deadline_s is None else deadline_s
    size = len(launch.peers)
    others = [launch.describe(r) for r in range(size) if r != launch.rank] or ["the other ranks"]
    message = (f"roofline: error: rank {launch.rank}: {', '.join(others)} did not connect within {seconds:.0f} s: "
               "check that every host in the hostfile is up, reachable from this one and running the same command "
               f"({TIMEOUT_ENV} sets the limit)")
    global _devnull
    _devnull = _devnull or open(os.devnull, "w")
    helper = subprocess.Popen([sys.executable, "-c", _INIT_WATCHDOG, str(os.getpid()), str(seconds), message],
                              stdin=subprocess.PIPE)
    faulthandler.dump_traceback_later(seconds + 0.5, exit=True, file=_devnull)
    try:
        group = mx.distributed.init(strict=True, backend=launch.backend)
    except RuntimeError as e:
        raise DistributedError(f"rank {launch.rank}: MLX's {launch.backend} backend did not start: {e}") from None
    finally:
        faulthandler.cancel_dump_traceback_later()
        assert helper.stdin is not None
        helper.stdin.write(b"joined\n")
        helper.stdin.close()
        helper.wait()
    if group.size() < 2:
        raise DistributedError(f"--distributed needs at least 2 ranks; the launcher started {group.size()} (e.g. "
                               "mlx.launch -n 2 or two hosts in the hostfile)")
    return group, launch


class Deadline:
    """Keeps the deadline of every wait on a peer: one that lasts longer than `seconds` ends the process with a
    line naming whom it waited for (a peer stopped, or its link cut, never closes the connection, so MLX would wait
    for ever)."""

    def __init__(self, rank: int, seconds: float):
        self.rank, self.seconds = rank, seconds
        self._lock = threading.Lock()
        self._armed: tuple[float, str, str] | None = None  # (deadline, whom, doing what)
        self._wake = threading.Event()
        threading.Thread(target=self._watch, name="roofline-deadline", daemon=True).start()

    @contextmanager
    def waiting(self, whom: str, what: str) -> Iterator[None]:
        with self._lock:
            self._armed = (time.monotonic() + self.seconds, whom, what)
        self._wake.set()
        try:
            yield
        except RuntimeError as e:
            if "[ring]" in str(e) or "peer" in str(e) or "connection" in str(e).lower():
                raise lost(self.rank, whom, what, str(e)) from None
            raise
        finally:
            with self._lock:
                self._armed = None

    def touch(self) -> None:
        """Progress within one wait (tensor parallel's forward, an all-sum after another): the deadline starts
        again, so it bounds each exchange rather than the whole forward."""
        with self._lock:
            if self._armed is not None:
                self._armed = (time.monotonic() + self.seconds, *self._armed[1:])

    def _watch(self) -> None:
        while True:
            with self._lock:
                armed = self._armed
            if armed is None:
                self._wake.wait()
                self._wake.clear()
                continue
            left = armed[0] - time.monotonic()
            if left > 0:
                time.sleep(min(left, 0.5))
                continue
            _, whom, what = armed
            stop(f"rank {self.rank}: no answer from {whom} for {self.seconds:.0f} s while {what}: that rank is stopped "
                 f"or its link is down; the run is stopped ({TIMEOUT_ENV} sets the limit)")


def lost(rank: int, whom: str, what: str, why: str) -> RankLostError:
    """The error for a peer whose connection closed, and the exit that follows it (`stop_later`)."""
    global _lost
    message = (f"rank {rank} lost {whom} while {what} ({why.strip()}): that rank has ended or its host is "
               "unreachable; the run is stopped")
    _lost = message
    stop_later(message)
    return RankLostError(message)


def stop(message: str) -> None:
    print(f"roofline: error: {message}", file=sys.stderr, flush=True)
    os._exit(EXIT_RANK_LOST)


_stopping = threading.Event()
_lost: str | None = None  # the peer this process lost, once it has


def exit_if_lost() -> None:
    """Ends this process now with EXIT_RANK_LOST once a peer is lost: a normal exit would run the interpreter's
    shutdown, which puts SIGTERM back to its default, and the launcher's SIGTERM then ends the rank as a signal."""
    if _lost is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_RANK_LOST)


def exit_now(code: int) -> NoReturn:
    """Ends a rank other than 0 now, once its run is over (rank 0 said stop): mlx.launch ends every rank still
    running as soon as one exits with an error, as rank 0 does after Ctrl-C (130), and the interpreter's shutdown
    here would leave it time to (the rank then ends by its SIGTERM, and the launcher warns of it)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def stop_later(message: str, grace_s: float = 2.0) -> None:
    """Ends the process `grace_s` from now, with `message`, unless it ends before: the failed requests reach their
    front end first (generate prints the error and exits; the server answers its clients)."""
    if _stopping.is_set():
        return
    _stopping.set()
    timer = threading.Timer(grace_s, stop, args=(message,))
    timer.daemon = True  # a process that ends first (generate, after printing the error) ends without it
    timer.start()


def stop_on_sigterm(rank: int) -> None:
    """mlx.launch ends every rank when one exits with an error: say so, rather than vanish."""
    launch = detect_launch()
    others = [launch.describe(r) for r in range(len(launch.peers)) if r != rank] if launch else []
    who = others[0] if len(others) == 1 else "another rank"

    def handler(signum: int, frame: Any) -> None:
        # the launcher's signal often comes before the lost connection's error has reached the front end
        stop(_lost or f"rank {rank}: {who} has ended, and the launcher stopped this rank (signal {signum}); the "
             "launcher's warning says how it ended")

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, handler)


LAUNCHER_GONE_GRACE_S = 60.0  # how long another rank serves on once the launcher is gone, for rank 0's drain


def watch_launcher(rank: int) -> None:
    """Ends this rank when the `mlx.launch` that started it is gone. The launcher holds every local rank's stdin
    pipe; stopped by SIGTERM or SIGINT it dies without ending them (MLX 0.32), so the pipe's end is the news: rank 0
    then stops as on SIGTERM (`roofline serve` drains), and another rank ends once rank 0 has stopped it or, at the
    latest, LAUNCHER_GONE_GRACE_S later. A rank on another host (ssh -tt) has a terminal for stdin, whose hangup
    (SIGHUP) ends it already."""
    import stat

    try:
        if not stat.S_ISFIFO(os.fstat(0).st_mode):
            return
    except OSError:
        return

    def watch() -> None:
        while True:
            try:
                if not os.read(0, 65536):  # whatever the launcher forwards from its own stdin is not for us
                    break
            except OSError:
                break
        if rank == 0:
            os.kill(os.getpid(), signal.SIGTERM)
        else:
            time.sleep(LAUNCHER_GONE_GRACE_S)
            stop(f"rank {rank}: the launcher (mlx.launch) has ended and rank 0 did not stop this rank within "
                 f"{LAUNCHER_GONE_GRACE_S:.0f} s")

    threading.Thread(target=watch, name="roofline-launcher-watch", daemon=True).start()
