"""Which implementation a kernel wrapper runs, and the kernel sources.

Three implementations share one contract: the Metal kernel (`mx.fast.metal_kernel`, a Mac's GPU),
the interpreter (`kernels_metal.interpret.metal_kernel`, the same Metal source compiled as C++ and
run on the CPU, for CI) and the MLX-ops reference (`kernels_metal.reference`).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import mlx.core as mx

Backend = Literal["auto", "metal", "interpret", "reference"]
BACKENDS = ("auto", "metal", "interpret", "reference")
INTERPRET_ENV = "ROOFLINE_METAL_INTERPRET"

_DIR = Path(__file__).parent


def load_source(name: str) -> str:
    return (_DIR / name).read_text()


def resolve(backend: str) -> str:
    """ "auto" -> "interpret" when ROOFLINE_METAL_INTERPRET=1 (an explicit request wins over
    detection), else "metal" when Metal is available, else "reference"."""
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    if backend == "metal" and not mx.metal.is_available():
        raise RuntimeError("backend='metal' needs a Metal device; mx.metal.is_available() is False")
    if backend != "auto":
        return backend
    if os.environ.get(INTERPRET_ENV) == "1":
        return "interpret"
    return "metal" if mx.metal.is_available() else "reference"


def interpret_available() -> bool:
    try:
        from kernels_metal.interpret import metal_kernel  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def interpret_factory() -> Callable[..., Any]:
    """`kernels_metal.interpret.metal_kernel`: same signature as `mx.fast.metal_kernel`."""
    try:
        from kernels_metal.interpret import metal_kernel
    except ImportError as e:
        raise RuntimeError(
            "backend 'interpret' needs kernels_metal.interpret (the Metal interpreter); "
            f"it failed to import: {e}"
        ) from e
    return metal_kernel


def build_metal(build: Callable[[Callable[..., Any]], Any]) -> Any:
    """Build a module's kernels with `mx.fast.metal_kernel` at import. Construction needs no
    device (it works on Linux); if this MLX build cannot even construct, calls fall back to
    the other backends and say why."""
    try:
        return build(mx.fast.metal_kernel)
    except Exception as e:  # pragma: no cover - depends on the MLX build
        return e
