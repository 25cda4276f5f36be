"""Torch is an optional extra: its tests skip where torch is not installed, except in CI, whose .ci/run
installs a CPU build and sets ROOFLINE_REQUIRE_TORCH=1 so that a missing torch fails instead of skipping."""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest


def require(module: str = "torch") -> ModuleType:
    """Import `module` (torch or triton) or skip the test module, unless CI requires it."""
    if os.environ.get("ROOFLINE_REQUIRE_TORCH") == "1":
        return importlib.import_module(module)
    return pytest.importorskip(module)
