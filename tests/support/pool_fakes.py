"""Scripted model pools for the multi-model server's tests: fake engines loaded and closed by name, in order
(tests/test_server_models.py, tests/test_server_ollama.py)."""

from __future__ import annotations

import time
from typing import Any

from mlx_engine.catalog import ModelSummary

from app.server.model_table import ModelTable, Preset
from app.server.models_pool import ModelPool
from tests.support.server_fakes import FakeEngine

REFS = ("org/a", "org/b", "org/c", "ollama:tiny:latest", "org/big")


def summary(ref: str) -> ModelSummary:
    return ModelSummary(ref, ref, "ollama" if ref.startswith("ollama:") else "hf-cache", 1000, 10, "Q4_0", 64,
                        "llama", path=f"/models/{ref}")


class Loads:
    """A loader of fake engines that records what it loaded and what it closed, in order."""

    def __init__(self, delay_s: float = 0.0):
        self.delay_s = delay_s
        self.loaded: list[str] = []
        self.closed: list[str] = []
        self.engines: dict[str, FakeEngine] = {}
        self.options: list[dict[str, Any]] = []

    def load(self, p: Preset) -> FakeEngine:
        time.sleep(self.delay_s)
        self.loaded.append(p.ref)
        self.options.append(p.load)
        self.engines[p.ref] = FakeEngine(name=p.ref)
        return self.engines[p.ref]

    def close(self, engine: FakeEngine) -> None:
        engine.close()
        self.closed.append(engine.info.name)


def make_pool(loads: Loads, presets: dict[str, Preset] | None = None, default: str | None = None,
              **kw: Any) -> ModelPool:
    table = ModelTable(lambda: [summary(r) for r in REFS], presets, default)
    return ModelPool(table, loads.load, close=loads.close, log=lambda line: None, **kw)
