"""A validating GGUF header reader.

MLX's GGUF loader (ggml's `gguf_init`) segfaults on some corrupt headers, so every GGUF file is read
and bounds-checked here first: metadata, tensor infos, types and data extents. Only a file that passes
is handed to `mx.load`. Also used alone for vocabulary-only GGUF files (`roofline tokens`).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mlx_engine._mlx_lm import bare_package
from mlx_engine.api import ModelLoadError

bare_package("gguf")  # its tables without its __init__'s writer and sentencepiece (mlx_engine._mlx_lm)
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType  # noqa: E402

# GGUF value types -> (struct format, numpy dtype)
_SCALARS: dict[int, tuple[str, str]] = {
    0: ("<B", "<u1"),
    1: ("<b", "<i1"),
    2: ("<H", "<u2"),
    3: ("<h", "<i2"),
    4: ("<I", "<u4"),
    5: ("<i", "<i4"),
    6: ("<f", "<f4"),
    7: ("<?", "?"),
    10: ("<Q", "<u8"),
    11: ("<q", "<i8"),
    12: ("<d", "<f8"),
}
_STRING, _ARRAY = 8, 9
_QTYPES = {int(t): t for t in GGMLQuantizationType}  # an enum call per tensor costs more than the rest of its info
_MAX_DIMS = 4


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order (outermost first), as MLX returns it
    ggml_type: str  # "F32", "Q4_1", "Q4_K", ...
    offset: int  # absolute offset in the file
    nbytes: int


@dataclass
class GGUFFile:
    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: list[TensorInfo] = field(default_factory=list)

    @property
    def architecture(self) -> str | None:
        return self.metadata.get("general.architecture")

    def tensor_types(self) -> set[str]:
        return {t.ggml_type for t in self.tensors}

    def drop_strings(self) -> None:
        """The tokenizer's string arrays (the vocabulary, the merges) as `SkippedStrings`: their lengths only, as
        `read_gguf(strings=False)` reads them, once a tokenizer holds them."""
        for key, value in self.metadata.items():
            if key.startswith("tokenizer.") and isinstance(value, list) and value and isinstance(value[0], str):
                self.metadata[key] = SkippedStrings(len(value))


class SkippedStrings:
    """A string array `read_gguf(strings=False)` stepped over (a vocabulary, its merges): only its length."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n


_U64 = struct.Struct("<Q")
_TENSOR_INFO = {n: struct.Struct(f"<{n}QIQ") for n in range(1, _MAX_DIMS + 1)}  # dims, type code, offset


class _Reader:
    def __init__(self, path: Path, data: bytes | memoryview, strings: bool = True):
        self.path, self.data, self.pos, self.strings = path, data, 0, strings

    def fail(self, what: str) -> ModelLoadError:
        return ModelLoadError(
            f"{self.path}: corrupt or truncated GGUF file: {what} (at byte {self.pos} of {len(self.data)})"
        )

    def take(self, n: int, what: str) -> memoryview:
        if n < 0 or self.pos + n > len(self.data):
            raise self.fail(f"{what} extends past the end of the file")
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def scalar(self, fmt: str, what: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]

    def unpack(self, fmt: struct.Struct, what: str) -> tuple[Any, ...]:
        if self.pos + fmt.size > len(self.data):
            raise self.fail(f"{what} extends past the end of the file")
        out = fmt.unpack_from(self.data, self.pos)
        self.pos += fmt.size
        return out

    def string(self, what: str) -> str:
        n = self.scalar("<Q", what)
        raw = self.take(n, what)
        try:
            return bytes(raw).decode("utf-8")
        except UnicodeDecodeError:
            return bytes(raw).decode("utf-8", errors="replace")

    def value(self, vtype: int, key: str) -> Any:
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype][0], f"value of {key}")
        if vtype == _STRING:
            return self.string(f"value of {key}")
        if vtype == _ARRAY:
            etype = self.scalar("<I", f"array type of {key}")
            n = self.scalar("<Q", f"array length of {key}")
            if etype in _SCALARS:
                dt = np.dtype(_SCALARS[etype][1])
                raw = self.take(n * dt.itemsize, f"array {key}")
                return np.frombuffer(raw, dtype=dt).copy()
            if etype == _STRING:
                if n > len(self.data) // 8:
                    raise self.fail(f"array {key} claims {n} strings")
                if not self.strings:
                    return self.skip_strings(n, key)
                return [self.string(f"array {key}") for _ in range(n)]
            raise self.fail(f"array {key} has unsupported element type {etype}")
        raise self.fail(f"metadata {key!r} has unknown value type {vtype}")

    def skip_strings(self, n: int, key: str) -> SkippedStrings:
        """Steps over n strings without decoding them (a catalog lists fifty files in under a second, so the loop
        checks bounds once: past the end, unpack_from raises)."""
        pos, data, unpack = self.pos, self.data, _U64.unpack_from
        try:
            for _ in range(n):
                pos += 8 + unpack(data, pos)[0]
        except (struct.error, OverflowError):
            self.pos = min(pos, len(data))
            raise self.fail(f"array {key} extends past the end of the file") from None
        if pos > len(data):
            raise self.fail(f"array {key} extends past the end of the file")
        self.pos = pos
        return SkippedStrings(n)


def read_gguf(path: str | Path, strings: bool = True) -> GGUFFile:
    """Reads and validates a GGUF file's header; raises ModelLoadError naming the file and the problem.
    `strings=False`: string arrays (the vocabulary) are stepped over, as `SkippedStrings` (a catalog's read)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            import mmap

            size = path.stat().st_size
            if size < 24:
                raise ModelLoadError(f"{path}: not a GGUF file ({size} bytes, too short for a GGUF header)")
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as e:
        raise ModelLoadError(f"{path}: cannot read GGUF file: {e.strerror or e}") from None
    try:
        return _parse(path, memoryview(mm), strings)
    finally:
        try:
            mm.close()
        except BufferError:  # a view is still alive; the GC closes it
            pass


def _parse(path: Path, data: memoryview, strings: bool = True) -> GGUFFile:
    r = _Reader(path, data, strings)
    magic = bytes(r.take(4, "magic"))
    if magic != b"GGUF":
        raise ModelLoadError(f"{path}: not a GGUF file (magic {magic!r}, expected b'GGUF')")
    version = r.scalar("<I", "version")
    if version not in (2, 3):
        raise ModelLoadError(f"{path}: unsupported GGUF version {version} (supported: 2, 3)")
    n_tensors = r.scalar("<Q", "tensor count")
    n_kv = r.scalar("<Q", "metadata count")
    if n_tensors > len(data) // 16 or n_kv > len(data) // 12:
        raise r.fail(f"implausible counts ({n_tensors} tensors, {n_kv} metadata entries)")

    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = r.string("metadata key")
        vtype = r.scalar("<I", f"type of {key}")
        metadata[key] = r.value(vtype, key)

    raw_infos = []
    for _ in range(n_tensors):
        name = r.string("tensor name")
        n_dims = r.scalar("<I", "tensor dims")
        if not 1 <= n_dims <= _MAX_DIMS:
            raise r.fail(f"tensor {name!r} has {n_dims} dimensions (expected 1..{_MAX_DIMS})")
        *dims, tcode, offset = r.unpack(_TENSOR_INFO[n_dims], f"shape, type and offset of {name}")
        raw_infos.append((name, dims, tcode, offset))

    alignment = int(metadata.get("general.alignment", 32))
    if alignment <= 0 or alignment & (alignment - 1):
        raise r.fail(f"general.alignment={alignment} is not a power of two")
    data_start = (r.pos + alignment - 1) // alignment * alignment

    tensors = []
    for name, dims, tcode, offset in raw_infos:
        qtype = _QTYPES.get(tcode)
        if qtype is None:
            raise ModelLoadError(f"{path}: tensor {name!r} has unknown ggml type code {tcode}")
        block, type_size = GGML_QUANT_SIZES[qtype]
        n = 1
        for d in dims:
            n *= d
        if dims[0] % block:
            raise r.fail(f"tensor {name!r}: row length {dims[0]} is not a multiple of {qtype.name}'s block {block}")
        nbytes = n // block * type_size
        start = data_start + offset
        if offset % alignment or start + nbytes > len(data):
            raise ModelLoadError(
                f"{path}: corrupt or truncated GGUF file: tensor {name!r} ({qtype.name}, {nbytes} bytes at "
                f"offset {start}) extends past the end of the file ({len(data)} bytes)"
                if start + nbytes > len(data)
                else f"{path}: corrupt GGUF file: tensor {name!r} offset {offset} is not aligned to {alignment}"
            )
        tensors.append(TensorInfo(name, tuple(reversed(dims)), qtype.name, start, nbytes))
    return GGUFFile(path=path, version=version, metadata=metadata, tensors=tensors)
