"""Attention, chosen in one table: each row a condition, an implementation and its slow twin.

The KV views (`kv.views`, `kv.contiguous`) pick a row once per step (`choose`) from what the step is (`Case`) and
call its `run`; the first row whose condition holds wins. Every row's `twin` computes the same attention with
`kernels_metal.reference` (`attention.twins`), and tests/test_attention_table.py runs every row against its twin
on the row's own `example`, so a path added without a twin, or one whose condition its example misses, fails.

Phases, with their implementations' signatures:
- "decode" (`attention.paged`): (step, layer, q (B, Hq, 1, D), scale) over a paged storage, one new token each;
- "prefill" (`attention.paged`): (view, q (1, Hq, L, D), scale), a causal chunk over a paged storage;
- "contiguous" (`attention.contiguous`): (q, keys, values, scale, offset, window), one sequence's own buffer.

A layer whose scores change before the softmax (Gemma 2's soft cap, gpt-oss's sinks: `Case.softcap`, `Case.sinks`)
takes the scored rows (`attention.scored`), whose implementations and twins take `softcap=` and `sinks=` too; the
views pick them per call (`scored_path`), as the layer asks.

A Metal kernel checks itself on first use (`kernels_metal._backend.self_check`) and gives way to its reference
when it fails; `kernel_warnings` runs the check at load and says so in the line `ModelInfo.warnings` shows.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from kernels_metal.paged_attention import HEAD_DIMS as KERNEL_HEAD_DIMS
from mlx_engine.attention import contiguous, paged, scored, twins


@dataclass(frozen=True)
class Case:
    """What picks a path: the phase, how the KV is stored, the machine, the step's shape."""

    phase: str  # "decode", "prefill" or "contiguous"
    dtype: mx.Dtype = mx.float32  # the storage's (activations') dtype
    head_dim: int = 64
    head_major: bool = False  # (Hkv, slots, ..) pools, read in place on MLX's CPU backend
    bits: int | None = None  # quantized KV
    key_per_channel: bool = False
    metal: bool = False  # mx.metal.is_available()
    single: bool = False  # decode: one sequence, its slots read whole (`kv.views.DecodeStep.all_slots`)
    runs: bool = False  # ... as runs of consecutive slots (else ids)
    long: bool = False  # contiguous: the chunk reaches past the sliding window
    window: int | None = None  # the sliding window, if any (paged: the storage's, `storage.window`)
    softcap: bool = False  # scores soft-capped before the mask (Gemma 2)
    sinks: bool = False  # a logit per query head in each softmax's denominator (gpt-oss)

    @property
    def scored(self) -> bool:
        return self.softcap or self.sinks


@dataclass(frozen=True)
class Path:
    name: str
    phase: str
    when: Callable[[Case], bool]
    run: Callable[..., mx.array]
    twin: Callable[..., mx.array]
    example: Case  # a case this row serves: the table's test builds it


TABLE: tuple[Path, ...] = (
    # soft cap or sinks: gathered K/V, MLX ops in float32 (no fused path takes them); one sequence's runs in place
    Path("decode-scored-slots", "decode", lambda c: c.scored and c.single, scored.decode_scored_slots,
         twins.decode_twin, Case("decode", head_major=True, single=True, runs=True, softcap=True, sinks=True)),
    Path("decode-scored", "decode", lambda c: c.scored, scored.decode_scored, twins.decode_twin,
         Case("decode", head_major=True, softcap=True, sinks=True)),
    # one sequence on the CPU: quantized K and V read in place by mx.quantized_matmul
    Path("decode-runs-quantized", "decode",
         lambda c: c.single and c.runs and c.bits is not None and not c.key_per_channel and c.head_major,
         paged.decode_runs_quantized, twins.decode_twin,
         Case("decode", bits=8, head_major=True, single=True, runs=True)),
    # one sequence on the CPU: its runs (or ids) of slots into sdpa
    Path("decode-slots-sdpa", "decode", lambda c: c.single, paged.decode_slots_sdpa, twins.decode_twin,
         Case("decode", head_major=True, single=True)),
    # a batch on the CPU in float32: numpy's BLAS
    Path("decode-host", "decode", lambda c: c.head_major and c.dtype == mx.float32 and not c.metal,
         paged.decode_host, twins.decode_twin, Case("decode", head_major=True, bits=4, key_per_channel=True)),
    Path("decode-head-major", "decode", lambda c: c.head_major, paged.decode_head_major, twins.decode_twin,
         Case("decode", head_major=True, dtype=mx.float16)),
    # token-major pools (a Mac): the Metal kernel, its reference where the kernel failed its self-check
    Path("decode-kernel", "decode", lambda c: c.head_dim in KERNEL_HEAD_DIMS, paged.decode_kernel,
         twins.decode_twin, Case("decode", bits=4)),
    # head dims the kernel is not built for (tiny test models)
    Path("decode-reference", "decode", lambda c: True, paged.decode_reference, twins.decode_twin,
         Case("decode", head_dim=16)),
    Path("prefill-scored", "prefill", lambda c: c.scored, scored.prefill_scored, twins.prefill_twin,
         Case("prefill", bits=8, head_major=True, softcap=True, sinks=True)),
    # per-channel keys: each query reads its own block quantized up to itself
    Path("prefill-channel", "prefill", lambda c: c.key_per_channel, paged.prefill_channel,
         twins.prefill_channel_twin, Case("prefill", bits=4, key_per_channel=True, head_major=True)),
    Path("prefill-sdpa", "prefill", lambda c: True, paged.prefill_sdpa, twins.prefill_twin,
         Case("prefill", bits=8, head_major=True)),
    Path("contiguous-scored", "contiguous", lambda c: c.scored, scored.contiguous_scored, twins.contiguous_twin,
         Case("contiguous", window=8, long=True, softcap=True, sinks=True)),
    Path("contiguous-window", "contiguous", lambda c: c.window is not None and c.long, contiguous.contiguous_window,
         twins.contiguous_twin, Case("contiguous", window=8, long=True)),
    Path("contiguous-sdpa", "contiguous", lambda c: True, contiguous.contiguous_sdpa, twins.contiguous_twin,
         Case("contiguous")),
)


def choose(case: Case) -> Path:
    """The first row of `TABLE` for the case's phase whose condition holds."""
    for path in TABLE:
        if path.phase == case.phase and path.when(case):
            return path
    raise LookupError(f"no attention path for {case}")  # every phase ends with a row that always holds


def storage_case(phase: str, storage: Any, **step: Any) -> Case:
    """The case of a paged storage's `phase`, with the step's shape (`single`, `runs`)."""
    return Case(phase, storage.dtype, storage.head_dim, storage.head_major, storage.bits, storage.key_per_channel,
                mx.metal.is_available(), window=storage.window, **step)


@functools.cache
def scored_path(phase: str, softcap: bool, sinks: bool, single: bool = False) -> Path:
    """The row of a paged `phase` for a layer with a soft cap or sinks (the scored rows take any storage;
    `single`: a decode step of one sequence with its slots, `kv.views.DecodeStep.all_slots`)."""
    return choose(Case(phase, softcap=softcap, sinks=sinks, single=single))


def contiguous_attention(q: mx.array, keys: mx.array, values: mx.array, scale: float, offset: int,
                         window: int | None, softcap: float | None = None, sinks: mx.array | None = None) -> mx.array:
    """A contiguous buffer's attention through the table (the row depends on the chunk: chosen per call)."""
    long = window is not None and offset + q.shape[2] > window
    if softcap is None and sinks is None:
        return _contiguous_path(long, window).run(q, keys, values, scale, offset, window)
    path = _contiguous_path(long, window, softcap is not None, sinks is not None)
    return path.run(q, keys, values, scale, offset, window, softcap=softcap, sinks=sinks)


@functools.cache
def _contiguous_path(long: bool, window: int | None, softcap: bool = False, sinks: bool = False) -> Path:
    return choose(Case("contiguous", long=long, window=window, softcap=softcap, sinks=sinks))


def kernel_warnings(storage: Any) -> tuple[str, ...]:
    """Checks the Metal kernel the decode steps over `storage` (a `kv.paged.PagedKVStorage`) will launch, if
    any, on this machine; returns a line for the user when it failed its check: its reference, which computes the
    same numbers more slowly, runs instead."""
    from kernels_metal import _backend
    from kernels_metal import paged_attention as pa

    which = _backend.resolve("auto")
    if which == "reference" or choose(storage_case("decode", storage)).run is not paged.decode_kernel:
        return ()
    why = pa.self_check(which, storage.dtype, storage.head_dim, bits=storage.bits, k_bits=storage.key_bits,
                        k_per_channel=storage.key_per_channel)
    if why is None:
        return ()
    return (f"the Metal paged-attention kernel failed its check on this machine ({why}): decode attention runs on "
            "its MLX-ops reference instead (the same results, slower)",)
