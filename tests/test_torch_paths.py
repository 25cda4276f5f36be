"""The torch backend's execution paths in one table (`backends/torch/paths`): each row's example picks that row, every
phase ends with a row that always holds, the table picks what the model picked before the paths left it, and a model
with nothing compiled or native runs its eager layers through the paths bit for bit. The rows against their twins on
real models: tests/test_torch_paths_native_step.py (the native step against the Python layers) and
tests/test_torch_cpu_packed.py (the compiled graphs against eager)."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

from tests.support.torch_support import require

torch = require("torch")

from mlx_engine.backends.torch import paths  # noqa: E402
from mlx_engine.backends.torch.model import GRAPH_ROWS  # noqa: E402
from mlx_engine.backends.torch.paths import TABLE, Case, choose  # noqa: E402

GOLDEN = Path(__file__).parent / "data" / "golden"


@pytest.mark.parametrize("path", TABLE, ids=[p.name for p in TABLE])
def test_each_rows_example_picks_it(path):
    assert path.example.phase == path.phase and choose(path.example) is path
    assert callable(path.run) and callable(path.twin)


def test_every_phase_ends_with_a_row_that_always_holds():
    for phase in {p.phase for p in TABLE}:
        last = [p for p in TABLE if p.phase == phase][-1]
        assert last.when(Case(phase)) and last.run is last.twin, phase


def before(c: Case) -> str:
    """The choice `Model.__call__`, `layer_outputs` and `logits` made themselves before the table (the code as it
    was, its branches written out)."""
    if c.phase == "logits":
        return "compiled-head" if c.packed_head and c.compiled_rows and c.rows <= c.compiled_rows else "head"
    if c.phase == "forward" and c.native and not (c.compiled_rows and c.rows > GRAPH_ROWS) and c.paged:
        return "native-step"
    suffix = "" if c.phase == "forward" else "-outputs"
    if c.compiled_rows and c.rows > c.compiled_rows:
        return ("compiled-prefill" if c.batch == 1 else "eager") + suffix
    if c.compiled_rows and c.paged:
        return "compiled-decode" + suffix
    return "eager" + suffix


def test_the_table_picks_what_the_model_did():
    grid = itertools.product(("forward", "outputs", "logits"), (1, 3, GRAPH_ROWS, GRAPH_ROWS + 1, 256), (1, 3),
                             (False, True), (False, True), (0, GRAPH_ROWS), (False, True))
    for phase, rows, batch, paged, native, compiled_rows, packed_head in grid:
        c = Case(phase, rows, batch, paged, native, compiled_rows, packed_head)
        assert choose(c).name == before(c), c


def test_nothing_made_at_load_is_the_eager_model():
    """Without the native step or compiled graphs every forward is the model's own eager layers, bit for bit."""
    from mlx_engine import Engine

    with Engine.load(str(GOLDEN / "llama"), backend="torch", device="cpu") as engine:
        runner = engine.diagnostics().runner
        p = runner.paths
        assert isinstance(p, paths.Paths) and p.native is None and p.compiled is None
        ids = torch.tensor([[3, 17, 42, 99, 7]])
        with torch.inference_mode():
            h = p(ids)
            assert torch.equal(h, runner.model(ids))
            assert torch.equal(p.logits(h), runner.model.logits(h))
            outs = list(p.layer_outputs(ids))
            assert len(outs) == len(runner.model.layers) + 1
            assert all(torch.equal(a, b) for a, b in zip(outs, runner.model.layer_outputs(ids)))
        np.testing.assert_array_equal(engine.forward_logits([3, 17, 42]),
                                      runner.model.logits(runner.model(torch.tensor([[3, 17, 42]])))[0].numpy())
