"""Paged decode attention: one query token per sequence against a block-table KV pool.

Metal: `paged_attention.metal` (per-partition online softmax, FlashDecoding split-K) and, when
more than one partition is needed, `paged_attention_reduce.metal`. Reference:
`reference.paged_decode_attention`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np

from kernels_metal import _backend, reference
from kernels_metal.pool import KVPool

HEAD_DIMS = (64, 80, 96, 128)
KV_BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)
FLOAT_DTYPES = (mx.float16, mx.bfloat16, mx.float32)
PARTITION_SIZE = 512  # tokens per split-K partition (FlashDecoding); vLLM's v2 uses 512 too
NUM_SIMDGROUPS = 8  # 256 threads per (partition, q head, sequence)

_SOURCE = _backend.load_source("paged_attention.metal")
_REDUCE_SOURCE = _backend.load_source("paged_attention_reduce.metal")


# (key bits, value bits) the kernel is built for; 0 means a float pool. Keys may keep more bits than
# values (llama.cpp's --cache-type-k / --cache-type-v): the keys are the sensitive half.
BITS_PAIRS = ((0, 0), *((kb, vb) for kb in KV_BITS for vb in KV_BITS))
# (key bits, value bits) with per-channel keys (KIVI): quantized keys only, values as in BITS_PAIRS.
CHANNEL_BITS_PAIRS = tuple((kb, vb) for kb, vb in BITS_PAIRS if kb)


def _build(factory: Callable[..., Any]) -> dict[Any, Any]:
    """Kernels keyed by (k_bits, v_bits, k_channel, direct), plus "reduce". Bits 0 means float KV;
    k_channel: per-channel key scales and biases (K_CHANNEL)."""
    variants = [(kb, vb, False) for kb, vb in BITS_PAIRS] + [(kb, vb, True) for kb, vb in CHANNEL_BITS_PAIRS]
    kernels: dict[Any, Any] = {}
    for k_bits, v_bits, k_channel in variants:
        inputs = ["q", "k_pool", "v_pool", "block_tables", "seq_lens", "params", "qscale"]
        if k_bits:
            inputs += ["k_scales", "k_biases", "v_scales", "v_biases"]
        for direct in (True, False):
            name = f"paged_decode_attention_k{k_bits}{'c' if k_channel else ''}v{v_bits}"
            kernels[k_bits, v_bits, k_channel, direct] = factory(
                name=name if direct else f"{name}_partial",
                input_names=inputs,
                output_names=["out"] if direct else ["o_part", "ml_part"],
                source=f"\n#define K_BITS {k_bits}\n#define V_BITS {v_bits}\n#define K_CHANNEL {int(k_channel)}\n"
                f"#define DIRECT {int(direct)}\n{_SOURCE}",
            )
    kernels["reduce"] = factory(
        name="paged_decode_attention_reduce",
        input_names=["o_part", "ml_part", "params"],
        output_names=["out"],
        source=_REDUCE_SOURCE,
    )
    return kernels


_METAL_KERNELS = _backend.build_metal(_build)


@functools.cache
def _interpret_kernels() -> dict[Any, Any]:
    return _build(_backend.interpret_factory())


def _kernels(backend: str) -> dict[Any, Any]:
    if backend == "interpret":
        return _interpret_kernels()
    if isinstance(_METAL_KERNELS, Exception):
        raise RuntimeError(f"mx.fast.metal_kernel could not build the kernels: {_METAL_KERNELS}")
    return _METAL_KERNELS


def _check_array(name: str, a: Any, ndim: int, dtypes: tuple[mx.Dtype, ...]) -> None:
    if not isinstance(a, mx.array):
        raise TypeError(f"{name}: expected an mx.array, got {type(a).__name__}")
    if a.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {tuple(a.shape)}")
    if a.dtype not in dtypes:
        raise TypeError(f"{name}: expected dtype in {[str(d) for d in dtypes]}, got {a.dtype}")


def _validate(q: mx.array, pool: KVPool, block_tables: mx.array, seq_lens: mx.array, scale: float,
              check_data: bool, window: int | None = None) -> int:
    """Shape and dtype checks, then (with check_data) the host-side checks of the tables and
    lengths; returns the longest sequence length, or the tables' capacity without check_data."""
    if not isinstance(pool, KVPool):
        raise TypeError(f"pool: expected a kernels_metal.KVPool, got {type(pool).__name__}")
    k_pool, v_pool, bits, k_bits = pool.k, pool.v, pool.bits, pool.k_bits
    group_size, k_per_channel, scales = pool.group_size, pool.k_per_channel, pool.scales()
    _check_array("q", q, 3, FLOAT_DTYPES)
    B, Hq, D = q.shape
    if D not in HEAD_DIMS:
        raise ValueError(f"q: head dim expected one of {HEAD_DIMS}, got {D}")
    if not isinstance(scale, (int, float)) or isinstance(scale, bool):
        raise TypeError(f"scale: expected a float, got {type(scale).__name__}")
    if not isinstance(k_per_channel, bool):
        raise TypeError(f"pool.k_per_channel: expected a bool, got {type(k_per_channel).__name__}")
    if bits is None:
        if k_per_channel:
            raise ValueError("pool.k_per_channel: expected False when bits is None (float KV), got True")
        if k_bits is not None:
            raise ValueError(f"pool.k_bits: expected None when bits is None (float KV), got {k_bits!r}")
        if any(s is not None for s in scales.values()):
            given = [n for n, s in scales.items() if s is not None]
            raise ValueError(f"pool.{given[0]}: expected None when bits is None (float KV), got an array")
        _check_array("pool.k", k_pool, 4, FLOAT_DTYPES)
        _check_array("pool.v", v_pool, 4, FLOAT_DTYPES)
        k_packed = v_packed = D
    else:
        if bits not in KV_BITS:
            raise ValueError(f"pool.bits: expected None or one of {KV_BITS}, got {bits!r}")
        if k_bits is not None and k_bits not in KV_BITS:
            raise ValueError(f"pool.k_bits: expected None (the keys take `bits`) or one of {KV_BITS}, got {k_bits!r}")
        if group_size not in GROUP_SIZES:
            raise ValueError(f"pool.group_size: expected one of {GROUP_SIZES}, got {group_size!r}")
        if D % group_size:
            raise ValueError(f"pool.group_size: expected a divisor of the head dim {D}, got {group_size}")
        _check_array("pool.k", k_pool, 4, (mx.uint32,))
        _check_array("pool.v", v_pool, 4, (mx.uint32,))
        k_packed, v_packed = D * (k_bits or bits) // 32, D * bits // 32
    num_blocks, block_size, Hkv, last = k_pool.shape
    if last != k_packed:
        name = "pool.bits" if k_bits is None else "pool.k_bits"
        what = "the head dim" if bits is None else f"head dim * {name} / 32 = {D} * {k_bits or bits} / 32"
        raise ValueError(f"pool.k: expected last dim {k_packed} ({what}), got shape {tuple(k_pool.shape)}")
    want_v = (num_blocks, block_size, Hkv, v_packed)
    if tuple(v_pool.shape) != want_v:
        what = ("the shape of pool.k" if bits is None
                else f"pool.k's blocks and heads, last dim head dim * bits / 32 = {D} * {bits} / 32")
        raise ValueError(f"pool.v: expected shape {want_v} ({what}), got {tuple(v_pool.shape)}")
    if v_pool.dtype != k_pool.dtype:
        raise TypeError(f"pool.v: expected the dtype of pool.k {k_pool.dtype}, got {v_pool.dtype}")
    if min(num_blocks, block_size, Hkv) < 1:
        raise ValueError(
            f"pool.k: expected non-empty (num_blocks, block_size, Hkv), got {tuple(k_pool.shape)}"
        )
    if Hq % Hkv:
        raise ValueError(f"q: expected a number of heads that is a multiple of Hkv = {Hkv}, got Hq = {Hq}")
    if k_per_channel and D % block_size:
        raise ValueError(
            f"pool.k_per_channel needs block_size dividing the head dim: pool.k's block_size {block_size} "
            f"does not divide {D}"
        )
    if bits is not None:
        per_token = (num_blocks, block_size, Hkv, D // group_size)
        # per-channel keys: a block's D scales per head fill its block_size slots, D / block_size each
        per_channel = (num_blocks, block_size, Hkv, D // block_size)
        for name, s in scales.items():
            want, what = per_token, f"{bits}-bit KV"
            if k_per_channel and name in ("k_scales", "k_biases"):
                want, what = per_channel, "per-channel keys (k_per_channel, D // block_size per slot)"
            if s is None:
                raise ValueError(f"pool.{name}: expected an array of shape {want} for {what}, got None")
            _check_array(f"pool.{name}", s, 4, FLOAT_DTYPES)
            if tuple(s.shape) != want:
                raise ValueError(f"pool.{name}: expected shape {want} for {what}, got {tuple(s.shape)}")
    _check_array("block_tables", block_tables, 2, (mx.int32,))
    _check_array("seq_lens", seq_lens, 1, (mx.int32,))
    if block_tables.shape[0] != B:
        raise ValueError(
            f"block_tables: expected {B} rows (the batch of q), got shape {tuple(block_tables.shape)}"
        )
    if seq_lens.shape[0] != B:
        raise ValueError(f"seq_lens: expected shape ({B},), got {tuple(seq_lens.shape)}")

    max_blocks = block_tables.shape[1]
    capacity = max_blocks * block_size
    if not check_data:
        return capacity
    # Data checks on the host, before anything reads the pool through the tables.
    lens = np.array(seq_lens)
    tables = np.array(block_tables)
    if B and lens.min() < 0:
        b = int(np.argmin(lens))
        raise ValueError(f"seq_lens[{b}]: expected >= 0, got {int(lens[b])}")
    if B and lens.max() > capacity:
        b = int(np.argmax(lens))
        raise ValueError(
            f"seq_lens[{b}]: expected <= max_blocks_per_seq * block_size = "
            f"{max_blocks} * {block_size} = {capacity}, got {int(lens[b])}"
        )
    used = np.arange(max_blocks)[None, :] < -(-lens[:, None] // block_size)  # (B, max_blocks)
    if window is not None:  # blocks wholly before the window are never read (they may have been freed)
        used &= np.arange(max_blocks)[None, :] >= np.maximum(lens[:, None] - window, 0) // block_size
    bad = np.argwhere(used & ((tables < 0) | (tables >= num_blocks)))
    if bad.size:
        b, j = (int(i) for i in bad[0])
        raise ValueError(
            f"block_tables[{b}, {j}]: expected a block id in [0, {num_blocks}) (num_blocks of "
            f"the pool), got {int(tables[b, j])}"
        )
    return int(lens.max()) if B else 0


def paged_decode_attention(
    q: mx.array,
    pool: KVPool,
    block_tables: mx.array,
    seq_lens: mx.array,
    scale: float,
    *,
    partition_size: int = PARTITION_SIZE,
    check_data: bool = True,
    backend: _backend.Backend = "auto",
    window: int | None = None,
) -> mx.array:
    """Attention of one new query token per sequence over a paged KV pool.

    q (B, Hq, D) in float16/bfloat16/float32; `pool` one layer's K and V (`KVPool`: float, or 4/8-bit with
    keys per token or per channel). block_tables int32 (B, max_blocks_per_seq) of block ids; seq_lens int32
    (B,). Returns (B, Hq, D) in q's dtype; a sequence of length 0 gives zeros. Hq must be a multiple of Hkv
    (GQA); D in (64, 80, 96, 128).

    `partition_size` is the number of tokens one threadgroup reduces before the split-K merge;
    `backend` picks the implementation ("auto": Metal if available, the interpreter if
    ROOFLINE_METAL_INTERPRET=1, else the MLX-ops reference). On "auto" a kernel that fails its
    self-check (`self_check`) gives way to the reference. Shapes and dtypes are always
    checked; `check_data` also checks on the host that every used table entry is inside the pool
    and every length fits its table, which reads `block_tables` and `seq_lens` back (a sync per
    call). A caller that keeps the tables itself (the engine's block manager) can pass
    check_data=False to skip the sync; partitions then cover the tables' capacity.

    `window` (sliding-window attention): a sequence's query, at position seq_lens[b] - 1, reads only its last
    `window` keys (keys at positions < seq_lens[b] - window are masked, and their table entries never read: the
    engine frees blocks that left the window); partitions then cover at most `window` tokens. None: every key.
    """
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        raise ValueError(f"window: expected None or a positive int (tokens), got {window!r}")
    max_len = _validate(q, pool, block_tables, seq_lens, scale, check_data, window)
    if not isinstance(partition_size, int) or partition_size < 1:
        raise ValueError(f"partition_size: expected a positive int, got {partition_size!r}")
    which = _backend.resolve(backend)
    if backend == "auto" and which != "reference" and self_check(which, q.dtype, q.shape[2], pool) is not None:
        which = "reference"  # the kernel failed on this machine: its twin computes the same attention
    if which == "reference":
        return reference.paged_decode_attention(q, pool, block_tables, seq_lens, scale,
                                                max_seq_len=max_len if check_data else None, window=window)
    return _launch(which, q, pool, block_tables, seq_lens, scale, partition_size, max_len, window)


def _launch(which: str, q: mx.array, pool: KVPool, block_tables: mx.array, seq_lens: mx.array, scale: float,
            partition_size: int, max_len: int, window: int | None = None) -> mx.array:
    """The kernel on `which` ("metal" or "interpret"), arguments validated."""
    kernels = _kernels(which)
    B, Hq, D = q.shape
    if B == 0:
        return mx.zeros((0, Hq, D), dtype=q.dtype)
    _, block_size, Hkv, _ = pool.k.shape
    P = max(1, math.ceil((max_len if window is None else min(max_len, window)) / partition_size))
    params = mx.array(
        [Hq, Hkv, block_size, block_tables.shape[1], partition_size, P, pool.group_size, window or 0], dtype=mx.int32
    )
    qscale = mx.array([scale * math.log2(math.e)], dtype=mx.float32)  # softmax in base 2
    inputs = [q, pool.k, pool.v, block_tables, seq_lens, params, qscale]
    if pool.bits is not None:
        inputs += [pool.k_scales, pool.k_biases, pool.v_scales, pool.v_biases]
    threads = NUM_SIMDGROUPS * 32
    template = [("T", q.dtype), ("D", D), ("NSG", NUM_SIMDGROUPS)]
    launch = dict(inputs=inputs, template=template, grid=(P * threads, Hq, B), threadgroup=(threads, 1, 1))
    key = (pool.key_bits or 0, pool.bits or 0, pool.k_per_channel)
    if P == 1:
        (out,) = kernels[(*key, True)](**launch, output_shapes=[(B, Hq, D)], output_dtypes=[q.dtype])
        return out
    o_part, ml_part = kernels[(*key, False)](
        **launch,
        output_shapes=[(B, Hq, P, D), (B, Hq, P, 2)],
        output_dtypes=[mx.float32, mx.float32],
    )
    (out,) = kernels["reduce"](
        inputs=[o_part, ml_part, mx.array([P, Hq], dtype=mx.int32)],
        template=[("T", q.dtype), ("D", D)],
        grid=(D, Hq, B),
        threadgroup=(D, 1, 1),
        output_shapes=[(B, Hq, D)],
        output_dtypes=[q.dtype],
    )
    return out


# ---------------------------------------------------------------- self-check

# What a kernel may differ from its reference by on the self-check's case: 8x the floors the tests measured
# (tests/test_kernels_metal_paged_attention.py: summation order, exp2, rounding to q's dtype), room for a GPU's fast
# math; a broken kernel is off by O(1).
CHECK_ATOL = {mx.float32: 8e-5, mx.float16: 1.6e-2, mx.bfloat16: 1.3e-1}
CHECK_BLOCK_SIZE = 16  # divides every head dim, as per-channel keys need
CHECK_LENS = (5, 40)  # a partial block, and three blocks: split into partitions of CHECK_PARTITION below
CHECK_PARTITION = 16
CHECK_WINDOW = 21  # the 40-token sequence's window starts inside its second block and spans two partitions


def self_check(backend: str, dtype: mx.Dtype, head_dim: int, pool: KVPool | None = None, *, bits: int | None = None,
               k_bits: int | None = None, k_per_channel: bool = False) -> str | None:
    """Whether the kernel variant for this dtype, head dim and KV format works on `backend` ("metal" or
    "interpret"): it compiles and matches the reference on a small case, single pass and split-K. Run once per
    process and variant; returns None when it passed, else why not. The format comes from `pool` or the
    keywords."""
    if pool is not None:
        bits, k_bits, k_per_channel = pool.bits, pool.k_bits, pool.k_per_channel
    k_bits = None if k_bits == bits else k_bits
    variant = (str(dtype), head_dim, bits, k_bits, k_per_channel)
    return _backend.self_check("paged_decode_attention", backend, variant,
                               lambda: _probe(backend, dtype, head_dim, bits, k_bits, k_per_channel))


def _probe(backend: str, dtype: mx.Dtype, D: int, bits: int | None, k_bits: int | None,
           k_per_channel: bool) -> str | None:
    rng = np.random.default_rng(0)
    bs, lens = CHECK_BLOCK_SIZE, CHECK_LENS
    num_blocks = sum(-(-n // bs) for n in lens) + 1
    ids = rng.permutation(num_blocks)[: sum(-(-n // bs) for n in lens)].tolist()
    width = max(-(-n // bs) for n in lens)
    rows, at = [], 0
    for n in lens:
        nb = -(-n // bs)
        rows.append(ids[at:at + nb] + [0] * (width - nb))
        at += nb
    tables, seq_lens = mx.array(rows, dtype=mx.int32), mx.array(lens, dtype=mx.int32)
    shape = (num_blocks, bs, 1, D)
    q = mx.array(rng.standard_normal((len(lens), 2, D)).astype(np.float32)).astype(dtype)
    k, v = (mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype) for _ in range(2))
    if bits is None:
        pool = KVPool(k, v)
    else:
        group = 32
        if k_per_channel:
            kq, ks, kb = reference.quantize_channels(k, mx.full((num_blocks,), bs, mx.int32), k_bits or bits)
        else:
            kq, ks, kb = mx.quantize(k, group_size=group, bits=k_bits or bits)
        vq, vs, vb = mx.quantize(v, group_size=group, bits=bits)
        pool = KVPool(kq, vq, ks, kb, vs, vb, bits, group, k_bits, k_per_channel)
    scale = D ** -0.5
    for partition, what, window in ((PARTITION_SIZE, "single pass", None), (CHECK_PARTITION, "split-K", None),
                                    (CHECK_PARTITION, "sliding-window split-K", CHECK_WINDOW)):
        want = reference.paged_decode_attention(q, pool, tables, seq_lens, scale, window=window)
        got = _launch(backend, q, pool, tables, seq_lens, scale, partition, max(lens), window)
        mx.eval(got, want)  # compiled and run now, not inside a later step
        err = float(mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max())
        if not err <= CHECK_ATOL[dtype]:  # NaN fails too
            return f"its {what} result differs from the reference by {err:.3g} (allowed {CHECK_ATOL[dtype]:.3g})"
    return None
