"""Roofline's engine: load a model, generate a stream of events. The public API is this package's names."""

from mlx_engine.api import (
    GenerationEvent,
    GenerationRequest,
    ModelInfo,
    ModelLoadError,
    RequestError,
    ResponseFormat,
    RooflineError,
    SamplingParams,
    Stats,
    TokenLogprob,
    Usage,
)

__all__ = [
    "Engine",
    "GenerationEvent",
    "GenerationRequest",
    "ModelInfo",
    "ModelLoadError",
    "RequestError",
    "ResponseFormat",
    "RooflineError",
    "SamplingParams",
    "Stats",
    "TokenLogprob",
    "Usage",
]


def __getattr__(name: str):  # Engine pulls in MLX: import it only when asked for
    if name == "Engine":
        from mlx_engine.engine import Engine

        return Engine
    raise AttributeError(name)
