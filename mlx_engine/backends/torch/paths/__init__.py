"""How a forward runs on the torch backend, chosen in one table: each row a condition, an implementation and its
slow twin (as `mlx_engine.attention` chooses attention).

Which rows can serve is settled once, at load, from the load options (`TorchRunner.load`): the native step
(`paths.native_step`: a forward's layers in one call of Roofline's CPU kernel, `native_step=True` and a model whose
layers it can run) and the compiled halves (`paths.compiled`: torch.compile graphs, `compile`). Each forward then
takes the first row whose condition holds for its `Case` (its rows, whether its views hand out paged rows). The
eager model (`Model.__call__`, `Model.layer_outputs`, `Model.logits`: torch ops layer by layer) is every phase's
last row and every row's twin. tests/test_torch_paths.py checks that each row's example picks it and that the table
picks what the model picked before it; the native rows meet their twin in tests/test_torch_paths_native_step.py, the
compiled ones in tests/test_torch_cpu_packed.py.

Phases, with their implementations' signatures (`paths` the model's `Paths`, which holds what the load made):
- "forward": (paths, ids (B, L), caches, num_layers) -> final hidden states (B, L, hidden), normed;
- "outputs": the same, as the embedding output then each layer's output, lazily (`hidden_states`);
- "logits": (paths, h (..., hidden)) -> logits (..., vocab).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from mlx_engine.backends.torch.model import GRAPH_ROWS, FreshAttention, Model, PagedRowsView
from mlx_engine.backends.torch.paths import native_step


@dataclass(frozen=True)
class Case:
    """What picks a path: the phase, the forward's rows, its views, and what the load made."""

    phase: str  # "forward", "outputs" or "logits"
    rows: int = 1  # B * L (logits: the rows of h)
    batch: int = 1  # B
    paged: bool = False  # every layer's view hands out `PagedRows` for this batch (`PagedRowsView`)
    native: bool = False  # the native step was laid out at load
    compiled_rows: int = 0  # the compiled halves' max_rows (0: nothing compiled)
    packed_head: bool = False  # the head has a matmul of its own (`Model.head_matmul`)


@dataclass(frozen=True)
class Path:
    name: str
    phase: str
    when: Callable[[Case], bool]
    run: Callable[..., Any]
    twin: Callable[..., Any]
    example: Case  # a case this row serves: the table's test builds it


def _eager(paths: Paths, ids: torch.Tensor, caches: list[Any] | None, num_layers: int) -> torch.Tensor:
    return paths.model(ids, caches, num_layers)


def _eager_outputs(paths: Paths, ids: torch.Tensor, caches: list[Any] | None, num_layers: int) -> Iterator[torch.Tensor]:
    return paths.model.layer_outputs(ids, caches, num_layers)


def _native(paths: Paths, ids: torch.Tensor, caches: list[Any], num_layers: int) -> torch.Tensor:
    return paths.model.norm(native_step.forward(paths.native, paths.model, ids, caches, num_layers))


def _compiled_prefill_outputs(paths: Paths, ids: torch.Tensor, caches: list[Any] | None,
                              num_layers: int) -> Iterator[torch.Tensor]:
    from mlx_engine.backends.torch.paths.compiled import prefill_layers

    caches = caches if caches is not None else [FreshAttention()] * num_layers
    return prefill_layers(paths.compiled, paths.model, ids, caches, num_layers)


def _compiled_decode_outputs(paths: Paths, ids: torch.Tensor, caches: list[Any],
                             num_layers: int) -> Iterator[torch.Tensor]:
    from mlx_engine.backends.torch.paths.compiled import decode_layers

    return decode_layers(paths.compiled, paths.model, ids, caches, num_layers)


def _last(outputs: Callable[..., Iterator[torch.Tensor]]) -> Callable[..., torch.Tensor]:
    """A "forward" row from an "outputs" one: its last layer's output, normed."""

    def run(paths: Paths, ids: torch.Tensor, caches: list[Any] | None, num_layers: int) -> torch.Tensor:
        for h in outputs(paths, ids, caches, num_layers):
            pass
        return paths.model.norm(h)

    return run


def _head(paths: Paths, h: torch.Tensor) -> torch.Tensor:
    return paths.model.logits(h)


def _compiled_head(paths: Paths, h: torch.Tensor) -> torch.Tensor:
    from mlx_engine.backends.torch.paths.compiled import head_logits

    return head_logits(paths.compiled, paths.model, h)


def _prefill_rows(c: Case) -> bool:  # one sequence's rows past the graphs' decode shapes
    return bool(c.compiled_rows) and c.rows > c.compiled_rows and c.batch == 1


def _decode_rows(c: Case) -> bool:
    return bool(c.compiled_rows) and c.rows <= c.compiled_rows and c.paged


TABLE: tuple[Path, ...] = (
    # a CPU model whose layers Roofline's kernel runs: decode steps, verifications, and prefills where nothing is
    # compiled (where prefills are compiled, they run as the graphs: the native step takes the decode-sized rows)
    Path("native-step", "forward", lambda c: c.native and c.paged and not (c.compiled_rows and c.rows > GRAPH_ROWS),
         _native, _eager, Case("forward", native=True, paged=True)),
    Path("compiled-prefill", "forward", _prefill_rows, _last(_compiled_prefill_outputs), _eager,
         Case("forward", rows=GRAPH_ROWS + 1, compiled_rows=GRAPH_ROWS)),
    Path("compiled-decode", "forward", _decode_rows, _last(_compiled_decode_outputs), _eager,
         Case("forward", rows=3, batch=3, paged=True, compiled_rows=GRAPH_ROWS)),
    Path("eager", "forward", lambda c: True, _eager, _eager, Case("forward")),
    Path("compiled-prefill-outputs", "outputs", _prefill_rows, _compiled_prefill_outputs, _eager_outputs,
         Case("outputs", rows=GRAPH_ROWS + 1, compiled_rows=GRAPH_ROWS)),
    Path("compiled-decode-outputs", "outputs", _decode_rows, _compiled_decode_outputs, _eager_outputs,
         Case("outputs", rows=1, paged=True, compiled_rows=GRAPH_ROWS)),
    Path("eager-outputs", "outputs", lambda c: True, _eager_outputs, _eager_outputs, Case("outputs")),
    # the packed head's ~15 small ops (the top logits recomputed exactly) fused into a graph
    Path("compiled-head", "logits", lambda c: c.packed_head and bool(c.compiled_rows) and c.rows <= c.compiled_rows,
         _compiled_head, _head, Case("logits", packed_head=True, compiled_rows=GRAPH_ROWS)),
    Path("head", "logits", lambda c: True, _head, _head, Case("logits")),
)


@functools.lru_cache(maxsize=4096)
def choose(case: Case) -> Path:
    """The first row of `TABLE` for the case's phase whose condition holds."""
    for path in TABLE:
        if path.phase == case.phase and path.when(case):
            return path
    raise LookupError(f"no torch execution path for {case}")  # every phase ends with a row that always holds


class Paths:
    """The ways one loaded model's forwards can run: the native step and the compiled halves where the load made
    them (`use_native_step`, `compile`), and the table's row for each forward. Callable as the model is."""

    def __init__(self, model: Model):
        self.model = model
        self.native: native_step.NativeStep | None = None  # a forward's layers as one C++ call
        self.compiled: Any = None  # paths.compiled.CompiledHalves: the blocks' halves as torch.compile graphs
        self.on_path: Callable[[str], None] | None = None  # told each forward's row name (the runner's record)

    def use_native_step(self) -> str:
        """Forwards through `native_step.NativeStep` from now on, where every layer can run there: '' where they
        do, else why not."""
        step = native_step.NativeStep.layout(self.model)
        self.native = step if isinstance(step, native_step.NativeStep) else None
        return "" if self.native is not None else step

    def compile(self, max_rows: int) -> None:
        """Forwards of at most `max_rows` rows (decode steps, batched or not, short speculative verifications)
        run each block's halves around its attention as torch.compile graphs, and a prefill's more rows as the same
        halves around each view's attention; the graphs are compiled as they are first called."""
        from mlx_engine.backends.torch.paths.compiled import CompiledHalves

        self.compiled = CompiledHalves(max_rows)

    def case(self, phase: str, ids: torch.Tensor, caches: list[Any] | None, num_layers: int) -> Case:
        B, L = ids.shape
        fast = self.native is not None or self.compiled is not None  # the views are asked only where it matters
        paged = fast and caches is not None and all(
            isinstance(c, PagedRowsView) and c.has_paged_rows(B) for c in caches[:num_layers])
        return Case(phase, B * L, B, paged, self.native is not None,
                    self.compiled.max_rows if self.compiled is not None else 0)

    def __call__(self, ids: torch.Tensor, caches: list[Any] | None = None,
                 num_layers: int | None = None) -> torch.Tensor:
        """ids (B, L) -> final hidden states (B, L, hidden), after the first `num_layers` layers (all: None)."""
        n = len(self.model.layers) if num_layers is None else num_layers
        path = choose(self.case("forward", ids, caches, n))
        if self.on_path is not None:
            self.on_path(path.name)
        return path.run(self, ids, caches, n)

    def layer_outputs(self, ids: torch.Tensor, caches: list[Any] | None = None,
                      num_layers: int | None = None) -> Iterator[torch.Tensor]:
        """ids (B, L) -> the embedding output, then each layer's output (B, L, hidden), lazily."""
        n = len(self.model.layers) if num_layers is None else num_layers
        return choose(self.case("outputs", ids, caches, n)).run(self, ids, caches, n)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """h (..., hidden) -> logits (..., vocab)."""
        rows = h.numel() // h.shape[-1]
        case = Case("logits", rows, packed_head=self.model.head_matmul is not None,
                    compiled_rows=self.compiled.max_rows if self.compiled is not None else 0)
        return choose(case).run(self, h)
