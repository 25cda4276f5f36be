"""Every row of the attention table (`mlx_engine.attention.TABLE`) against its slow twin, on the row's own example.

The twins compute with `kernels_metal.reference.paged_decode_attention`, the kernels' MLX-ops reference; a row added
without a twin, or whose example its condition does not pick, fails here. Tolerances (max abs error; outputs are
O(1), V standard normal): float32 1e-4 (float32 math on both sides, other summation orders; measured floor 2e-6),
float16 4e-3 (both round the output to float16: half an ulp at 1-2 is 1e-3, either side of a tie). The scored rows
(soft cap, sinks) run with a cap, with sinks, and with both, and are held to the float32 floor
(tests/support/tolerance.py).
"""

from __future__ import annotations

import dataclasses
import mlx.core as mx
import numpy as np
import pytest

import kernels_metal.reference as kernel_reference
from kernels_metal import _backend
from mlx_engine.attention import TABLE, Case, Path, choose
from mlx_engine.kv.paged import PagedKVStorage
from mlx_engine.kv.views import DecodeStep, PagedPrefillView
from tests.support.tolerance import assert_f32_close

ATOL = {mx.float32: 1e-4, mx.float16: 4e-3}
HQ, HKV, BS = 4, 2, 16
SCALE = 0.25
SOFTCAP = 2.0  # scores of standard normal q and k x 0.25 reach 3-4: the cap bends them
SINKS = mx.array([0.5, -1.0, 2.0, 0.0])  # per query head; 2.0 outweighs most keys


@pytest.fixture
def reference_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the twins' calls of the kernels' reference."""
    calls: list[int] = []
    ref = kernel_reference.paged_decode_attention

    def counted(*args, **kwargs):
        calls.append(1)
        return ref(*args, **kwargs)

    monkeypatch.setattr(kernel_reference, "paged_decode_attention", counted)
    return calls


def storage(case: Case, rng: np.random.Generator, window: int | None = None) -> PagedKVStorage:
    """Eight blocks, every slot written with random K/V (per-channel keys: through a write plan)."""
    st = PagedKVStorage(1, 8, BS, HKV, case.head_dim, case.dtype, bits=case.bits, group_size=32 if case.bits else 64,
                        head_major=case.head_major, key_per_channel=case.key_per_channel, window=window)
    st.ensure_capacity(8)
    slots = list(range(8 * BS))
    plan = st.plan_key_writes([("old", s) for s in slots])
    k, v = (mx.array(rng.normal(size=(8 * BS, HKV, case.head_dim)).astype(np.float32)) for _ in range(2))
    st.write(0, mx.array(slots, dtype=mx.int32), k, v, plan)
    st.release_key_stages("old")
    return st


def run_decode(path: Path, rng: np.random.Generator, window: int | None = None,
               scores: dict | None = None) -> tuple[mx.array, mx.array]:
    """Without a window every key; with one (10) the tables as the cache hands them, from the block of each
    sequence's window on (the blocks before it freed)."""
    case = path.example
    st = storage(case, rng, window)
    if case.single and window is None:  # one sequence in two runs of blocks: 3, 4 then 1
        tables, lens = [[3, 4, 1]], [40]
        all_slots = ([slice(3 * BS, 5 * BS), slice(BS, BS + 8)] if case.runs
                     else mx.array([b * BS + i for b in (3, 4, 1) for i in range(BS)][:40], dtype=mx.int32))
    elif case.single:  # position 39 of a sequence in blocks 3, 4, 1: its window, 30..39, in blocks 4 and 1
        tables, lens = [[4, 1]], [24]
        all_slots = ([slice(4 * BS + 14, 5 * BS), slice(BS, BS + 8)] if case.runs
                     else mx.array([4 * BS + i for i in range(14, BS)] + [BS + i for i in range(8)], dtype=mx.int32))
    else:  # three sequences over scattered blocks, padded tables
        tables, lens, all_slots = [[5, 1, 6], [2, 0, 0], [7, 3, 4]], [40, 9, 33], None
        if window is not None:  # the first sequence's window starts in its second block
            tables[0], lens[0] = [1, 6, 0], 24
    B = len(lens)
    step = DecodeStep(st, mx.array(lens) - 1 if B > 1 else lens[0] - 1, mx.zeros(B, mx.int32),
                      mx.array(tables, dtype=mx.int32), mx.array(lens, dtype=mx.int32), max(lens), all_slots)
    q = mx.array(rng.normal(size=(B, HQ, 1, case.head_dim)).astype(np.float32)).astype(case.dtype)
    scores = scores or {}
    return path.run(step, 0, q, SCALE, **scores), path.twin(step, 0, q, SCALE, **scores)


def run_prefill(path: Path, rng: np.random.Generator, window: int | None = None,
                scores: dict | None = None) -> tuple[mx.array, mx.array]:
    """A chunk of 15 tokens at positions 20..34 of a sequence in blocks 3, 4, 1, written as the engine writes it;
    with a window (4) the view's slots start at block 4 (position 16), as the cache hands them."""
    case = path.example
    st = storage(case, rng, window)
    table, offset, L = [3, 4, 1], 20, 15
    slots = [table[p // BS] * BS + p % BS for p in range(offset + L)]
    head = st.plan_key_writes([("seq", s) for s in slots[:offset]])
    k, v = (mx.array(rng.normal(size=(offset + L, HKV, case.head_dim)).astype(np.float32)) for _ in range(2))
    st.write(0, mx.array(slots[:offset], dtype=mx.int32), k[:offset], v[:offset], head)
    plan = st.plan_key_writes([("seq", s) for s in slots[offset:]])
    new = mx.array(slots[offset:], dtype=mx.int32)
    st.write(0, new, k[offset:], v[offset:], plan)
    if window is None:
        view = PagedPrefillView(st, 0, offset, new, [slice(3 * BS, 5 * BS), slice(BS, BS + 3)], plan, table)
    else:  # window 4: the first query (20) sees 17..20, from the second block on; the first one is freed (id 0)
        view = PagedPrefillView(st, 0, offset, new, [slice(4 * BS, 5 * BS), slice(BS, BS + 3)], plan, [0, 4, 1],
                                base=BS)
    q = mx.array(rng.normal(size=(1, HQ, L, case.head_dim)).astype(np.float32)).astype(case.dtype)
    scores = scores or {}
    return path.run(view, q, SCALE, **scores), path.twin(view, q, SCALE, **scores)


def run_contiguous(path: Path, rng: np.random.Generator, scores: dict | None = None) -> tuple[mx.array, mx.array]:
    """Four queries after 16 cached tokens (past a window of 8 where the example has one)."""
    case = path.example
    S, L = 20, 4
    q = mx.array(rng.normal(size=(1, HQ, L, case.head_dim)).astype(np.float32)).astype(case.dtype)
    keys, values = (mx.array(rng.normal(size=(1, HKV, S, case.head_dim)).astype(np.float32)).astype(case.dtype)
                    for _ in range(2))
    args = (q, keys, values, SCALE, S - L, case.window)
    scores = scores or {}
    return path.run(*args, **scores), path.twin(*args, **scores)


RUN = {"decode": run_decode, "prefill": run_prefill, "contiguous": run_contiguous}


# Paged rows again with a sliding window on their storage (sliding layers): every paged path takes the window.
WINDOW = {"decode": 10, "prefill": 4}
WINDOWED = [(p, None) for p in TABLE] + [(p, WINDOW[p.phase]) for p in TABLE if p.phase in WINDOW]


@pytest.mark.parametrize("path,window", WINDOWED,
                         ids=[p.name + ("" if w is None else f"-window{w}") for p, w in WINDOWED])
def test_every_path_matches_its_twin(path: Path, window: int | None, reference_calls: list[int],
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    assert path.twin is not None and path.twin is not path.run, f"{path.name}: a path needs a slow twin"
    assert choose(path.example) is path, f"{path.name}: its example is served by {choose(path.example).name}"
    if window is not None:
        windowed = dataclasses.replace(path.example, window=window)
        assert choose(windowed) is path, f"{path.name}: its windowed example is served by {choose(windowed).name}"
    if path.name == "decode-kernel" and _backend.interpret_available():
        monkeypatch.setenv(_backend.INTERPRET_ENV, "1")  # the kernel's Metal source, run by the interpreter
    rng = np.random.default_rng(len(path.name))
    got, want = RUN[path.phase](path, rng) if window is None else RUN[path.phase](path, rng, window)
    assert reference_calls, f"{path.name}: its twin does not compute with kernels_metal.reference"
    assert got.shape == want.shape and got.dtype == want.dtype
    err = float(mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max())
    assert err <= ATOL[path.example.dtype], f"{path.name}: maxdiff {err:.3g}"


SCORED = [p for p in TABLE if p.example.scored]
SCORES = {"softcap": dict(softcap=SOFTCAP), "sinks": dict(sinks=SINKS), "both": dict(softcap=SOFTCAP, sinks=SINKS)}
SCORED_CASES = [(p, w, k) for p in SCORED for w in ([None, WINDOW[p.phase]] if p.phase in WINDOW else [None])
                for k in SCORES]


@pytest.mark.parametrize("path,window,kind", SCORED_CASES,
                         ids=[f"{p.name}-{k}" + ("" if w is None else f"-window{w}") for p, w, k in SCORED_CASES])
def test_scored_paths_match_their_twins(path: Path, window: int | None, kind: str,
                                        reference_calls: list[int]) -> None:
    """A soft cap (Gemma 2), sinks (gpt-oss) and both, against the kernels' reference given the same; each
    changes the output (the twin without it differs), so neither can be dropped on the way."""
    assert choose(dataclasses.replace(path.example, sinks=False)) is path  # a soft cap alone picks the row
    assert choose(dataclasses.replace(path.example, softcap=False)) is path  # sinks alone too
    scores = SCORES[kind]
    args = () if path.phase == "contiguous" else (window,)
    got, want = RUN[path.phase](path, np.random.default_rng(7), *args, scores=scores)
    plain = RUN[path.phase](path, np.random.default_rng(7), *args)[1]  # the twin without them, same data
    assert reference_calls and got.shape == want.shape and got.dtype == want.dtype
    # float32 floor (units, tests/support/tolerance.py; AMD EPYC): 0-1.6 (decode-scored-slots, both); x4, rounded up
    assert_f32_close(got, want, 8, f"{path.name} {kind}")
    assert float(mx.abs(plain - want).max()) > 1e-2, f"{path.name}: {kind} changes nothing"


def test_every_phase_ends_with_a_row_for_any_case() -> None:
    for phase in RUN:
        rows = [p for p in TABLE if p.phase == phase]
        assert rows and rows[-1].when(Case(phase, dtype=mx.bfloat16, head_dim=24, window=3)), phase
