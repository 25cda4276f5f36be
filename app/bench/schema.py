"""The bench JSON (schema "roofline-bench-1") and its checker: `roofline bench --json` writes it,
`roofline bench compare` reads two of them.

    {"schema": "roofline-bench-1",
     "command": str,
     "machine": {"platform", "python", "cpu", "cpu_count", "chip", "backend", "device", "versions": {pkg: ver},
                 "date",
                 "peak_bandwidth": {"gbs": float | null, "label", "source": "table"|"measured"|"unknown", "note",
                                    # measured: the best of `runs` copies; their median and low
                                    "median_gbs"?, "low_gbs"?, "runs"?, "measured_at"?},
                 "peak_flops": {"tflops": float | null, "label", "source", "note"}},
     "model": {"name", "path", "model_type", "source_format", "quantization", "dtype", "num_parameters",
               "weight_bytes", "context_length", "decode_bytes_per_token"},
     "settings": {"prompt_tokens", "gen_tokens", "repeats", "batches": [int], "contexts": [int],
                  "skipped_contexts"?: [int]},                  # depths the model's context cannot hold
     "interrupted"?: true,                                       # Ctrl+C: the rows are the points finished
     "rows": [{"batch", "context",
               "pp": {"mean", "stddev", "values": [float]},   # tokens/s, all sequences together
               "tg": {"mean", "stddev", "values": [float]},
               "pp_tokens": int,                             # prompt tokens computed per repeat
               "peak_memory_bytes": int,
               "decode_bytes_per_step": float,               # weights once + each sequence's KV
               "tg_roofline_pct": float | null,              # bytes/step x steps/s / peak bandwidth
               "pp_roofline_pct": float | null}]}            # 2 x params x tokens/s / peak FLOP/s
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mlx_engine.api import RooflineError

SCHEMA = "roofline-bench-1"

_NUM = (int, float)
_MACHINE = {"platform": str, "chip": str, "backend": str, "device": str, "date": str, "versions": dict,
            "peak_bandwidth": dict, "peak_flops": dict}
_MODEL = {"name": str, "num_parameters": int, "decode_bytes_per_token": int}
_SETTINGS = {"prompt_tokens": int, "gen_tokens": int, "repeats": int, "batches": list, "contexts": list}
_ROW = {"batch": int, "context": int, "pp": dict, "tg": dict, "pp_tokens": _NUM, "peak_memory_bytes": int,
        "decode_bytes_per_step": _NUM}
_STAT = {"mean": _NUM, "stddev": _NUM, "values": list}


def _check(obj: Any, fields: dict[str, Any], where: str, source: str) -> None:
    if not isinstance(obj, dict):
        raise RooflineError(f"{source}: {where} must be an object, got {type(obj).__name__}")
    for name, kind in fields.items():
        if name not in obj:
            raise RooflineError(f"{source}: {where}.{name} is missing")
        value = obj[name]
        if isinstance(value, bool) or not isinstance(value, kind):
            raise RooflineError(f"{source}: {where}.{name} has the wrong type ({type(value).__name__})")


def validate(data: Any, source: str = "bench JSON") -> dict[str, Any]:
    """Returns `data` if it is a well-formed bench result, else raises RooflineError naming the field."""
    _check(data, {"schema": str, "machine": dict, "model": dict, "settings": dict, "rows": list}, "top level", source)
    if data["schema"] != SCHEMA:
        raise RooflineError(f"{source}: schema is {data['schema']!r}, expected {SCHEMA!r}")
    _check(data["machine"], _MACHINE, "machine", source)
    _check(data["model"], _MODEL, "model", source)
    _check(data["settings"], _SETTINGS, "settings", source)
    for i, row in enumerate(data["rows"]):
        _check(row, _ROW, f"rows[{i}]", source)
        for test in ("pp", "tg"):
            _check(row[test], _STAT, f"rows[{i}].{test}", source)
        for key in ("tg_roofline_pct", "pp_roofline_pct"):
            if row.get(key) is not None and (isinstance(row[key], bool) or not isinstance(row[key], _NUM)):
                raise RooflineError(f"{source}: rows[{i}].{key} has the wrong type ({type(row[key]).__name__})")
    if not data["rows"]:
        raise RooflineError(f"{source}: rows is empty")
    return data


def load(path: str) -> dict[str, Any]:
    p = Path(path)
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise RooflineError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise RooflineError(f"{path}: cannot read it ({e})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise RooflineError(f"{path}: not JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    return validate(data, path)
