"""Sliding-window attention on the paged path: the decode kernel (Metal source run by the interpreter), its
reference, the attention table's windowed paths, and the engine's KV freeing blocks that left every window.

A window of W: the query at position p reads keys at positions p - W + 1 .. p (mlx-lm's and transformers'
sliding mask). Kernel tolerances are tests/test_kernels_attention.py's (the kernel's outputs are O(1)).
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from kernels_metal import KVPool, _backend, reference
from kernels_metal import paged_decode_attention

KERNEL_ATOL = {mx.float32: 1e-5, mx.float16: 2e-3}

needs_interpreter = pytest.mark.skipif(not _backend.interpret_available(),
                                       reason="kernels_metal.interpret (the Metal interpreter) is not importable")


def dense_window(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, lens: list[int],
                 window: int) -> np.ndarray:
    """Dense masked softmax in float64: q (B, Hq, D), k/v (B, T, Hkv, D) each sequence's keys in order."""
    B, Hq, D = q.shape
    Hkv = k.shape[2]
    out = np.zeros((B, Hq, D))
    for b, n in enumerate(lens):
        pos = np.arange(k.shape[1])
        seen = (pos < n) & (pos >= n - window)  # the query sits at n - 1
        for h in range(Hq):
            s = (k[b, :, h // (Hq // Hkv)] @ q[b, h]) * scale
            s = np.where(seen, s, -np.inf)
            p = np.exp(s - s.max())
            out[b, h] = (p / p.sum()) @ v[b, :, h // (Hq // Hkv)]
    return out


def window_case(rng: np.random.Generator, lens: list[int], window: int, block_size: int, D: int, dtype: mx.Dtype,
                freed: int | None):
    """Sequences over scattered blocks; table entries of blocks wholly before the window point at block `freed`
    (None: their own block). Returns q, pool, tables, lens and the dense keys/values per sequence."""
    Hkv, Hq = 2, 4
    nbs = [-(-n // block_size) for n in lens]
    num_blocks = sum(nbs) + 1
    ids = rng.permutation(num_blocks - 1)
    k = rng.standard_normal((num_blocks, block_size, Hkv, D)).astype(np.float32)
    v = rng.standard_normal((num_blocks, block_size, Hkv, D)).astype(np.float32)
    k[-1], v[-1] = 0.0, 1e3  # the last block: what a freed entry points at in the test that proves it unread
    width = max(nbs)
    tables = np.zeros((len(lens), width), np.int32)
    dk = np.zeros((len(lens), width * block_size, Hkv, D), np.float32)
    dv = np.zeros_like(dk)
    at = 0
    for b, (n, nb) in enumerate(zip(lens, nbs)):
        tables[b, :nb] = ids[at:at + nb]
        at += nb
        dk[b] = k[tables[b]].reshape(-1, Hkv, D)
        dv[b] = v[tables[b]].reshape(-1, Hkv, D)
        if freed is not None:
            tables[b, :max(n - window, 0) // block_size] = freed
    q = rng.standard_normal((len(lens), Hq, D)).astype(np.float32)
    pool = KVPool(mx.array(k).astype(dtype), mx.array(v).astype(dtype))
    cast = lambda a: np.array(mx.array(a).astype(dtype).astype(mx.float32), np.float64)  # noqa: E731
    return (mx.array(q).astype(dtype), pool, mx.array(tables), mx.array(np.array(lens, np.int32)),
            cast(q), cast(dk), cast(dv))


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
@pytest.mark.parametrize("window", [1, 8, 37, 500])
def test_reference_window_matches_dense(window: int, dtype: mx.Dtype) -> None:
    rng = np.random.default_rng(window)
    lens = [5, 40, 77, 130]
    q, pool, tables, seq_lens, qd, kd, vd = window_case(rng, lens, window, 16, 64, dtype, freed=None)
    got = reference.paged_decode_attention(q, pool, tables, seq_lens, 0.125, window=window)
    want = dense_window(qd, kd, vd, 0.125, lens, window)
    assert float(np.abs(np.array(got.astype(mx.float32)) - want).max()) <= KERNEL_ATOL[dtype]


@needs_interpreter
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
@pytest.mark.parametrize("window,partition", [(8, 512), (37, 16), (100, 32), (3, 16)])
def test_interpreter_window_never_reads_freed_blocks(window: int, partition: int, dtype: mx.Dtype) -> None:
    """Table entries before the window point at a block whose values are 1e3: the kernel must not read them (its
    result equals the dense masked softmax), split-K over the window's partitions included."""
    rng = np.random.default_rng(window + partition)
    lens = [5, 40, 77, 130]
    nan_block = sum(-(-n // 16) for n in lens)
    q, pool, tables, seq_lens, qd, kd, vd = window_case(rng, lens, window, 16, 64, dtype, freed=nan_block)
    got = paged_decode_attention(q, pool, tables, seq_lens, 0.125, partition_size=partition, backend="interpret",
                                 window=window)
    want = dense_window(qd, kd, vd, 0.125, lens, window)
    got = np.array(got.astype(mx.float32))
    assert float(np.abs(got - want).max()) <= KERNEL_ATOL[dtype]
    # without the window the same tables read that block: the case does test the skipping
    full = paged_decode_attention(q, pool, tables, seq_lens, 0.125, backend="interpret", check_data=False)
    assert float(np.abs(np.array(full.astype(mx.float32)) - want).max()) > 1.0


def test_window_is_checked() -> None:
    rng = np.random.default_rng(0)
    q, pool, tables, seq_lens, *_ = window_case(rng, [20], 8, 16, 64, mx.float32, freed=None)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="window: expected None or a positive int"):
            paged_decode_attention(q, pool, tables, seq_lens, 0.125, window=bad)


def test_data_checks_skip_entries_before_the_window() -> None:
    """A freed entry (past the pool) before the window passes the host checks; inside the window it fails."""
    rng = np.random.default_rng(1)
    q, pool, tables, seq_lens, qd, kd, vd = window_case(rng, [70], 8, 16, 64, mx.float32, freed=None)
    bad = np.array(tables)
    bad[0, 0] = 999
    out = paged_decode_attention(q, pool, mx.array(bad), seq_lens, 0.125, window=8, backend="reference")
    np.testing.assert_allclose(np.array(out), dense_window(qd, kd, vd, 0.125, [70], 8), atol=1e-5)
    bad[0, 4] = 999
    with pytest.raises(ValueError, match=r"block_tables\[0, 4\]"):
        paged_decode_attention(q, pool, mx.array(bad), seq_lens, 0.125, window=8)
