"""The real outside world of the app: mlx_engine's Engine, catalog and tokenizers, and the chip table.
Every import of the engine is deferred to the call (these run in workers), so importing the app loads no MLX."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mlx_engine.api import GenerationRequest, SamplingParams

from app.tui.chips import Bandwidth, machine_bandwidth


class EngineBackend:
    def __init__(self, **load_options: Any) -> None:
        self.load_options = load_options  # Engine.load's options for every model (the KV cache's, from the CLI)

    def load(self, ref: str | None) -> Any:
        from mlx_engine import Engine

        return Engine.load(ref, **self.load_options)

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

    # ---- a chat's KV on disk (called from workers) ----------------------------------------------------

    def kv_persistence(self, engine: Any) -> bool:
        """Whether `engine` can save and restore a chat's KV (its cache declares KV files: `ModelInfo.kv_files`)."""
        return engine.info.kv_files

    def save_kv(self, engine: Any, path: Path, messages: list[dict[str, str]]) -> int:
        """Saves the cached KV of the conversation `messages` (ending with a reply, so no generation prompt);
        tokens saved. RooflineError when nothing is cached yet (a chat shorter than one block)."""
        request = GenerationRequest(messages=messages, sampling=SamplingParams(max_tokens=1),
                                    add_generation_prompt=False)
        return engine.save_kv(str(path), request)

    def restore_kv(self, engine: Any, path: Path) -> int:
        """Loads a file written by `save_kv` into the engine's prefix cache; tokens restored. RooflineError
        when the file is refused (another model or KV layout, corrupt)."""
        return engine.restore_kv(str(path))
