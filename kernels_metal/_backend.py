"""Which implementation a kernel wrapper runs, the kernels' self-checks, and the kernel sources.

Three implementations share one contract: the Metal kernel (`mx.fast.metal_kernel`, a Mac's GPU),
the interpreter (`kernels_metal.interpret.metal_kernel`, the same Metal source compiled as C++ and
run on the CPU, for CI) and the MLX-ops reference (`kernels_metal.reference`).

A kernel has never run on a user's GPU before it runs there: on "auto" each wrapper first checks each kernel
variant it launches (`self_check`: it compiles, and matches its reference on a small case) and, when that
fails, runs the reference instead. `failures()` says which failed and why, for the engine to tell the user.
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


# (kernel, backend, variant) -> None (passed) or why the variant failed its check
_checks: dict[tuple[str, str, tuple], str | None] = {}


def self_check(kernel: str, backend: str, variant: tuple, probe: Callable[[], str | None]) -> str | None:
    """`probe()` (the variant against its reference on a small case: None when they agree, else how they
    differ) once per process, kernel, backend and variant; a probe that raises (a compile error, a launch
    failure) fails with its message. Returns None when the variant may be used, else why not."""
    key = (kernel, backend, variant)
    if key not in _checks:
        try:
            _checks[key] = probe()
        except Exception as e:  # noqa: BLE001 - whatever the GPU stack raises, the reference takes over
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            _checks[key] = f"it failed to compile or run ({type(e).__name__}: {first[:300]})"
    return _checks[key]


def failures(kernel: str | None = None) -> dict[tuple[str, str, tuple], str]:
    """The checked variants that failed (of `kernel`, or of every kernel), with why."""
    return {k: why for k, why in _checks.items() if why is not None and kernel in (None, k[0])}


def forget_checks() -> None:
    """Forgets every check (tests that break a kernel on purpose)."""
    _checks.clear()


def build_metal(build: Callable[[Callable[..., Any]], Any]) -> Any:
    """Build a module's kernels with `mx.fast.metal_kernel` at import. Construction needs no
    device (it works on Linux); if this MLX build cannot even construct, calls fall back to
    the other backends and say why."""
    try:
        return build(mx.fast.metal_kernel)
    except Exception as e:  # pragma: no cover - depends on the MLX build
        return e
