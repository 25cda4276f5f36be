"""The torch CPU decode step as torch.compile graphs: `model.attention_inputs`, `between_attentions` and
`attend_and_output` compiled by inductor, the attention (`model.paged_attention`) inside them, one call a layer
(`decode_layers`), and the packed head's `cpu_packed.head_matmul` (`head_logits`); and a prefill's rows as the same
halves around each cache view's eager attention (`outputs_then_inputs`, `prefill_layers`), their matmuls'
dequantization to bfloat16 fused into the graphs. Rows of `paths.TABLE`; their twin is the eager model."""

from __future__ import annotations

import contextlib
import types
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from mlx_engine.backends.torch import cpu_features
from mlx_engine.backends.torch.cpu_packed import head_matmul
from mlx_engine.backends.torch.inductor import own_code, use_app_cache
from mlx_engine.backends.torch.model import (Model, PagedRows, TransformerBlock, attention_inputs,
                                             attention_outputs, paged_attention, row_major)

# where compiling starts, not at every import of the backend (cpu_features.bf16_gemm says why)
torch.compiler.assume_constant_result(cpu_features.bf16_gemm)

PREFILL = 3  # CompiledHalves' kind of a forward of more than max_rows rows
# inductor's note on a loop that reads float16 scales and writes bfloat16 weights (the dequantizing prefill's):
# nothing a user can act on
warnings.filterwarnings("ignore", message="bf16 and fp16 are mixed in the scheduler node")


def attend_and_output(block: TransformerBlock, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      rows: PagedRows) -> torch.Tensor:
    """A block's attention (K/V written to its cache) and its output half."""
    return attention_outputs(block, x, paged_attention(q, k, v, rows, block.self_attn.scale))


def between_attentions(block: TransformerBlock, following: TransformerBlock, x: torch.Tensor, q: torch.Tensor,
                       k: torch.Tensor, v: torch.Tensor, rows: PagedRows, cos: torch.Tensor,
                       sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A block's attention and output half, and the next block's input half: one graph call a layer."""
    h = attend_and_output(block, x, q, k, v, rows)
    return (h, *attention_inputs(following, h, cos, sin))


def outputs_then_inputs(block: TransformerBlock, following: TransformerBlock, x: torch.Tensor, out: torch.Tensor,
                        cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A block's output half after its attention (run eagerly by the cache view: a prefill's rows), and the next
    block's input half."""
    h = attention_outputs(block, x, out)
    return (h, *attention_inputs(following, h, cos, sin))


class CompiledHalves:
    """`attention_inputs`, `between_attentions` and `attend_and_output` compiled by inductor: the norms, rope,
    residuals, SiLU and the attention as fused C++ loops around the matmul kernels, in place of ~80 eager ops a
    layer, one call a layer. One graph serves every layer of a format (the blocks are arguments: their weights'
    kinds, dtypes and shapes, `layout`), so each call's guards would check those blocks' tensors again. Each
    compiled function holds one graph: one row (a decode step of one sequence), or any 2..max_rows rows
    (`dynamic`: batched steps, verifications), the attended length and the pools' slots dynamic in both, for
    one format of the blocks it is given (a file whose layers mix quantizations, as Q4_K_M's do, has a few),
    as copies of the functions with code objects of their own (`own_code`); and a prefill's more rows
    (`PREFILL`, any number), whose attention (SDPA over the cache view) runs between its graphs (1.25-1.8x a
    prefill's tokens a second across two runs of the bench: docs/benchmarks/torch-cpu.md,
    "prefills through compiled halves").
    So once `warmed` (every layer called at the load's warm-up, each through its guards), a call goes straight
    to the function dynamo made of its one graph (`direct_call`: no frame hook, no guards; 6-18% of a decode
    step in five A/B runs, docs/benchmarks/torch-cpu.md "the decode graphs called directly"). A function that
    came out of the warm-up with more than one graph keeps dynamo's call with guards skipped
    (`skip_guard_eval_unsafe`, which still checks tensors' shapes): a call that would need another graph then
    raises before it runs and runs again with its guards, compiling it."""

    def __init__(self, max_rows: int):
        use_app_cache()
        self.max_rows, self.warm, self.recompiles = max_rows, False, 0
        self.parts = {rows: (attention_inputs, between_attentions, attend_and_output, head_matmul) for rows in (1, 2)}
        self.parts[PREFILL] = (attention_inputs, outputs_then_inputs, attention_outputs)
        # (kind, part, the formats of its blocks) -> the part's own copy, and that compiled
        self.code: dict[tuple[int, int, tuple[int, ...]], Any] = {}
        self.fns: dict[tuple[int, int, tuple[int, ...]], Any] = {}
        self.direct: dict[tuple[int, int, tuple[int, ...]], Any] = {}  # -> direct_call's function, once warm
        self._formats: dict[int, int] = {}  # id(block) -> its format's number
        self._layouts: dict[Any, int] = {}  # a block's `layout` -> its number

    def warmed(self) -> None:
        """After the warm-up: guards skipped, and each function of one graph called directly from now on."""
        self.warm = True
        self.direct = {key: f for key, fn in self.code.items() if (f := direct_call(fn)) is not None}

    def _key(self, part: int, rows: int, args: tuple[Any, ...]) -> tuple[int, int, tuple[int, ...]]:
        formats = []
        for a in args:
            if isinstance(a, TransformerBlock):
                n = self._formats.get(id(a))
                if n is None:  # once a block: the model holds its blocks as long as it holds this
                    n = self._formats[id(a)] = self._layouts.setdefault(layout(a), len(self._layouts))
                formats.append(n)
        return self.kind(rows), part, tuple(formats)

    def _compiled(self, key: tuple[int, int, tuple[int, ...]]) -> Any:
        fn = self.fns.get(key)
        if fn is None:
            kind, part, formats = key
            name = f"{'prefill' if kind == PREFILL else kind}{''.join(f'_{f}' for f in formats)}"
            self.code[key] = own_code(self.parts[kind][part], name)
            fn = self.fns[key] = torch.compile(self.code[key], fullgraph=True)
        return fn

    def kind(self, rows: int) -> int:
        """1: one row; 2: 2..max_rows rows; PREFILL: more (whose attention runs between the graphs)."""
        return 1 if rows == 1 else 2 if rows <= self.max_rows else PREFILL

    def run(self, part: int, rows: int, *args: Any) -> Any:
        """Part 0 (attention_inputs), 1 (between_attentions; a prefill's: outputs_then_inputs) or 2
        (attend_and_output; a prefill's: attention_outputs) of a forward of `rows` rows, or 3 (the packed head's
        `head_matmul`) of its logits, on `args`, inside `stance()`."""
        key = self._key(part, rows, args)
        direct = self.direct.get(key)
        if direct is not None:
            return direct(*args)
        if not self.warm or key not in self.fns:  # a format first seen after the warm-up compiles as it would have
            fn = self._compiled(key)
            _mark_dynamic(args, rows > 1)
            with torch.compiler.set_stance("default"), _compile_options():
                return fn(*args)
        fn = self.fns[key]
        try:
            return fn(*args)
        except RuntimeError as e:
            if "skip_guard_eval_unsafe" not in str(e):
                raise
        self.recompiles += 1
        with torch.compiler.set_stance("default"), _compile_options():
            return fn(*args)

    def stance(self) -> Any:
        """Around a forward's calls: guards skipped once warm (entered once a forward, not per call)."""
        return torch.compiler.set_stance(skip_guard_eval_unsafe=True) if self.warm else contextlib.nullcontext()


def layout(obj: Any, depth: int = 0) -> Any:
    """What a graph traced through `obj` depends on: its classes, their attributes' values, and its tensors'
    dtypes and shapes (not their contents), nested; two blocks of one layout trace to the same graph."""
    if isinstance(obj, torch.Tensor):
        return "tensor", obj.dtype, tuple(obj.shape)
    if obj is None or isinstance(obj, (bool, int, float, str, torch.dtype)):
        return obj
    if isinstance(obj, (list, tuple)):
        return type(obj).__name__, tuple(layout(x, depth + 1) for x in obj)
    if isinstance(obj, dict):
        return "dict", tuple((k, layout(v, depth + 1)) for k, v in sorted(obj.items()))
    fields = getattr(obj, "__dict__", None)
    if fields is None or depth > 6:
        return type(obj).__qualname__
    return type(obj).__qualname__, tuple((k, layout(v, depth + 1)) for k, v in sorted(fields.items()))


def direct_call(fn: Any) -> Any:
    """What dynamo runs in place of `fn` when its guards pass, as a plain function: the transformed code of
    `fn`'s one cache entry, which gathers the graph's inputs from the arguments, calls the compiled graph (AOT
    autograd's runtime wrapper around inductor's) and builds the return value. None where `fn` has no graph or
    several (dynamo's guards choose between them), or where this torch has no such entries to read."""
    try:
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list

        entries = _debug_get_cache_entry_list(fn.__code__)
    except (ImportError, AttributeError, TypeError):
        return None
    if len(entries) != 1:
        return None
    code = entries[0].code
    if code.co_argcount != fn.__code__.co_argcount or code.co_freevars != fn.__code__.co_freevars:
        return None
    return types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def _mark_dynamic(args: tuple[Any, ...], many_rows: bool) -> None:
    """The dims that vary between calls of one graph, dynamic from its first compile: the attended length and
    the pools' slots; with many rows also the rows' dim. The weights' shapes stay static."""
    for t in args:
        if isinstance(t, PagedRows):
            for pool in (t.pool_k, t.pool_v):
                torch._dynamo.mark_dynamic(pool, 0)
            for x in (t.gather, t.bias):
                torch._dynamo.mark_dynamic(x, 1)
                if many_rows:
                    torch._dynamo.mark_dynamic(x, 0)
            if many_rows:
                torch._dynamo.mark_dynamic(t.write, 0)
        elif isinstance(t, torch.Tensor) and many_rows:
            torch._dynamo.mark_dynamic(t, t.dim() - 2)


@contextlib.contextmanager
def _compile_options() -> Any:
    """While tracing and compiling: dynamic dims each a symbol of their own (with duck shapes, two that happened
    to be equal at the first compile would share one, and guards, skipped once warm, would be what told them
    apart); and no `assert_size_stride` on every input and kernel output of every call (~20 a layer, 2-6% of a
    decode step: docs/benchmarks/torch-cpu.md, "the decode graphs without inductor's size asserts"), so that once the
    guards are skipped nothing checks an input's strides: the callers hand the graphs row-major tensors
    (`model.row_major`), and the graphs' outputs, fed to the next call, have their graph's strides.
    Inductor's config patches are thread-local: this runs on the thread that compiles (the engine's)."""
    from torch._inductor import config as inductor_config
    from torch.fx.experimental import _config

    with _config.patch(use_duck_shape=False), inductor_config.patch(size_asserts=False):
        yield


def decode_layers(compiled: CompiledHalves, model: Model, ids: torch.Tensor, caches: list[Any],
                  num_layers: int) -> Iterator[torch.Tensor]:
    """A forward of at most `max_rows` rows over paged views, as the graphs: the embedding output, then each layer's
    output (B, L, hidden)."""
    B, L = ids.shape
    cos, sin = model.rope.angles(caches[0].positions(B, L, ids.device))  # (B, 1, L, D/2)
    h = model.embed_tokens(ids)
    yield h
    N = B * L  # the graphs see one row per token, (1, N, hidden): N = 1 and N > 1 are their two shapes
    h, cos, sin = row_major(h, 1, N, h.shape[-1]), row_major(cos, 1, 1, N, cos.shape[-1]), \
        row_major(sin, 1, 1, N, sin.shape[-1])
    layers = model.layers[:num_layers]
    with compiled.stance():
        kv_shape = (model.args.num_key_value_heads, model.args.head_dim)
        rows = [c.paged_rows(N, kv_shape, h.dtype) for c in caches]  # (1, N) rows, batch-major
        q, k, v = compiled.run(0, N, layers[0], h, cos, sin)  # (1, heads, N, hd)
        for i, (layer, r) in enumerate(zip(layers, rows)):
            if i + 1 < len(layers):  # this layer's attention and output half, and the next one's input half
                h, q, k, v = compiled.run(1, N, layer, layers[i + 1], h, q, k, v, r, cos, sin)
            else:
                h = compiled.run(2, N, layer, h, q, k, v, r)
            yield h.view(B, L, -1)


def prefill_layers(compiled: CompiledHalves, model: Model, ids: torch.Tensor, caches: list[Any],
                   num_layers: int) -> Iterator[torch.Tensor]:
    """A prefill's layers (one sequence's rows, more than `max_rows`) as compiled halves (norms, projections with
    their dequantizing GEMMs, rope, MLP) around each cache view's eager attention (its K/V write and SDPA), whose
    output goes in row-major: the embedding output, then each layer's output."""
    B, L = ids.shape
    cos, sin = model.rope.angles(caches[0].positions(B, L, ids.device))  # (B, 1, L, D/2)
    h = model.embed_tokens(ids)
    yield h
    layers = model.layers[:num_layers]
    with compiled.stance():
        h, cos, sin = row_major(h), row_major(cos), row_major(sin)
        N = h.shape[1]
        q, k, v = compiled.run(0, N, layers[0], h, cos, sin)
        for i, (layer, c) in enumerate(zip(layers, caches)):
            out = row_major(c.attention(q, k, v, layer.self_attn.scale))
            if i + 1 < len(layers):
                h, q, k, v = compiled.run(1, N, layer, layers[i + 1], h, out, cos, sin)
            else:
                h = compiled.run(2, N, layer, h, out)
            yield h


def head_logits(compiled: CompiledHalves, model: Model, h: torch.Tensor) -> torch.Tensor:
    """The packed head's `head_matmul` on at most `max_rows` rows as its graph (its ~15 small ops fused)."""
    x = row_major(h.reshape(-1, h.shape[-1]))
    with compiled.stance():
        return compiled.run(3, x.shape[0], model.head(), x).view(*h.shape[:-1], -1)
