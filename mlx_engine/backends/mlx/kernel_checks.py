"""The Metal kernels a loaded model will launch, checked on this machine before the first request: each that fails
its self-check (`kernels_metal._backend.self_check`) gives way to its reference, and the user is told once, in
`ModelInfo.warnings`."""

from __future__ import annotations

from typing import Any


def kernel_warnings(model: Any, cache: Any, dtype: Any) -> tuple[str, ...]:
    """One line per kernel of `model` (with `dtype` activations) and its KV `cache` that failed its check; () with
    nothing to check (no Metal, no interpreter)."""
    from kernels_metal import _backend

    which = _backend.resolve("auto")
    if which == "reference":
        return ()
    return cache.check_kernels() + _kquant_warnings(which, model, dtype)


def _kquant_warnings(which: str, model: Any, dtype: Any) -> tuple[str, ...]:
    from kernels_metal import kquant
    from mlx_engine.models.kquant import KQuantEmbedding, KQuantLinear

    layers = [m for _, m in model.named_modules() if isinstance(m, (KQuantLinear, KQuantEmbedding))]
    if not layers:
        return ()
    failed = [(t, why) for t in sorted({m.ggml_type for m in layers})
              if (why := kquant.self_check(which, dtype, t)) is not None]
    if not failed:
        return ()
    return (f"the Metal k-quant matmul kernel failed its check on this machine for {', '.join(t for t, _ in failed)} "
            f"({failed[0][1]}): those layers run on its MLX-ops reference instead (the same results, slower)",)
