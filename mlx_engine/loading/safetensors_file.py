"""Safetensors folders: validated headers, shards, then MLX's loader."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import mlx.core as mx

from mlx_engine.api import ModelLoadError

_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
             "U16": 2, "U32": 4, "U64": 8, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def validate_safetensors(path: Path) -> None:
    """Checks the header and every tensor's extent, so a truncated or corrupt file is named, not crashed on."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ModelLoadError(f"{path}: not a safetensors file ({size} bytes, too short for a header)")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8 or n > 100_000_000:
                raise ModelLoadError(
                    f"{path}: corrupt or truncated safetensors file: header claims {n} bytes, file has {size}"
                )
            header = json.loads(f.read(n))
    except OSError as e:
        raise ModelLoadError(f"{path}: cannot read: {e.strerror or e}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path}: corrupt safetensors file: header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise ModelLoadError(f"{path}: corrupt safetensors file: header is not a JSON object")
    data_size = size - 8 - n
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise ModelLoadError(f"{path}: corrupt safetensors file: bad header entry for {name!r}") from None
        if dtype not in _ITEMSIZE:
            raise ModelLoadError(f"{path}: tensor {name!r} has unsupported dtype {dtype}")
        count = 1
        for d in shape:
            count *= d
        if end > data_size:
            raise ModelLoadError(
                f"{path}: corrupt or truncated safetensors file: tensor {name!r} ends at byte {end} of the data "
                f"section, which has only {data_size} bytes"
            )
        if end - begin != count * _ITEMSIZE[dtype]:
            raise ModelLoadError(
                f"{path}: corrupt safetensors file: tensor {name!r} {dtype}{shape} needs "
                f"{count * _ITEMSIZE[dtype]} bytes, header gives {end - begin}"
            )


def weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ModelLoadError(f"{index}: not a valid safetensors index ({e})") from None
        files = sorted({folder / f for f in weight_map.values()})
        missing = [str(f.name) for f in files if not f.exists()]
        if missing:
            raise ModelLoadError(f"{index}: lists shards that are missing: {', '.join(missing)}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder}: no *.safetensors weights found (looked for model.safetensors and "
                             f"model.safetensors.index.json)")
    return files


def load_safetensors(folder: Path) -> dict[str, mx.array]:
    weights: dict[str, mx.array] = {}
    for f in weight_files(folder):
        validate_safetensors(f)
        try:
            weights.update(mx.load(str(f)))
        except (RuntimeError, ValueError) as e:
            raise ModelLoadError(f"{f}: cannot load safetensors: {e}") from None
    return weights
