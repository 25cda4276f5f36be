"""What this CPU offers the torch backend's packed weights, read once a process: torch's dispatch level, the CPU's
flags, and from them which kernels hold and multiply the weights (`CPUSupport`). Its own module so that every
weight class (`cpu_packed`'s and `cpu_native`'s) reads the same facts at its matmul rather than a copy."""

from __future__ import annotations

import functools
import platform
from dataclasses import dataclass

import torch

# Rows from which a matmul dequantizes its weight (to bfloat16, a slice of output rows at a time) and runs
# oneDNN's bfloat16 GEMM (`cpu_gemm`), on a CPU with bfloat16 dot products (AVX512_BF16, AMX): the int4 kernel is
# a float32 FMA loop, bound by compute at prefill (a prefill-sized gate: several times faster dequantized; the reading:
# docs/benchmarks/code-figures.md, "Measurements moved out of the code").
DEQUANT_MIN_ROWS = 48


@dataclass(frozen=True)
class CPUSupport:
    packed: bool  # the int4/int8 kernels are vectorized here
    bf16_gemm: bool  # bfloat16 dot products in hardware (the dequantizing prefill path pays)
    block_n: int  # output rows per block of the int4 kernel's packed layout
    reason: str  # why not packed, for the load note
    native: bool = False  # AVX2 or AVX-512: Roofline's own kernel (`cpu_native`) where it builds


@functools.cache
def cpu_flags() -> frozenset[str]:
    """/proc/cpuinfo's flags of the first CPU (empty where there is none to read)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@functools.cache
def cpu_support() -> CPUSupport:
    """What torch's CPU kernels do on this machine: its dispatch level (`get_cpu_capability`: AVX512,
    AVX2, DEFAULT; ATEN_CPU_CAPABILITY lowers it) and the CPU's bfloat16 flags."""
    machine = platform.machine().lower()
    capability = torch.backends.cpu.get_cpu_capability()
    if machine not in ("x86_64", "amd64"):
        return CPUSupport(False, False, 0, f"torch's packed int4 CPU kernel is used on x86-64 only (this CPU: "
                                           f"{machine})")
    if capability not in ("AVX2", "AVX512"):
        return CPUSupport(False, False, 0, f"this CPU has no AVX2 (torch's CPU kernels: {capability}), where "
                                           "torch's int4 and int8 kernels are scalar loops")
    flags = cpu_flags()
    bf16 = capability == "AVX512" and bool(flags & {"avx512_bf16", "amx_bf16"})
    return CPUSupport(True, bf16, 64 if capability == "AVX512" else 32, "", native=True)


def bf16_gemm() -> bool:
    """`cpu_support().bf16_gemm`, which torch.compile's tracing takes as a constant (it would otherwise trace
    into `cpu_support`, whose cache it ignores, and stop at torch's capability query). `compiled` marks it so
    when it is imported, where something compiles: the mark imports torch._dynamo, which a load with nothing
    compiled (the CPU default) need not pay (3.4 s and 66 MB of peak RSS of a `roofline generate`:
    docs/benchmarks/torch-cpu.md, "Issue 27 at 1.1B")."""
    return cpu_support().bf16_gemm
