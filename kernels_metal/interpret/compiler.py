"""Finds a clang, compiles kernel translation units to shared libraries, caches them by hash.

The compiler must know `_Float16` and `__bf16` arithmetic on the host: the `ziglang` package's
clang (the default, pinned by the dev dependencies), or a system clang >= 17. The kernel TU is
compiled as C++ but linked without a C++ runtime (`cc -x c++`), which keeps zig's one-time setup
to a few seconds. The fiber runtime is compiled once into an object and linked into every kernel.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from functools import cache
from pathlib import Path

CSRC = Path(__file__).parent / "csrc"


class MetalInterpretError(RuntimeError):
    """A kernel failed in the interpreter: divergent barrier, crash, timeout..."""


class MetalCompileError(MetalInterpretError):
    """The kernel source does not compile."""


def cache_dir() -> Path:
    if path := os.environ.get("ROOFLINE_INTERPRET_CACHE"):
        return Path(path)
    if root := os.environ.get("ROOFLINE_CACHE"):
        return Path(root) / "metal-interpret"
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "roofline" / "metal-interpret"


def _clang_major(cmd: list[str]) -> int:
    try:
        out = subprocess.run(cmd + ["--version"], capture_output=True, text=True, timeout=60, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    for word in out.replace("-", " ").split():
        if word[:1].isdigit() and "." in word and "clang" in out:
            return int(word.split(".")[0])
    return 0


@cache
def compiler() -> tuple[tuple[str, ...], str]:
    """(command, version line) of the C driver to use."""
    if env := os.environ.get("ROOFLINE_INTERPRET_CC"):
        cmd = shlex.split(env)
    else:
        try:
            import ziglang  # noqa: F401

            cmd = [sys.executable, "-m", "ziglang", "cc"]
        except ImportError:
            cmd = []
            for name in ("clang-20", "clang-19", "clang-18", "clang-17", "clang"):
                if (path := shutil.which(name)) and _clang_major([path]) >= 17:
                    cmd = [path]
                    break
            if not cmd:
                raise MetalInterpretError(
                    "no suitable compiler for the Metal interpreter: install the `ziglang` "
                    "package (a dev dependency) or clang >= 17, or set ROOFLINE_INTERPRET_CC"
                )
    version = subprocess.run(cmd + ["--version"], capture_output=True, text=True, check=False).stdout
    return tuple(cmd), version.splitlines()[0] if version else "?"


def _flags() -> list[str]:
    opt = os.environ.get("ROOFLINE_INTERPRET_OPT", "1")
    return [
        "-x", "c++", "-std=c++17", f"-O{opt}", "-fPIC", "-fvisibility=hidden",
        "-fno-exceptions", "-fno-rtti", "-fno-threadsafe-statics", "-fsigned-char",
        "-ffp-contract=off", "-fno-fast-math", "-Wno-unknown-attributes",
        "-Xclang", "-ffloat16-excess-precision=none",
        "-Xclang", "-fbfloat16-excess-precision=none",
        f"-I{CSRC}", f"-I{CSRC / 'include'}",
        *shlex.split(os.environ.get("ROOFLINE_INTERPRET_CFLAGS", "")),
    ]  # fmt: skip


def _digest(*parts: str | bytes) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode() if isinstance(p, str) else p)
        h.update(b"\0")
    return h.hexdigest()[:24]


def _run(cmd: list[str], what: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    except subprocess.TimeoutExpired as e:
        raise MetalCompileError(f"{what}: the compiler timed out") from e


def _atomic_write(build, target: Path) -> None:
    """`build(tmp_path)` writes a file; it lands at `target` atomically (parallel test workers)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=target.suffix + ".tmp")
    os.close(fd)
    try:
        build(Path(tmp))
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@cache
def _runtime_key() -> str:
    _, version = compiler()
    sources = [(CSRC / f).read_bytes() for f in ("runtime.cpp", "isolate.h", "fiber.h", "abi.h")]
    return _digest(version, *_flags(), *sources)


def _runtime_object() -> Path:
    cmd, _ = compiler()
    target = cache_dir() / f"runtime-{_runtime_key()}.o"
    if not target.exists():

        def build(tmp: Path) -> None:
            r = _run([*cmd, *_flags(), "-c", str(CSRC / "runtime.cpp"), "-o", str(tmp)], "runtime")
            if r.returncode != 0:
                raise MetalCompileError(f"the interpreter runtime does not compile:\n{r.stderr}")

        _atomic_write(build, target)
    return target


@cache
def _shim_key() -> str:
    return _digest(*(p.read_bytes() for p in sorted(CSRC.glob("*.h"))))


_loaded: dict[str, ctypes.CDLL] = {}


def build_kernel(name: str, cpp: str) -> ctypes.CDLL:
    """Compiles (or fetches from the cache) the kernel TU; `name` is for messages."""
    cmd, version = compiler()
    runtime = _runtime_object()
    key = _digest(version, *_flags(), _shim_key(), runtime.name, cpp)
    if key in _loaded:
        return _loaded[key]
    target = cache_dir() / f"kernel-{key}.so"
    if not target.exists():

        def build(tmp: Path) -> None:
            src = tmp.with_suffix(".cpp")
            src.write_text(cpp)
            try:
                r = _run(
                    [*cmd, *_flags(), "-shared", str(src), "-x", "none", str(runtime),
                     "-lm", "-o", str(tmp)],
                    name,
                )  # fmt: skip
            finally:
                src.unlink(missing_ok=True)
            if r.returncode != 0:
                raise MetalCompileError(
                    f"[metal_kernel] kernel `{name}` does not compile:\n{_clean(r.stderr, src)}"
                )

        _atomic_write(build, target)
    lib = ctypes.CDLL(str(target))
    _loaded[key] = lib
    return lib


def _clean(stderr: str, src: Path) -> str:
    return stderr.replace(str(src), "<kernel>").strip()
