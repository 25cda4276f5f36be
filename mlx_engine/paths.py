"""Where the engine keeps what it measures or reads once between runs (header summaries, cost curves, compiled
graphs)."""

from __future__ import annotations

from pathlib import Path

from mlx_engine.switches import CACHE_DIR


def cache_dir() -> Path:
    """`ROOFLINE_CACHE_DIR`, else platformdirs' user cache dir."""
    if path := CACHE_DIR.raw():
        return Path(path).expanduser()
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("roofline", appauthor=False))
