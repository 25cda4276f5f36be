"""The environment the torch backend reads, in one place, each variable with what it does. What a user chooses per
model is a load option (`mlx_engine.api.LOAD_OPTIONS`: `compile`, `native_step`, `cpu_kernel`, `threads`, ...);
what stays here is what a test run, a benchmark script or a toolchain sets for a whole process. Each is read when
asked (not at import), so a test's monkeypatch.setenv applies to the next load."""

from __future__ import annotations

import os
from dataclasses import dataclass

OFF = ("0", "off", "false", "no")


@dataclass(frozen=True)
class Switch:
    """An on/off environment variable: `default` where it is unset or empty, off where it is one of OFF (any
    case), else on."""

    name: str
    default: bool
    help: str

    def on(self) -> bool:
        value = os.environ.get(self.name, "").strip().lower()
        return self.default if value == "" else value not in OFF


COMPILE = Switch("ROOFLINE_TORCH_COMPILE", True,
                 "0: the `compile` load option defaults to off wherever it would default to on (the test suite sets "
                 "it: a compile costs tens of seconds); `compile=True` still compiles")
CPU_NATIVE = Switch("ROOFLINE_TORCH_CPU_NATIVE", True,
                    "0: the `cpu_kernel` load option defaults to off: torch's int4 and int8 kernels read the packed "
                    "weights, not Roofline's own (the tests of torch's kernels, bench/torch_cpu_ab.py's A/B)")
NATIVE_STEP = Switch("ROOFLINE_TORCH_NATIVE_STEP", True,
                     "0: the `native_step` load option defaults to off: a forward's layers run as Python around the "
                     "kernel's matmuls (compiled graphs or eager ops)")
CPU_PACKED = Switch("ROOFLINE_TORCH_CPU_PACKED", True,
                    "0: quantized weights dequantized to float32 on the CPU even where the CPU kernels could read "
                    "them packed (the exact float32 twin of the packed path, for parity checks)")
UNFUSED = Switch("ROOFLINE_TORCH_UNFUSED", False,
                 "1: the norms, rope and the MLP's gate as their torch references on CUDA too, not one Triton kernel "
                 "each (the A/B of bench/device_check.sh)")
SWITCHES = (COMPILE, CPU_NATIVE, NATIVE_STEP, CPU_PACKED, UNFUSED)


def fused() -> bool:
    """The norms, rope and the MLP's gate as one Triton kernel each on CUDA (`UNFUSED` off)."""
    return not UNFUSED.on()


def triton_interpret() -> bool:
    """TRITON_INTERPRET, Triton's own: its kernels run on the CPU interpreter (tests) rather than compiled."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def cxx() -> str | None:
    """$CXX: the C++ compiler that builds Roofline's CPU kernel, where set (else c++ or g++ on the PATH)."""
    return os.environ.get("CXX") or None


def inductor_cache_dir(default: str) -> None:
    """TORCHINDUCTOR_CACHE_DIR, inductor's own: set to `default` (the app's cache) unless the user set it."""
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = default
