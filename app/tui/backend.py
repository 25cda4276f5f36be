"""The real outside world of the app: mlx_engine's Engine, catalog and tokenizers, and the chip table.
Every import of the engine is deferred to the call (these run in workers), so importing the app loads no MLX."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from app.tui.chips import Bandwidth, machine_bandwidth


class EngineBackend:
    def load(self, ref: str | None) -> Any:
        from mlx_engine import Engine

        return Engine.load(ref)

    def list_models(self) -> list[Any]:
        from mlx_engine.catalog import list_local_models

        return list_local_models()

    def describe(self, ref: str) -> Any:
        from mlx_engine.catalog import describe_model

        return describe_model(ref)

    def load_tokenizer(self, ref: str | None) -> Any:
        from mlx_engine.loading import load_tokenizer

        return load_tokenizer(ref)

    def bandwidth(self, home: Path) -> Bandwidth:
        return machine_bandwidth(home)
