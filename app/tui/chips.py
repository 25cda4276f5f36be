"""This machine's memory bandwidth, the denominator of "% of roofline": from the chip table in
`assets/chips.json` on a Mac it knows, else measured once (a numpy copy) and cached in the data dir."""

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
    bytes_per_s: float
    measured: bool  # True: measured on this machine, not from the table

    def describe(self) -> str:
        return f"{self.bytes_per_s / 1e9:.0f} GB/s {self.label}" + (", measured" if self.measured else "")


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
    """From the chip table when it knows this Mac; else the cached measurement; else measure now and cache.
    `measure()` returns bytes/s (default: mlx_engine.roofline.measure_bandwidth)."""
    chip = detect_chip()
    if chip is not None:
        known = lookup(*chip)
        if known is not None:
            return known
    label = chip[0] if chip else _cpu_name()
    if measure is None:
        from mlx_engine.roofline import measure_bandwidth as measure
    return Bandwidth(label, measured_once(home / CACHE_NAME, label, "bytes_per_s", measure), measured=True)


def measured_once(cache: Path, label: str, key: str, measure) -> float:
    """A machine figure `measure()` gives, cached in `cache` (a small JSON) under `label`: measured only
    when the file is missing, unreadable or holds another label. A cache that cannot be written is skipped."""
    try:
        cached = json.loads(cache.read_text())
        if cached.get("label") == label and float(cached[key]) > 0:
            return float(cached[key])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    value = float(measure())
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps({"label": label, key: value, "measured_at": time.strftime("%Y-%m-%d %H:%M:%S")}))
    except OSError:
        pass
    return value
