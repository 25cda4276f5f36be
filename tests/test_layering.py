"""The dependency direction of DESIGN.md, checked by importing in a fresh interpreter."""

from __future__ import annotations

import subprocess
import sys

import pytest


def imported_after(code: str) -> set[str]:
    probe = f"{code}\nimport sys\nprint(' '.join(sorted({{m.split('.')[0] for m in sys.modules}})))"
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return set(r.stdout.split())


def test_front_ends_import_no_mlx_or_torch() -> None:
    mods = imported_after("import app.cli, mlx_engine, mlx_engine.api")
    assert not {"mlx", "mlx_lm", "torch", "kernels_metal"} & mods


@pytest.mark.parametrize("module", ["mlx_engine.engine", "mlx_engine.runner", "mlx_engine.loading",
                                    "mlx_engine.tokenizer", "mlx_engine.sampling"])
def test_engine_never_imports_textual_or_app(module: str) -> None:
    mods = imported_after(f"import {module}")
    assert not {"textual", "app", "torch"} & mods


def test_kernels_never_import_the_engine() -> None:
    mods = imported_after("import kernels_metal")
    assert "mlx_engine" not in mods and "app" not in mods
