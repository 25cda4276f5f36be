"""The torch CPU decode step as torch.compile graphs: `model.attention_inputs`, `between_attentions` and
`model.attention_outputs` compiled by inductor, one call between two attentions (`Model.compile_decode`)."""

from __future__ import annotations

import os
from typing import Any

import torch

from mlx_engine.backends.torch.model import TransformerBlock, attention_inputs, attention_outputs


def between_attentions(block: TransformerBlock, following: TransformerBlock, x: torch.Tensor, out: torch.Tensor,
                       cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A block's output half and the next block's input half: one graph call instead of two."""
    h = attention_outputs(block, x, out)
    return (h, *attention_inputs(following, h, cos, sin))


def compile_errors() -> tuple[type[BaseException], ...]:
    """What a failed torch.compile raises: inductor's C++ build (no compiler, a failed build) and dynamo's
    backend errors."""
    from torch._dynamo.exc import BackendCompilerFailed, TorchRuntimeError

    return (BackendCompilerFailed, TorchRuntimeError, OSError, RuntimeError)


def use_app_cache() -> None:
    """Inductor's caches (its FX graph and AOT autograd caches, on by default, and the C++ it builds) under the
    app's cache dir rather than /tmp, where a reboot would empty them: a later load then skips inductor's
    code generation and C++ builds (dynamo still traces). TORCHINDUCTOR_CACHE_DIR set by the user wins."""
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        from mlx_engine.paths import cache_dir

        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir() / "torchinductor")


class CompiledHalves:
    """`attention_inputs`, `between_attentions` and `attention_outputs` compiled by inductor: the norms, rope,
    residuals and SiLU as fused C++ loops around the matmul kernels, in place of ~70 eager ops a layer, one call
    between two attentions. One graph serves every layer (the blocks are arguments), so each call's guards
    would check those blocks' tensors again: once `warm`,
    calls skip guards (`skip_guard_eval_unsafe`), which is sound because each compiled function holds one graph:
    one row (a decode step of one sequence), or any 2..max_rows rows (`dynamic`: batched steps, verifications),
    as copies of the functions with code objects of their own (dynamo keeps its graphs per code object). A
    call that would need another graph raises before it runs and runs again with its guards, compiling it."""

    def __init__(self, max_rows: int):
        use_app_cache()
        self.max_rows, self.warm, self.recompiles = max_rows, False, 0
        self.fns = {rows: tuple(torch.compile(_own_code(fn, rows), fullgraph=True)
                                for fn in (attention_inputs, between_attentions, attention_outputs))
                    for rows in (1, 2)}

    def run(self, part: int, rows: int, *args: Any) -> Any:
        """Part 0 (attention_inputs), 1 (between_attentions) or 2 (attention_outputs) of a forward of `rows`
        rows on `args`, inside `stance()`."""
        fn = self.fns[min(rows, 2)][part]
        if not self.warm:
            if rows > 1:  # the rows' dim dynamic from the first compile; the weights' shapes stay static
                for t in args:
                    if isinstance(t, torch.Tensor):
                        torch._dynamo.mark_dynamic(t, t.dim() - 2)
            return fn(*args)
        try:
            return fn(*args)
        except RuntimeError as e:
            if "skip_guard_eval_unsafe" not in str(e):
                raise
        self.recompiles += 1
        with torch.compiler.set_stance("default"):
            return fn(*args)

    def stance(self) -> Any:
        """Around a forward's calls: guards skipped once warm (entered once a forward, not per call)."""
        import contextlib

        return torch.compiler.set_stance(skip_guard_eval_unsafe=True) if self.warm else contextlib.nullcontext()


def _own_code(fn: Any, rows: int) -> Any:
    import types

    code = fn.__code__.replace(co_name=f"{fn.__name__}_{rows}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)
