"""mlx-lm's model modules, and gguf-py's tables, without their package `__init__`.

The engine uses a few of mlx-lm's light modules (`models.base`, `models.rope_utils`, `models.cache`), which need
only mlx. But importing any of them first runs `mlx_lm/__init__.py`, which imports its converter and through it
transformers, and torch wherever torch is installed: 4.2 s on the 2-core build machine, against 0.02 s for the
modules themselves, paid at every engine load (every `roofline` start, every server start). gguf-py's
`__init__` imports its writer, its vocabulary tools (sentencepiece) and its metadata reader (yaml) beside the
`constants` and `tensor_mapping` a GGUF load reads: 0.13 s and 2.2 MB of RSS against 0.03 s and 0.4 MB.

`bare_package()` registers such a package as its real package (its real path, so submodules import as usual)
without running the `__init__`. The first use of a name that only the `__init__` defines (`mlx_lm.load`,
`mlx_lm.__version__`, `from gguf import GGUFWriter`) runs it then, in the same module: code that wants all of
the package gets all of it.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
from typing import Any

_lock = threading.RLock()


def bare_package(package: str = "mlx_lm") -> None:
    """Registers `package` (mlx_lm, gguf) unexecuted, if nothing imported it yet (else leaves it as it is)."""
    with _lock:
        if package in sys.modules:
            return
        spec = importlib.util.find_spec(package)
        if spec is None or spec.loader is None or spec.submodule_search_locations is None:
            return  # not installed as a package: whoever imports it gets the usual error
        module = importlib.util.module_from_spec(spec)
        if package == "mlx_lm":
            os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] = "1"  # the one side effect of its __init__'s, kept
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
                raise AttributeError(f"module {package!r} has no attribute {name!r}") from None

        module.__dict__["__getattr__"] = __getattr__
        sys.modules[package] = module
