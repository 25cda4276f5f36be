"""mlx-lm's model modules without its package `__init__`.

The engine uses a few of mlx-lm's light modules (`models.base`, `models.rope_utils`, `models.cache`), which need
only mlx. But importing any of them first runs `mlx_lm/__init__.py`, which imports its converter and through it
transformers, and torch wherever torch is installed: 4.2 s on the 2-core build machine, against 0.02 s for the
modules themselves, paid at every engine load (every `roofline` start, every server start).

`bare_package()` registers `mlx_lm` as its real package (its real path, so submodules import as usual) without
running the `__init__`. The first use of a name that only the `__init__` defines (`mlx_lm.load`,
`mlx_lm.__version__`, `from mlx_lm import generate`) runs it then, in the same module: code that wants all of
mlx-lm gets all of it.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
from typing import Any

_lock = threading.RLock()


def bare_package() -> None:
    """Registers `mlx_lm` unexecuted, if nothing imported it yet (else leaves it as it is)."""
    with _lock:
        if "mlx_lm" in sys.modules:
            return
        spec = importlib.util.find_spec("mlx_lm")
        if spec is None or spec.loader is None or spec.submodule_search_locations is None:
            return  # not installed as a package: whoever imports it gets the usual error
        module = importlib.util.module_from_spec(spec)
        os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] = "1"  # the one side effect of the __init__'s, kept
        ran = False

        def __getattr__(name: str) -> Any:  # a name the real __init__ defines: run it, once
            nonlocal ran
            with _lock:
                if not ran:
                    ran = True
                    del module.__dict__["__getattr__"]
                    spec.loader.exec_module(module)
            try:
                return module.__dict__[name]
            except KeyError:
                raise AttributeError(f"module 'mlx_lm' has no attribute {name!r}") from None

        module.__dict__["__getattr__"] = __getattr__
        sys.modules["mlx_lm"] = module
