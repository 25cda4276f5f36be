"""backend="auto" (Engine.load's default): the fastest backend this machine has for the model, decided from the
model's header before any weight is read (issue 48).

- A Mac: Metal, through MLX.
- An NVIDIA GPU that torch sees: the torch backend on CUDA, for a model it runs.
- Linux x86-64 with torch installed and a CPU with AVX2: the torch backend on the CPU, for a quantized model it
  runs (its own kernel reads the packed weights: 1.2-2x llama.cpp's decode, several times MLX's CPU backend;
  docs/benchmarks.md). A float checkpoint has no packed weights there, and no measurement says torch is faster.
- Anything else: MLX's CPU backend, with a warning saying how to get the torch backend where it would be faster.

Options only one backend has decide too: `device="cuda"`, threads, compile, cpu_kernel, native_step and
cuda_graphs mean torch; distributed, paged_kv=False, quantized KV and draft_bits=4 mean MLX. `Platform` is the seam
the tests set: `choose(model, device, options, Platform(...))`.
"""

from __future__ import annotations

import importlib.util
import json
import platform as _platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlx_engine.api import ModelLoadError, RooflineError

TORCH_ONLY = ("threads", "compile", "cpu_kernel", "native_step", "cuda_graphs")
MLX_ONLY = ("distributed", "kv_bits", "kv_key_bits", "kv_key_per_channel")
# what a fresh clone on Linux runs to get the torch backend (docs/linux.md)
TORCH_INSTALL = ("`uv sync --extra torch`, or for the CPU only `uv pip install torch --index-url "
                 "https://download.pytorch.org/whl/cpu`")
FLOAT_GGUF = ("F32", "F16", "BF16")
# the model families the torch backend runs (its runner refuses the rest); here, so that the choice needs no torch
TORCH_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True)
class Platform:
    """What decides the backend besides the model."""

    system: str  # platform.system(): "Darwin", "Linux", ...
    machine: str  # platform.machine(), lower case: "arm64", "x86_64", ...
    metal: bool  # MLX sees a Metal GPU
    torch: bool  # torch imports here
    cuda: bool = False  # torch sees a CUDA device
    torch_cpu_packed: bool = False  # torch's CPU path holds quantized weights packed here (x86-64 with AVX2)

    @property
    def x86_64(self) -> bool:
        return self.machine in ("x86_64", "amd64")


@dataclass(frozen=True)
class Choice:
    backend: str  # "mlx" or "torch"
    device: str  # the device option the backend gets ("auto", "cpu", "cuda")
    warning: str | None = None  # said where a faster backend exists here but was not taken


def this_platform() -> Platform:
    """This machine's `Platform`, without importing torch (4 s and 100+ MB at every start, for a model that may end on
    MLX) unless an NVIDIA device node is there to ask it about; the torch loader checks AVX2 again through torch."""
    import mlx.core as mx

    metal = mx.metal.is_available()
    system, machine = _platform.system(), _platform.machine().lower()
    torch = not metal and importlib.util.find_spec("torch") is not None
    cuda = False
    if torch and any(Path(d).exists() for d in ("/dev/nvidiactl", "/dev/dxg")):  # a driver's node (dxg: WSL2)
        try:
            from mlx_engine.backends.torch.load import cuda_available

            cuda = cuda_available()
        except ImportError:  # an install that cannot import: as if absent (backend="torch" says why)
            torch = False
    return Platform(system, machine, metal, torch, cuda, torch_cpu_packed=torch and "avx2" in _cpu_flags())


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


def torch_refusal(model: str | None) -> str | None:
    """Why the torch backend would not run `model` (a clause after "the torch backend"), from its header alone;
    None where it would."""
    from mlx_engine.catalog import model_header

    h = model_header(model)
    if h.model_type not in TORCH_MODEL_TYPES:
        return f"runs {', '.join(TORCH_MODEL_TYPES[:-1])} and {TORCH_MODEL_TYPES[-1]} models, not {h.model_type}"
    if h.kv.sliding_window:
        return "has no sliding-window attention"
    if h.format == "mlx-quantized":
        mode = _quant_mode(model)
        if mode != "affine":
            return f"reads MLX's affine quantization, not {mode}"
    return None


def _quant_mode(model: str | None) -> str:
    from mlx_engine.loading import resolve

    path, _ = resolve(model)
    try:
        quant = json.loads((Path(path) / "config.json").read_text()).get("quantization") or {}
    except (OSError, ValueError):
        return "affine"  # unreadable: the loader says why
    return str(quant.get("mode", "affine")) if isinstance(quant, dict) else "affine"


def _quantized(model: str | None) -> bool:
    from mlx_engine.catalog import model_header

    h = model_header(model)
    return h.format == "mlx-quantized" or (h.format == "gguf" and h.quantization not in FLOAT_GGUF)


def choose(model: str | None, device: str, options: dict[str, Any], here: Platform) -> Choice:
    """The backend and device for `backend="auto"`."""
    torch_only = [k for k in TORCH_ONLY if options.get(k) is not None]
    mlx_only = [k for k in MLX_ONLY if options.get(k) not in (None, False)] + \
        (["paged_kv"] if options.get("paged_kv") is False else []) + \
        (["draft_bits"] if options.get("draft_bits") not in (None, 8) else [])  # torch holds a draft at 8 only
    if (device == "cuda" or torch_only) and mlx_only:
        what = "device='cuda'" if device == "cuda" else torch_only[0]
        raise RooflineError(f"{what} is the torch backend's and {mlx_only[0]} the MLX backend's: name one backend")
    if device == "cuda" or torch_only:
        return Choice("torch", device)
    if mlx_only or here.metal:
        return Choice("mlx", device)
    fast_cpu = here.system == "Linux" and here.x86_64
    if not (here.torch and here.cuda) and not fast_cpu:
        return Choice("mlx", device)
    try:
        why_not, quantized = torch_refusal(model), _quantized(model)
    except ModelLoadError:  # a header that cannot be read: the MLX loader says what is wrong, as it did before
        return Choice("mlx", device)
    if here.torch and why_not is not None:
        return Choice("mlx", device, f"MLX's CPU backend runs this model, since the torch backend {why_not}")
    if here.torch and here.cuda:
        return Choice("torch", device)
    if not quantized:
        return Choice("mlx", device)  # a float checkpoint: no packed weights for the torch backend's kernel
    if not here.torch:
        return Choice("mlx", device, "MLX's CPU backend runs this model: the torch backend decodes quantized models "
                      f"several times faster on this CPU. Install it: {TORCH_INSTALL}")
    if not here.torch_cpu_packed:
        return Choice("mlx", device)  # no AVX2: torch would dequantize to float32 (docs/linux.md)
    return Choice("torch", device)
