"""Torch is an optional extra: its tests skip where torch is not installed (a fresh clone's `uv run pytest`), with a
reason `conftest.py` recognises, so that .ci/run can list them and run just those again once it has installed a CPU
build. There it sets ROOFLINE_REQUIRE_TORCH=1, and a missing torch fails instead of skipping."""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest

# the start of every skip reason `require` gives: conftest.py records the tests skipped with it
SKIP_REASON = "needs the optional torch extra"


def available(module: str = "torch") -> bool:
    """Whether `module` imports here (always True where CI requires torch: a missing one then fails)."""
    if os.environ.get("ROOFLINE_REQUIRE_TORCH") == "1":
        return True
    return importlib.util.find_spec(module) is not None


def require(module: str = "torch") -> ModuleType:
    """Import `module` (torch or triton) or skip the test module, unless CI requires it."""
    if os.environ.get("ROOFLINE_REQUIRE_TORCH") == "1":
        return importlib.import_module(module)
    return pytest.importorskip(module, reason=f"{SKIP_REASON} ({module} is not installed: `uv sync --extra torch`)")
