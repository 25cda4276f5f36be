"""The torch runner's load-time choices: device, activation dtype, CPU threads, how quantized weights are held on
the CPU (packed for torch's int4/int8 kernels, or dequantized) and the draft held at 8 bits."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from mlx_engine.api import RooflineError
from mlx_engine.backends.torch import switches

DEVICES = ("auto", "cpu", "cuda")
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Torch threads of a CPU forward by default: torch's own count at import (the physical cores it may use).
# A parallel region waits on its slowest thread, so on a machine whose other processes keep a core busy,
# `threads=1` can be the faster setting (bench/cpu_vs_llama_cpp.py measures both).
DEFAULT_CPU_THREADS = torch.get_num_threads()


def cuda_available() -> bool:
    """torch sees a CUDA device (backend="auto" picks CUDA then)."""
    return torch.cuda.is_available()


def resolve_device(device: str) -> torch.device:
    if device not in DEVICES:
        raise RooflineError(f"device={device!r}: expected one of {', '.join(map(repr, DEVICES))}")
    if device == "cuda" and not torch.cuda.is_available():
        raise RooflineError(f"device='cuda' but torch {torch.__version__} sees no CUDA device (a CPU build, or no "
                            "GPU/driver): use device='cpu' or 'auto'")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device)


def check_draft_bits(bits: Any, draft_model: str | None, device: torch.device, dtype: str | None) -> None:
    """`draft_bits` on this backend: 8, on the CPU in float32, with a draft model to hold that way."""
    if bits is None:
        return
    if bits != 8:
        raise RooflineError(f"draft_bits={bits!r}: the torch backend holds a draft at 8 bits only (the CPU's int8 "
                            "matmul); on MLX, 4 or 8")
    if draft_model is None:
        raise RooflineError("draft_bits=8 needs draft_model: the model to hold at 8 bits as the draft (it may be "
                            "the model itself)")
    if device.type != "cpu":
        raise RooflineError(f"draft_bits=8 is for device='cpu' (this runner is on {device.type}); on CUDA, load a "
                            "quantized draft file: its weights stay packed for the dequantizing matmul")
    if dtype not in (None, "float32"):
        raise RooflineError(f"draft_bits=8 needs float32 activations on the CPU, not dtype={dtype!r}")


def use_kernels(device: torch.device) -> bool:
    """Packed quantized weights and the paged decode kernel (triton_kernels): on CUDA."""
    return device.type == "cuda"


def pick_dtype(requested: str | None, checkpoint_dtype: str, device: torch.device) -> torch.dtype:
    """float32 on the CPU; on CUDA the checkpoint's half dtype (float16 for GGUF)."""
    if requested is not None:
        if requested not in _DTYPES:
            raise RooflineError(f"dtype={requested!r}: expected one of {', '.join(_DTYPES)}")
        return _DTYPES[requested]
    if device.type == "cpu":
        return torch.float32
    return _DTYPES.get(checkpoint_dtype, torch.float16)


def check_threads(threads: Any, device: torch.device) -> int:
    """`threads`: torch's CPU threads for this runner (None: DEFAULT_CPU_THREADS)."""
    if threads is None:
        return DEFAULT_CPU_THREADS
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise RooflineError(f"threads={threads!r}: expected an integer >= 1 (CPU threads for torch's kernels)")
    if device.type != "cpu":
        raise RooflineError(f"threads={threads} is for device='cpu' (this runner is on {device.type}); leave it unset")
    return threads


def check_switch(name: str, value: Any, switch: switches.Switch) -> bool:
    """An on/off load option: True or False as given, None the default (`switch`'s)."""
    if value is not None and not isinstance(value, bool):
        raise RooflineError(f"{name}={value!r}: expected True, False or None (default: on, unless {switch.name}=0)")
    return switch.on() if value is None else value


def cpu_pack_plan(device: torch.device, cpu_kernel: bool | None = None) -> tuple[Any, tuple[str, ...]]:
    """(CPUSupport to pack quantized weights with, or None; warnings): packed on an x86-64 CPU with AVX2 whose
    int4 kernel's layout `cpu_packed` reads; otherwise the portable path, said in a warning. `cpu_kernel`: Roofline's
    own kernel where it builds (None: `switches.CPU_NATIVE`), else torch's int4 and int8 kernels."""
    if device.type != "cpu":
        return None, ()
    from mlx_engine.backends.torch import cpu_features, cpu_packed

    if not switches.CPU_PACKED.on():
        return None, ()
    support = cpu_features.cpu_support()
    reason = support.reason
    if support.packed and not cpu_packed.layout_ok(support.block_n):
        reason = (f"torch {torch.__version__}'s packed int4 layout is not the one this version reads "
                  f"({support.block_n}-row blocks)")
    if reason:
        return None, (f"quantized weights are dequantized to float32 at load (the portable path: about 4-8x "
                      f"the bytes a token reads, and as much memory): {reason}",)
    if support.native:
        from mlx_engine.backends.torch import cpu_native

        wanted = switches.CPU_NATIVE.on() if cpu_kernel is None else cpu_kernel
        error = cpu_native.build_error() if wanted else ""
        if error or not wanted:
            support = dataclasses.replace(support, native=False)
        if error:
            return support, (f"{error}: torch's int4 kernel instead, slower at decode (half the tokens a second "
                             f"on an AVX2 CPU, 0.8x on AVX-512: docs/benchmarks.md)",)
    return support, ()


def cpu_pack_notes(model: Any) -> tuple[str, ...]:
    """One note on how the quantized weights are held for torch's CPU kernels, per source format."""
    from mlx_engine.backends.torch import cpu_packed
    from mlx_engine.backends.torch.model import FusedLinear

    counts: dict[tuple[str, str], int] = {}
    parts = [model.embed_tokens.weight, model.lm_head.weight if model.lm_head is not None else None]
    for b in model.layers:
        a, m = b.self_attn, b.mlp
        parts += [x.weight for x in (a.qkv, a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_up, m.gate_proj,
                                     m.up_proj, m.down_proj) if x is not None and not isinstance(x, FusedLinear)]
        parts += [x.weight for x in (a.qkv, m.gate_up) if isinstance(x, FusedLinear)]
    for w in parts:
        if isinstance(w, cpu_packed.CPUWeight):
            key = (cpu_packed.kind(w), w.source)
            counts[key] = counts.get(key, 0) + 1
    if not counts:
        return ()
    order = ["int4", "int4x2", "int8", "native4", "native5", "native6", "native8", "native8r"]
    kinds = sorted({k for k, _ in counts}, key=order.index)
    held = "; ".join(f"{cpu_packed.describe(k)}: " + ", ".join(f"{src} x{n}" for (kk, src), n in sorted(counts.items())
                                                             if kk == k) for k in kinds)
    return (f"quantized weights packed for the CPU kernels: {held}",)
