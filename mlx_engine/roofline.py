"""The roofline: bytes a decode step must read, and how fast this machine can read them.

Decode at batch 1 reads every weight once per token (plus the KV cache so far), so
tokens/s <= bandwidth / bytes_per_token. "% of roofline" = bytes_per_token * tokens/s / bandwidth.

The bandwidth, the denominator of "% of roofline": from the chip table in
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

import numpy as np


@dataclass(frozen=True)
class DecodeBytes:
    weights: int  # weight bytes read per token (the embedding table counts once only if tied to the head)
    kv: int  # KV bytes read per token at the given context length

    @property
    def total(self) -> int:
        return self.weights + self.kv


@dataclass(frozen=True)
class MoEShape:
    """A mixture-of-experts model's experts: a decode step reads only those its router picks."""

    expert_bytes: tuple[int, ...]  # one expert's bytes (its projections, as stored), per MoE layer
    num_experts: tuple[int, ...]  # per MoE layer
    experts_per_token: int  # the router's top k

    @property
    def all_experts_bytes(self) -> int:
        return sum(b * n for b, n in zip(self.expert_bytes, self.num_experts))


def moe_step_bytes(weight_bytes: int, moe: MoEShape, experts: list[list[int]]) -> int:
    """Weight bytes one decode step reads: `weight_bytes` (every weight read per token) less the experts, plus
    the experts routed in the step, per MoE layer (`experts[l]`: for a batch, the union of its rows' choices)."""
    if len(experts) != len(moe.expert_bytes):
        raise ValueError(f"routing for {len(experts)} MoE layers, the model has {len(moe.expert_bytes)}")
    routed = sum(len(set(e)) * b for e, b in zip(experts, moe.expert_bytes))
    return weight_bytes - moe.all_experts_bytes + routed


def moe_weights_per_step(report: dict | None, batch: int) -> float | None:
    """Mean weight bytes of a mixture-of-experts model's recorded decode steps (`Engine.moe_routing`) of exactly
    `batch` decode rows and nothing else (no prefill packed in); None for a dense model or without such steps."""
    if not report:
        return None
    steps = [s["bytes"] for s in report["steps"] if s["decode_rows"] == batch == len(s["rows"][0])]
    return sum(steps) / len(steps) if steps else None


def decode_bytes_per_token(
    weight_bytes: int,
    embedding_bytes: int,
    tied_embeddings: bool,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    context: int,
    kv_bytes_per_element: float,
    moe: MoEShape | None = None,
) -> DecodeBytes:
    """`weight_bytes` counts every parameter as stored; an untied input embedding is a row lookup, so
    its table is not read per token (a tied one is read in full by the output head). With `moe`, one
    sequence's token reads the shared weights and its top-k experts of each MoE layer."""
    weights = weight_bytes if tied_embeddings else weight_bytes - embedding_bytes
    if moe is not None:
        weights = moe_step_bytes(weights, moe, [list(range(min(moe.experts_per_token, n))) for n in moe.num_experts])
    kv = int(2 * num_layers * num_kv_heads * head_dim * context * kv_bytes_per_element)
    return DecodeBytes(weights=weights, kv=kv)


def kv_dtype_here() -> tuple[str, str]:
    """(dtype, why) of an unquantized KV cache as the MLX engine stores it on this machine, by default: its
    activation dtype (`runner.pick_dtype`), float32 on MLX's CPU backend, on Metal the checkpoint's (float16 for
    GGUF and most checkpoints; `roofline kv --dtype bfloat16` for a bfloat16 one)."""
    import mlx.core as mx

    if not mx.metal.is_available():
        return "float32", "what MLX's CPU backend stores here"
    return "float16", "what Metal stores for a float16 or GGUF checkpoint"


def measure_bandwidth(nbytes: int = 256 * 2**20, repeats: int = 5) -> float:
    """Sustained read+write bandwidth in bytes/s: the best of `bandwidth_readings(repeats, nbytes)`."""
    return max(bandwidth_readings(repeats, nbytes))


def bandwidth_readings(runs: int = 9, nbytes: int = 256 * 2**20, pause_s: float = 0.02) -> list[float]:
    """`runs` timed copies of an `nbytes` buffer (far beyond any cache), each as bytes/s counting the bytes read
    plus the bytes written (STREAM's copy), after an untimed first copy that faults the pages in. A short pause
    between copies spreads them over time, so that a burst of another process's work spoils a few, not all (on a
    shared VM single copies vary more than twofold)."""
    src = np.ones(nbytes // 8, dtype=np.float64)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    out = []
    for i in range(runs):
        if i:
            time.sleep(pause_s)
        t = time.perf_counter()
        np.copyto(dst, src)
        out.append(2 * src.nbytes / (time.perf_counter() - t))
    return out


# ---- this machine's bandwidth ---------------------------------------------------------------------------

# in a checkout (and an editable install) the repo's assets/; in a built wheel, a copy beside this file
_REPO_CHIPS = Path(__file__).resolve().parents[1] / "assets" / "chips.json"
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
    bandwidth_readings)."""
    chip = detect_chip()
    if chip is not None:
        known = lookup(*chip)
        if known is not None:
            return known
    label = chip[0] if chip else _cpu_name()
    if measure is None:
        measure = bandwidth_readings
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
