"""The machine a benchmark ran on, and its two rooflines: peak memory bandwidth (decode) and peak FLOP/s
(prefill), from the chip table in assets/chips.json where it knows the chip, else measured and cached (the best
reading kept: see mlx_engine/roofline.py for the bandwidth, `measured_peak` for the FLOP/s)."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from mlx_engine.roofline import CHIPS_FILE, _cpu_name, detect_chip, machine_bandwidth

FLOPS_CACHE_NAME = "peak_flops.json"


def nvidia_gpu_name() -> str | None:
    """The first GPU's name as nvidia-smi reports it ("NVIDIA H200"); None without nvidia-smi."""
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = [x.strip() for x in r.stdout.splitlines() if x.strip()] if r.returncode == 0 else []
    return lines[0] if lines else None


def gpu_entry(name: str, path: Path = CHIPS_FILE) -> dict[str, Any] | None:
    """The chip table's GPU entry whose name or `match` list equals `name` (case and spacing ignored)."""
    def norm(s: str) -> str:
        return " ".join(s.lower().split())

    for c in json.loads(path.read_text())["chips"]:
        if c.get("gpu") and norm(name) in {norm(c["name"]), *map(norm, c.get("match", []))}:
            return c
    return None


def peak_bandwidth(device: str, home: Path) -> dict[str, Any]:
    """{"gbs", "label", "source": "table" | "measured" | "unknown", "note"} for the device the engine runs on."""
    if device.startswith("cuda"):
        gpu = nvidia_gpu_name()
        entry = gpu_entry(gpu) if gpu else None
        if entry is None:
            return {"gbs": None, "label": gpu or "CUDA device", "source": "unknown",
                    "note": f"{gpu or 'this GPU'} is not in assets/chips.json: add it (gpu, match, gbs, tflops_fp16)"}
        return {"gbs": float(entry["gbs"]), "label": entry["name"], "source": "table", "note": entry.get("source", "")}
    bw = machine_bandwidth(home)
    out = {"gbs": bw.bytes_per_s / 1e9, "label": bw.label, "source": "measured" if bw.measured else "table",
           "note": bw.detail() if bw.measured else ""}
    if bw.measured:  # the spread of the copies the figure is the best of
        out.update(median_gbs=bw.median_bytes_per_s / 1e9, low_gbs=bw.low_bytes_per_s / 1e9, runs=bw.runs,
                   measured_at=bw.measured_at)
    return out


def peak_flops(device: str, home: Path, measure: Any) -> dict[str, Any]:
    """{"tflops", "label", "source", "note"}: the table's dense FP16/BF16 figure for a known GPU, else
    `measure()` (FLOP/s of a dense matmul on the device) once per machine and device, cached in `home`."""
    if device.startswith("cuda"):
        gpu = nvidia_gpu_name()
        entry = gpu_entry(gpu) if gpu else None
        if entry is None or not entry.get("tflops_fp16"):
            return {"tflops": None, "label": gpu or "CUDA device", "source": "unknown",
                    "note": "not in assets/chips.json"}
        return {"tflops": float(entry["tflops_fp16"]), "label": entry["name"], "source": "table",
                "note": "dense FP16/BF16 tensor cores: " + entry.get("tflops_source", "")}
    label = flops_label(device)
    note = "float16 MLX matmul" if device == "metal" else "float32 matmul, all cores, best of numpy and torch"
    now, best = measured_peak(home / FLOPS_CACHE_NAME, label, "flops", measure)
    note += f"; the best seen here (this run: {now / 1e12:.2f})"
    return {"tflops": best / 1e12, "label": label, "source": "measured", "note": note}


def measured_peak(cache: Path, label: str, key: str, measure: Any) -> tuple[float, float]:
    """(`measure()` now, the best of it and what `cache` holds for `label`), the best written back: a peak read on
    a busy machine is too low, so each run measures again and the figure only rises (per machine and device)."""
    now = float(measure())
    best = now
    try:
        cached = json.loads(cache.read_text())
        if cached.get("label") == label:
            best = max(best, float(cached[key]))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    if best == now:
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            cache.write_text(json.dumps({"label": label, key: now, "measured_at": time.strftime("%Y-%m-%d %H:%M")}))
        except OSError:
            pass
    return now, best


def flops_label(device: str) -> str:
    """The key a measured peak FLOP/s is cached under: this machine's chip and the device."""
    chip = detect_chip()
    return f"{chip[0] if chip else _cpu_name()} ({device}, v2)"  # v2: torch's matmul counts too


def machine_info(backend: str, device: str, versions: dict[str, str]) -> dict[str, Any]:
    chip = detect_chip()
    gpu = nvidia_gpu_name() if device.startswith("cuda") else None
    return {
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "cpu": _cpu_name(),
        "cpu_count": _cpu_count(),
        "chip": gpu or (chip[0] if chip else _cpu_name()),
        "backend": backend,
        "device": device,
        "versions": versions,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def _cpu_count() -> int | None:
    import os

    return os.cpu_count()
