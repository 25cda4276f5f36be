"""The torch backend's side of the host process: the threads that ran torch's CPU work, torch's CPU matmul timed
for `roofline bench`'s peak FLOP/s, and the process's peak resident memory."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

# The threads of this process that ran torch's CPU work. Each thread that opens an OpenMP region gets a pool of its
# own, and libgomp stops spin-waiting at barriers once it manages more threads than there are cores: one matmul on
# a second thread halved a 2-core EPYC's decode (issue 48). `Engine.diagnostics().execution()` reports them.
TORCH_THREADS: set[str] = set()


def cpu_matmul_seconds(a: np.ndarray, repeats: int, best_time: Callable[[Callable[[], Any], int], float]) -> float:
    """The best time of a @ a in torch on the CPU, all cores (for the measured peak FLOP/s of `roofline bench`)."""
    TORCH_THREADS.add(threading.current_thread().name)
    t = torch.from_numpy(a)
    return best_time(lambda: t @ t, repeats)


def peak_rss() -> int:
    """The process's peak resident bytes: Linux's VmHWM, which `reset_peak_rss` sets back to the current RSS
    (ru_maxrss cannot be reset, and a process started by fork + exec inherits its parent's). Elsewhere (macOS:
    no /proc) ru_maxrss, never reset."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        import resource

        maxrss = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
        return maxrss if sys.platform == "darwin" else maxrss * 1024  # bytes on macOS, KiB on Linux


def reset_peak_rss() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # "5": the peak RSS back to the current one (proc(5))
    except OSError:
        pass
