"""The dependency direction of DESIGN.md, checked by importing in a fresh interpreter."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest


def imported_after(code: str) -> set[str]:
    probe = f"{code}\nimport sys\nprint(' '.join(sorted({{m.split('.')[0] for m in sys.modules}})))"
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return set(r.stdout.split())


def test_front_ends_import_no_mlx_or_torch() -> None:
    mods = imported_after("import app.cli, mlx_engine, mlx_engine.api")
    assert not {"mlx", "mlx_lm", "torch", "kernels_metal"} & mods


@pytest.mark.parametrize("module", ["mlx_engine.engine", "mlx_engine.backends.mlx.runner", "mlx_engine.loading",
                                    "mlx_engine.tokenizer", "mlx_engine.sampling", "mlx_engine.scheduler",
                                    "mlx_engine.speculative", "mlx_engine.backends"])
def test_engine_never_imports_textual_or_app(module: str) -> None:
    mods = imported_after(f"import {module}")
    assert not {"textual", "app", "torch"} & mods


def test_kernels_never_import_the_engine() -> None:
    mods = imported_after("import kernels_metal")
    assert "mlx_engine" not in mods and "app" not in mods


def test_only_the_torch_backend_imports_torch() -> None:
    """torch (and triton) is an optional extra: only mlx_engine/backends/torch/ may import it."""
    root = Path(__file__).resolve().parent.parent
    allowed = root / "mlx_engine" / "backends" / "torch"
    pattern = re.compile(r"^\s*(import|from)\s+(torch|triton)\b", re.MULTILINE)
    offenders = [str(f.relative_to(root)) for folder in ("mlx_engine", "app", "kernels_metal")
                 for f in sorted((root / folder).rglob("*.py"))
                 if allowed not in f.parents and pattern.search(f.read_text())]
    assert not offenders, offenders


def test_loading_a_model_skips_mlx_lms_init_but_keeps_it_whole() -> None:
    """`Engine.load` imports mlx-lm's light model modules without mlx-lm's package __init__, which imports
    transformers (and torch where installed): 4 s at every start. The first use of a name only that __init__
    defines runs it, so code that wants all of mlx-lm still gets it."""
    golden = Path(__file__).resolve().parent / "data" / "golden" / "llama"
    code = (f"from mlx_engine import Engine\nimport sys\nEngine.load({str(golden)!r}).close()\n"
            "heavy = {'transformers', 'torch'} & set(sys.modules)\nassert not heavy, sorted(heavy)\n"
            "import mlx_lm\nfrom mlx_lm import load, stream_generate\n"
            "assert mlx_lm.__version__ and callable(load) and 'transformers' in sys.modules\n"
            "from mlx_lm.models.cache import KVCache\nassert KVCache().offset == 0")
    mods = imported_after(code)
    assert "mlx_lm" in mods
