"""This machine's memory bandwidth, the denominator of "% of roofline": from the chip table in
`assets/chips.json` on a Mac it knows, else measured (numpy copies) and cached in the data dir.

A measured figure is the best of FULL_RUNS copies (the roofline is the machine's peak; on a shared VM one copy
reads anywhere from 9 to 24 GB/s), kept with its median and low. Each later start checks it with CHECK_RUNS
copies: a check that reads more than DISAGREE above the cached best means the cache was measured under load, so
the figure is measured again (a check below it is the load of the moment, not a slower machine).
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

# in a checkout (and an editable install) the repo's assets/; in a built wheel, a copy beside this file
_REPO_CHIPS = Path(__file__).resolve().parents[2] / "assets" / "chips.json"
CHIPS_FILE = _REPO_CHIPS if _REPO_CHIPS.exists() else Path(__file__).resolve().parent / "chips.json"
CACHE_NAME = "bandwidth.json"
FULL_RUNS = 15
CHECK_RUNS = 3
DISAGREE = 0.15


@dataclass(frozen=True)
class Chip:
    name: str
    gbs: float
    source: str
    by_perf_cores: dict[int, float]
    compare_only: bool = False


@dataclass(frozen=True)
class Bandwidth:
    label: str  # "Apple M3 Max" or the measured machine's name
    bytes_per_s: float  # the table's figure, or the best measured copy
    measured: bool  # True: measured on this machine, not from the table
    median_bytes_per_s: float = 0.0  # measured: the median and the lowest of the copies
    low_bytes_per_s: float = 0.0
    runs: int = 0  # measured: copies timed
    measured_at: str = ""

    def describe(self) -> str:
        """Where the figure comes from, short (the stats bar): "18 GB/s AMD EPYC (measured, 15 runs 9-18)"."""
        text = f"{self.bytes_per_s / 1e9:.0f} GB/s {self.label}"
        if not self.measured:
            return text
        if self.runs > 1:
            return text + f" (measured, {self.runs} runs {self.low_bytes_per_s / 1e9:.0f}-{self.bytes_per_s / 1e9:.0f})"
        return text + ", measured"

    def detail(self) -> str:
        """The method and spread in full (the bench's note)."""
        if not self.measured:
            return "chip table (assets/chips.json)"
        return (f"numpy copy, read + write bytes: best of {self.runs} copies of 256 MiB, median "
                f"{self.median_bytes_per_s / 1e9:.1f}, low {self.low_bytes_per_s / 1e9:.1f} GB/s, measured "
                f"{self.measured_at or 'earlier'}; rechecked at each start")


def load_chips(path: Path = CHIPS_FILE) -> list[Chip]:
    raw = json.loads(path.read_text())
    return [
        Chip(c["name"], float(c["gbs"]), c.get("source", ""),
             {int(k): float(v) for k, v in c.get("by_perf_cores", {}).items()}, bool(c.get("compare_only", False)))
        for c in raw["chips"]
    ]


def lookup(brand: str, perf_cores: int | None, chips: list[Chip] | None = None) -> Bandwidth | None:
    """The table's bandwidth for an exact chip name ("Apple M4 Max"); None when the table does not know it."""
    brand = " ".join(brand.split())
    for chip in chips if chips is not None else load_chips():
        if chip.name.lower() == brand.lower() and not chip.compare_only:
            gbs = chip.by_perf_cores.get(perf_cores, chip.gbs) if perf_cores is not None else chip.gbs
            return Bandwidth(chip.name, gbs * 1e9, measured=False)
    return None


def _sysctl(name: str) -> str | None:
    try:
        r = subprocess.run(["sysctl", "-n", name], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() if r.returncode == 0 and r.stdout.strip() else None


def detect_chip() -> tuple[str, int | None] | None:
    """(brand string, performance-core count) on macOS; None elsewhere."""
    if sys.platform != "darwin":
        return None
    brand = _sysctl("machdep.cpu.brand_string")
    if brand is None:
        return None
    cores = _sysctl("hw.perflevel0.physicalcpu")
    return brand, int(cores) if cores and cores.isdigit() else None


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return " ".join(line.split(":", 1)[1].split())
    except OSError:
        pass
    return platform.processor() or platform.machine() or "this machine"


def machine_bandwidth(home: Path, measure=None) -> Bandwidth:
    """From the chip table when it knows this Mac; else the cached measurement, checked (see the module's
    docstring); else measured now and cached. `measure(runs)` returns bytes/s per copy (default:
    mlx_engine.roofline.bandwidth_readings)."""
    chip = detect_chip()
    if chip is not None:
        known = lookup(*chip)
        if known is not None:
            return known
    label = chip[0] if chip else _cpu_name()
    if measure is None:
        from mlx_engine.roofline import bandwidth_readings as measure
    cache = home / CACHE_NAME
    cached = _read_bandwidth(cache, label)
    if cached is not None:
        check = max(measure(CHECK_RUNS))
        if check <= cached.bytes_per_s * (1 + DISAGREE):
            return cached
    readings = sorted(measure(FULL_RUNS))
    bw = Bandwidth(label, readings[-1], True, readings[len(readings) // 2], readings[0], len(readings),
                   time.strftime("%Y-%m-%d %H:%M"))
    if cached is not None and cached.bytes_per_s > bw.bytes_per_s:  # the peak stands; the new spread is kept
        bw = Bandwidth(label, cached.bytes_per_s, True, bw.median_bytes_per_s, bw.low_bytes_per_s, bw.runs,
                       bw.measured_at)
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps({"label": label, "bytes_per_s": bw.bytes_per_s, "median": bw.median_bytes_per_s,
                                     "low": bw.low_bytes_per_s, "runs": bw.runs, "measured_at": bw.measured_at}))
    except OSError:
        pass
    return bw


def _read_bandwidth(cache: Path, label: str) -> Bandwidth | None:
    """The cached figure for `label`; None when missing, unreadable, another machine's, or one copy's (an older
    version's figure, measured once: measured again)."""
    try:
        c = json.loads(cache.read_text())
        if c.get("label") != label or int(c.get("runs", 1)) < 2 or not float(c["bytes_per_s"]) > 0:
            return None
        return Bandwidth(label, float(c["bytes_per_s"]), True, float(c["median"]), float(c["low"]), int(c["runs"]),
                         str(c.get("measured_at", "")))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
