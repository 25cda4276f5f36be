"""torch.compile's helpers shared by the weight formats' dequantizing prefill (`cpu_gemm`) and the compiled execution
path (`paths.compiled`): what a failed compile raises, where inductor caches, and a function's own code object.
Importing this module imports no compiler (torch._dynamo is imported where a compile starts)."""

from __future__ import annotations

import types
from typing import Any


def compile_errors() -> tuple[type[BaseException], ...]:
    """What a failed torch.compile raises: inductor's C++ build (no compiler, a failed build) and dynamo's
    backend errors."""
    from torch._dynamo.exc import BackendCompilerFailed, TorchRuntimeError

    return (BackendCompilerFailed, TorchRuntimeError, OSError, RuntimeError)


def use_app_cache() -> None:
    """Inductor's caches (its FX graph and AOT autograd caches, on by default, and the C++ it builds) under the
    app's cache dir rather than /tmp, where a reboot would empty them: a later load then skips inductor's
    code generation and C++ builds (dynamo still traces). TORCHINDUCTOR_CACHE_DIR set by the user wins."""
    from mlx_engine.backends.torch import switches
    from mlx_engine.paths import cache_dir

    switches.inductor_cache_dir(str(cache_dir() / "torchinductor"))


def own_code(fn: Any, rows: Any) -> Any:
    """A copy of `fn` with a code object of its own (named after `rows`), so that dynamo keeps its graphs apart."""
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{rows}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)
