"""Backends: the model runner under the shared engine. "mlx" (Metal or MLX's CPU backend) is built in;
"torch" (CUDA or CPU) is an optional extra, imported only when asked for; "auto" (the default) picks the faster one
here for the model (`backends.choice`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from mlx_engine.api import RooflineError
from mlx_engine.backends.base import ModelRunner

BACKENDS = ("auto", "mlx", "torch")
DEVICES = ("auto", "cpu", "cuda")
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
TORCH_EXTRA_HINT = ("the torch backend needs the optional extra: `uv sync --extra torch` or `pip install "
                    "'roofline[torch]'` (on Linux that is PyPI's CUDA build, ~3 GB; for the CPU only: "
                    f"`uv pip install torch --index-url {TORCH_CPU_INDEX}`, about 200 MB)")


def _check(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise RooflineError(f"{name}={value!r}: expected one of {', '.join(map(repr, allowed))}")


def import_torch_backend() -> Any:
    """The mlx_engine.backends.torch package, or a RooflineError naming the extra when torch is missing."""
    import importlib

    try:
        importlib.import_module("torch")  # a presence probe: only backends/torch uses it
    except ImportError as e:
        raise RooflineError(f"{TORCH_EXTRA_HINT} ({e})") from None
    from mlx_engine.backends import torch as torch_backend

    return torch_backend


def load_runner(model: str | None, backend: str = "auto", device: str = "auto", **options: Any) -> ModelRunner:
    """The runner of `backend` on `device` (on the engine thread): backends.mlx's Runner or TorchRunner; "auto":
    the one `backends.choice` picks, its warning (where a faster one exists here) among the model's warnings."""
    _check("backend", backend, BACKENDS)
    _check("device", device, DEVICES)
    if backend != "auto":
        return _load(model, backend, device, options)
    from mlx_engine.backends.choice import choose, this_platform

    choice = choose(model, device, options, this_platform())
    runner = _load(model, choice.backend, choice.device, options)
    if choice.warning is not None:
        runner.info = dataclasses.replace(runner.info, warnings=(*runner.info.warnings, choice.warning))
    return runner


def _load(model: str | None, backend: str, device: str, options: dict[str, Any]) -> ModelRunner:
    distributed = options.pop("distributed", None)
    if distributed is not None:
        if backend != "mlx":
            raise RooflineError(f"distributed={distributed!r} runs on the mlx backend (mx.distributed), not {backend!r}")
        from mlx_engine import distributed as dist

        runner = dist.load_runner(model, distributed, **options)
        import mlx.core as mx

        runner.info = dataclasses.replace(runner.info, backend="mlx",
                                          device="metal" if mx.metal.is_available() else "cpu")
        return runner
    from mlx_engine.catalog import check_fit

    check_fit(model, backend, options)  # refused before a weight is read, on every front end
    if backend == "torch":
        return import_torch_backend().TorchRunner.load(model, device=device, **options)
    import mlx.core as mx

    from mlx_engine.backends.mlx.runner import Runner

    if device == "cuda":
        raise RooflineError("device='cuda' needs backend='torch': the MLX backend runs on Metal or the CPU")
    for name in ("threads", "compile", "cpu_kernel", "native_step"):
        if options.pop(name, None) is not None:
            raise RooflineError(f"{name} needs backend='torch' (device='cpu'): the MLX backend has no such option")
    if options.pop("cuda_graphs", None) is not None:
        raise RooflineError("cuda_graphs needs backend='torch' (device='cuda'): the MLX backend has no CUDA graphs")
    metal = mx.metal.is_available()
    if device == "cpu" and metal:
        raise RooflineError("device='cpu' with backend='mlx' on a Mac is not supported (the engine picks Metal); "
                            "use device='auto', or backend='torch' with device='cpu'")
    runner = Runner.load(model, **options)
    runner.info = dataclasses.replace(runner.info, backend="mlx", device="metal" if metal else "cpu")
    return runner
