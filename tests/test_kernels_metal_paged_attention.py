"""Paged decode attention: naive numpy (per token) vs the MLX-ops reference vs the Metal source run
by the interpreter, plus the argument checks.

Tolerances (max abs error, outputs are O(1) since V is standard normal):
  float32 1e-5 (both sides compute in float32; only summation order and exp vs exp2 differ);
  float16 2e-3 and bfloat16 1.6e-2: the output is rounded to q's dtype (half an ulp at 1-2 is
  1e-3 / 7.8e-3), and the reference and the kernel may round on either side of a tie.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kernels_metal import KVPool, _backend, reference
from kernels_metal import paged_decode_attention as _paged_decode_attention
from kernels_metal.paged_attention import HEAD_DIMS

ATOL = {mx.float32: 1e-5, mx.float16: 2e-3, mx.bfloat16: 1.6e-2}
DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}

needs_interpreter = pytest.mark.skipif(
    not _backend.interpret_available(),
    reason="kernels_metal.interpret (the Metal interpreter) is not importable yet",
)


# ---------------------------------------------------------------- inputs

# A case is a flat dict of the kernel's arguments with the pool's fields spelled out (k_pool, v_pool, k_scales, ...,
# bits, group_size, k_bits, k_per_channel), so a test can replace any one of them; `call` builds the `KVPool`.
POOL_FIELDS = {"k_pool": "k", "v_pool": "v", "k_scales": "k_scales", "k_biases": "k_biases", "v_scales": "v_scales",
               "v_biases": "v_biases", "bits": "bits", "group_size": "group_size", "k_bits": "k_bits",
               "k_per_channel": "k_per_channel"}


def call(case: dict) -> dict:
    """A case as `paged_decode_attention`'s keyword arguments."""
    pool = KVPool(**{POOL_FIELDS[k]: v for k, v in case.items() if k in POOL_FIELDS})
    return {"pool": pool, **{k: v for k, v in case.items() if k not in POOL_FIELDS}}


def paged_decode_attention(**case) -> mx.array:
    return _paged_decode_attention(**call(case))


def unpack_codes(packed: np.ndarray, bits: int) -> np.ndarray:
    """mx.quantize's packing: element j of a row is bits-wide field j % (32 / bits) of word
    j // (32 / bits), lowest bits first -> the codes as float64 (..., D)."""
    per_word = 32 // bits
    shifts = (np.arange(per_word, dtype=np.uint32) * bits)[None, :]
    q = (packed.astype(np.uint32)[..., None] >> shifts) & np.uint32((1 << bits) - 1)
    return q.reshape(*packed.shape[:-1], -1).astype(np.float64)


def unpack_affine(packed: np.ndarray, scales: np.ndarray, biases: np.ndarray, bits: int) -> np.ndarray:
    """Naive inverse of mx.quantize's affine format: w = scale * q + bias per group along D."""
    q = unpack_codes(packed, bits)  # (..., D)
    group = q.shape[-1] // scales.shape[-1]
    s = np.repeat(scales.astype(np.float64), group, axis=-1)
    z = np.repeat(biases.astype(np.float64), group, axis=-1)
    return s * q + z


def unpack_channels(packed: np.ndarray, scales: np.ndarray, biases: np.ndarray, bits: int) -> np.ndarray:
    """Naive per-channel keys, from the layout's definition: packed (nb, block_size, Hkv, D * bits / 32),
    scales/biases (nb, block_size, Hkv, D / block_size); element (blk, t, h, d) =
    scales[blk, d % block_size, h, d // block_size] * code + biases[blk, d % block_size, h, d // block_size]."""
    q = unpack_codes(packed, bits)  # (nb, block_size, Hkv, D)
    block_size, D = q.shape[1], q.shape[-1]
    out = np.empty_like(q)
    for d in range(D):
        s = scales[:, d % block_size, :, d // block_size].astype(np.float64)  # (nb, Hkv)
        z = biases[:, d % block_size, :, d // block_size].astype(np.float64)
        out[..., d] = s[:, None, :] * q[..., d] + z[:, None, :]  # every token of the block
    return out


def make_case(
    rng: np.random.Generator,
    seq_lens: list[int],
    Hkv: int,
    ratio: int,
    D: int,
    block_size: int,
    dtype: mx.Dtype,
    bits: int | None = None,
    group_size: int = 64,
    spare_blocks: int = 3,
    k_bits: int | None = None,
    k_per_channel: bool = False,
) -> dict:
    """A pool with the sequences' blocks scattered over a random permutation of block ids, table
    entries past each sequence's length set to ids past the pool (which must never be read).
    `k_bits`: keys quantized to other bits than the values' `bits`. `k_per_channel`: keys quantized
    per channel over each block's tokens in use (`reference.quantize_channels`), as the engine does."""
    B = len(seq_lens)
    blocks_per_seq = [max(1, -(-n // block_size)) for n in seq_lens]
    max_blocks = max(blocks_per_seq) + 1
    num_blocks = sum(blocks_per_seq) + spare_blocks
    ids = rng.permutation(num_blocks)
    tables = np.full((B, max_blocks), num_blocks + 7, dtype=np.int32)
    block_valid = np.full(num_blocks, block_size, dtype=np.int32)  # tokens in use per block id
    start = 0
    for b, nb in enumerate(blocks_per_seq):
        tables[b, :nb] = ids[start : start + nb]
        # a partial last block has padding past its tokens; at least one, so no block is all padding
        block_valid[ids[start : start + nb]] = np.clip(seq_lens[b] - np.arange(nb) * block_size, 1, block_size)
        start += nb
    shape = (num_blocks, block_size, Hkv, D)
    q = mx.array(rng.standard_normal((B, Hkv * ratio, D)).astype(np.float32)).astype(dtype)
    case = dict(
        q=q,
        block_tables=mx.array(tables),
        seq_lens=mx.array(np.array(seq_lens, dtype=np.int32)),
        scale=1.0 / math.sqrt(D),
    )
    k = mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)
    v = mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)
    if bits is None:
        case.update(k_pool=k, v_pool=v)
    else:
        if k_per_channel:
            kq, ks, kb = reference.quantize_channels(k, mx.array(block_valid), k_bits or bits)
        else:
            kq, ks, kb = mx.quantize(k, group_size=group_size, bits=k_bits or bits)
        vq, vs, vb = mx.quantize(v, group_size=group_size, bits=bits)
        case.update(
            k_pool=kq,
            v_pool=vq,
            k_scales=ks,
            k_biases=kb,
            v_scales=vs,
            v_biases=vb,
            bits=bits,
            group_size=group_size,
        )
        if k_bits is not None:
            case["k_bits"] = k_bits
        if k_per_channel:
            case["k_per_channel"] = True
    return case


def naive_attention(case: dict) -> np.ndarray:
    """Per sequence, per head, per token, in float64: the obviously correct computation."""
    q = np.array(case["q"].astype(mx.float32), dtype=np.float64)
    if case.get("bits") is None:
        k_pool = np.array(case["k_pool"].astype(mx.float32), dtype=np.float64)
        v_pool = np.array(case["v_pool"].astype(mx.float32), dtype=np.float64)
    else:
        f = lambda a: np.array(a.astype(mx.float32))
        unpack_keys = unpack_channels if case.get("k_per_channel") else unpack_affine
        k_pool = unpack_keys(
            np.array(case["k_pool"]), f(case["k_scales"]), f(case["k_biases"]), case.get("k_bits") or case["bits"]
        )
        v_pool = unpack_affine(
            np.array(case["v_pool"]), f(case["v_scales"]), f(case["v_biases"]), case["bits"]
        )
    tables = np.array(case["block_tables"])
    lens = np.array(case["seq_lens"])
    B, Hq, D = q.shape
    block_size, Hkv = k_pool.shape[1], k_pool.shape[2]
    out = np.zeros((B, Hq, D))
    for b in range(B):
        for h in range(Hq):
            hk = h // (Hq // Hkv)
            keys, values = [], []
            for t in range(lens[b]):
                block = tables[b, t // block_size]
                keys.append(k_pool[block, t % block_size, hk])
                values.append(v_pool[block, t % block_size, hk])
            if not keys:
                continue
            s = np.array([q[b, h] @ k for k in keys]) * case["scale"]
            p = np.exp(s - s.max())
            out[b, h] = (p / p.sum()) @ np.array(values)
    return out


def run(case: dict, backend: str, **kw) -> np.ndarray:
    out = paged_decode_attention(**case, backend=backend, **kw)
    assert out.dtype == case["q"].dtype and out.shape == case["q"].shape
    return np.array(out.astype(mx.float32))


def assert_close(got: np.ndarray, want: np.ndarray, dtype: mx.Dtype) -> None:
    err = float(np.max(np.abs(got - want))) if got.size else 0.0
    assert err <= ATOL[dtype], f"maxdiff {err:.3g} > {ATOL[dtype]:.3g} ({dtype})"


# ---------------------------------------------------------------- strategies


@st.composite
def attention_cases(draw, max_len: int = 150, max_batch: int = 3):
    block_size = draw(st.sampled_from([16, 32]))
    D = draw(st.sampled_from(HEAD_DIMS))
    ratio = draw(st.sampled_from([1, 4, 8]))
    Hkv = draw(st.sampled_from([1, 2])) if ratio < 8 else 1
    # quantized KV needs D % group_size == 0: 80 has no supported group size, 96 only 32
    bits = draw(st.sampled_from([None, 4, 8])) if D != 80 else None
    group_size = draw(st.sampled_from([g for g in (32, 64) if D % g == 0])) if bits else 64
    dtype = DTYPES[draw(st.sampled_from(list(DTYPES)))]
    edge = st.sampled_from([1, block_size - 1, block_size, block_size + 1])
    lens = draw(st.lists(st.one_of(edge, st.integers(1, max_len)), min_size=1, max_size=max_batch))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    return make_case(rng, lens, Hkv, ratio, D, block_size, dtype, bits, group_size)


# ---------------------------------------------------------------- reference vs naive


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=attention_cases())
def test_reference_matches_naive(case):
    assert_close(run(case, "reference"), naive_attention(case), case["q"].dtype)


@pytest.mark.parametrize("bits", [None, 4])
def test_reference_long_sequence(bits):
    rng = np.random.default_rng(1)
    case = make_case(rng, [3001, 17], Hkv=2, ratio=4, D=128, block_size=32, dtype=mx.float32, bits=bits)
    assert_close(run(case, "reference"), naive_attention(case), mx.float32)


def test_reference_empty_sequence_gives_zeros():
    rng = np.random.default_rng(2)
    case = make_case(rng, [0, 5], Hkv=1, ratio=1, D=64, block_size=16, dtype=mx.float32)
    out = run(case, "reference")
    assert np.all(out[0] == 0)
    assert_close(out, naive_attention(case), mx.float32)


def test_auto_backend_runs_on_this_machine():
    rng = np.random.default_rng(3)
    case = make_case(rng, [20], Hkv=1, ratio=4, D=64, block_size=16, dtype=mx.float16)
    out = paged_decode_attention(**case)
    assert_close(np.array(out.astype(mx.float32)), naive_attention(case), mx.float16)


# ---------------------------------------------------------------- interpreter vs reference


@needs_interpreter
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=attention_cases(max_len=80, max_batch=2), partition_size=st.sampled_from([32, 64, 512]))
def test_interpreter_matches_reference(case, partition_size):
    got = run(case, "interpret", partition_size=partition_size)
    assert_close(got, run(case, "reference"), case["q"].dtype)


# Every head dim, GQA ratio and KV format at least once, single pass and split-K.
@needs_interpreter
@pytest.mark.parametrize(
    "D, ratio, bits, group_size, dtype, block_size, lens, partition_size",
    [
        (64, 1, None, 64, mx.float32, 16, [1, 15, 16], 512),
        (80, 4, None, 64, mx.float16, 32, [31, 32], 16),
        (96, 8, 8, 32, mx.float32, 16, [33], 32),
        (128, 4, 4, 64, mx.bfloat16, 32, [1, 70], 32),
        (64, 8, 4, 32, mx.float32, 32, [40], 512),
        (128, 1, 8, 64, mx.float16, 16, [17], 512),
    ],
)
def test_interpreter_covers_formats(D, ratio, bits, group_size, dtype, block_size, lens, partition_size):
    rng = np.random.default_rng(D + ratio)
    case = make_case(rng, lens, 1, ratio, D, block_size, dtype, bits, group_size)
    got = run(case, "interpret", partition_size=partition_size)
    assert_close(got, run(case, "reference"), dtype)
    assert_close(got, naive_attention(case), dtype)


@needs_interpreter
def test_interpreter_long_sequence_split_k():
    rng = np.random.default_rng(4)
    case = make_case(rng, [2500], Hkv=1, ratio=1, D=64, block_size=32, dtype=mx.float32)
    got = run(case, "interpret")  # 5 partitions of 512, then the reduce kernel
    assert_close(got, run(case, "reference"), mx.float32)


@needs_interpreter
def test_interpreter_long_sequences_quantized_gqa():
    rng = np.random.default_rng(8)
    case = make_case(
        rng, [4100, 700], Hkv=2, ratio=4, D=128, block_size=16, dtype=mx.float16, bits=8, group_size=32
    )
    got = run(case, "interpret")
    assert_close(got, run(case, "reference"), mx.float16)


@pytest.mark.parametrize("backend", ["reference", pytest.param("interpret", marks=needs_interpreter)])
def test_without_data_checks_same_result(backend):
    # no host sync: the partitions then cover the tables' capacity, most of them empty
    rng = np.random.default_rng(10)
    case = make_case(rng, [70, 3], Hkv=1, ratio=4, D=64, block_size=16, dtype=mx.float32)
    got = run(case, backend, partition_size=32, check_data=False)
    assert_close(got, run(case, backend, partition_size=32), mx.float32)
    assert_close(got, naive_attention(case), mx.float32)


@needs_interpreter
def test_env_selects_the_interpreter(monkeypatch):
    rng = np.random.default_rng(9)
    case = make_case(rng, [9], Hkv=1, ratio=1, D=64, block_size=16, dtype=mx.float32)
    monkeypatch.setenv(_backend.INTERPRET_ENV, "1")
    assert _backend.resolve("auto") == "interpret"
    assert_close(run(case, "auto"), naive_attention(case), mx.float32)
    monkeypatch.setenv(_backend.INTERPRET_ENV, "0")
    assert _backend.resolve("auto") == ("metal" if mx.metal.is_available() else "reference")


@needs_interpreter
def test_interpreter_empty_sequence_gives_zeros():
    rng = np.random.default_rng(5)
    case = make_case(rng, [0, 3], Hkv=1, ratio=1, D=64, block_size=16, dtype=mx.float32)
    for partition_size in (512, 16):
        got = run(case, "interpret", partition_size=partition_size)
        assert np.all(got[0] == 0)
        assert_close(got, run(case, "reference"), mx.float32)


# ---------------------------------------------------------------- bad input


def fixed_case(seed: int, overrides: dict, seq_lens: list[int], **shape) -> dict:
    """A `make_case` from a fixed seed, then some of its arguments replaced (the bad input under test)."""
    case = make_case(np.random.default_rng(seed), seq_lens, **shape)
    case.update(overrides)
    return case


def small_case(**overrides) -> dict:
    return fixed_case(6, overrides, [20, 5], Hkv=2, ratio=2, D=64, block_size=16, dtype=mx.float32)


def quant_case(**overrides) -> dict:
    return fixed_case(7, overrides, [20], Hkv=1, ratio=1, D=64, block_size=16, dtype=mx.float16, bits=4,
                      group_size=32)


@pytest.mark.parametrize(
    "make, error, words",
    [
        (lambda: small_case(q=mx.zeros((2, 4, 72))), ValueError, ["q", "head dim", "72"]),
        (lambda: small_case(q=mx.zeros((2, 4, 64), dtype=mx.int32)), TypeError, ["q", "dtype", "int32"]),
        (lambda: small_case(q=mx.zeros((2, 64))), ValueError, ["q", "3 dimensions", "(2, 64)"]),
        (lambda: small_case(q=np.zeros((2, 4, 64))), TypeError, ["q", "mx.array", "ndarray"]),
        (lambda: small_case(q=mx.zeros((2, 3, 64))), ValueError, ["Hkv = 2", "Hq = 3"]),
        (
            lambda: small_case(k_pool=mx.zeros((5, 16, 2, 64), dtype=mx.uint32)),
            TypeError,
            ["pool.k", "uint32"],
        ),
        (lambda: small_case(v_pool=mx.zeros((5, 16, 2, 64))), ValueError, ["pool.v", "shape"]),
        (lambda: small_case(k_pool=mx.zeros((5, 16, 2, 32))), ValueError, ["pool.k", "last dim 64", "32"]),
        (
            lambda: small_case(block_tables=mx.zeros((2, 3), dtype=mx.int64)),
            TypeError,
            ["block_tables", "int64"],
        ),
        (
            lambda: small_case(block_tables=mx.zeros((3, 3), dtype=mx.int32)),
            ValueError,
            ["block_tables", "2 rows"],
        ),
        (
            lambda: small_case(seq_lens=mx.array([20, 5, 1], dtype=mx.int32)),
            ValueError,
            ["seq_lens", "(2,)", "(3,)"],
        ),
        (lambda: small_case(seq_lens=mx.array([20.0, 5.0])), TypeError, ["seq_lens", "float32"]),
        (
            lambda: small_case(seq_lens=mx.array([20, -1], dtype=mx.int32)),
            ValueError,
            ["seq_lens[1]", ">= 0", "-1"],
        ),
        (
            lambda: small_case(seq_lens=mx.array([20, 49], dtype=mx.int32)),
            ValueError,
            ["seq_lens[1]", "3 * 16 = 48", "49"],
        ),
        (lambda: small_case(scale="0.1"), TypeError, ["scale", "str"]),
        (lambda: small_case(bits=3), ValueError, ["bits", "3"]),
        (lambda: small_case(k_scales=mx.zeros((1,))), ValueError, ["k_scales", "None"]),
        (lambda: quant_case(bits=8), ValueError, ["pool.k", "last dim 16", "8"]),
        (lambda: quant_case(group_size=48), ValueError, ["group_size", "48"]),
        (lambda: quant_case(v_biases=None), ValueError, ["v_biases", "None"]),
        (lambda: quant_case(k_scales=mx.zeros((4, 16, 1, 4))), ValueError, ["k_scales", "shape"]),
        (lambda: quant_case(k_pool=mx.zeros((4, 16, 1, 8))), TypeError, ["pool.k", "uint32", "float32"]),
        (lambda: small_case(partition_size=0), ValueError, ["partition_size", "0"]),
        (lambda: small_case(backend="cuda"), ValueError, ["backend", "cuda"]),
    ],
)
def test_bad_input_raises(make, error, words):
    with pytest.raises(error) as info:
        paged_decode_attention(**{"backend": "reference", **make()})
    for w in words:
        assert w in str(info.value), f"{w!r} not in {str(info.value)!r}"


def test_block_table_past_the_pool_raises():
    case = small_case()
    num_blocks = case["k_pool"].shape[0]
    tables = np.array(case["block_tables"])
    tables[1, 0] = num_blocks  # seq_lens[1] = 5 uses entry 0
    with pytest.raises(ValueError) as info:
        paged_decode_attention(**{**case, "block_tables": mx.array(tables)}, backend="reference")
    msg = str(info.value)
    assert "block_tables[1, 0]" in msg and f"[0, {num_blocks})" in msg and f"got {num_blocks}" in msg
    tables[1, 0] = -2
    with pytest.raises(ValueError, match=r"block_tables\[1, 0\].*got -2"):
        paged_decode_attention(**{**case, "block_tables": mx.array(tables)}, backend="reference")


def test_unused_table_entries_are_not_checked():
    case = small_case()  # make_case fills entries past each length with ids past the pool
    assert int(np.array(case["block_tables"]).max()) >= case["k_pool"].shape[0]
    paged_decode_attention(**case, backend="reference")


@pytest.mark.skipif(mx.metal.is_available(), reason="checks the message on a machine without Metal")
def test_metal_backend_without_metal_raises():
    with pytest.raises(RuntimeError, match="Metal"):
        paged_decode_attention(**small_case(), backend="metal")


def test_metal_kernels_are_built_at_import():
    # construction needs no device, so a Linux import builds them too; calling needs Metal
    from kernels_metal import paged_attention

    assert not isinstance(paged_attention._METAL_KERNELS, Exception)
    pairs = [(0, 0), (4, 4), (8, 8), (8, 4), (4, 8)]  # (k_bits, v_bits)
    variants = [(k, v, False) for k, v in pairs] + [(k, v, True) for k, v in pairs if k]  # k_channel
    assert set(paged_attention._METAL_KERNELS) == {
        (k, v, k_channel, direct) for k, v, k_channel in variants for direct in (True, False)
    } | {"reduce"}


# ---------------------------------------------------------------- keys and values at different bits


@pytest.mark.parametrize("k_bits, bits", [(8, 4), (4, 8)])
def test_reference_mixed_bits_matches_naive(k_bits, bits):
    rng = np.random.default_rng(11)
    case = make_case(rng, [37, 5], Hkv=2, ratio=2, D=64, block_size=16, dtype=mx.float32, bits=bits,
                     group_size=32, k_bits=k_bits)
    assert case["k_pool"].shape[-1] == 64 * k_bits // 32 and case["v_pool"].shape[-1] == 64 * bits // 32
    assert_close(run(case, "reference"), naive_attention(case), mx.float32)


# Tiny shapes (the interpreter is slow): one single-pass case, one split-K case with GQA.
@needs_interpreter
@pytest.mark.parametrize(
    "k_bits, bits, group_size, dtype, lens, partition_size",
    [
        (8, 4, 32, mx.float32, [20], 512),
        (4, 8, 64, mx.float16, [33, 3], 16),
    ],
)
def test_interpreter_mixed_bits_matches_reference(k_bits, bits, group_size, dtype, lens, partition_size):
    rng = np.random.default_rng(12 + k_bits)
    case = make_case(rng, lens, Hkv=1, ratio=2, D=64, block_size=16, dtype=dtype, bits=bits,
                     group_size=group_size, k_bits=k_bits)
    got = run(case, "interpret", partition_size=partition_size)
    assert_close(got, run(case, "reference"), dtype)
    assert_close(got, naive_attention(case), dtype)


def mixed_case(**overrides) -> dict:
    rng = np.random.default_rng(13)
    case = make_case(rng, [20], Hkv=1, ratio=1, D=64, block_size=16, dtype=mx.float16, bits=4, group_size=32,
                     k_bits=8)
    case.update(overrides)
    return case


@pytest.mark.parametrize(
    "make, words",
    [
        (lambda: mixed_case(k_bits=3), ["k_bits", "3", "(4, 8)"]),
        (lambda: small_case(k_bits=8), ["k_bits", "None when bits is None", "8"]),
        (lambda: quant_case(k_bits=8), ["pool.k", "last dim 16", "k_bits", "8"]),  # 4-bit keys, k_bits=8
        (lambda: mixed_case(k_bits=None), ["pool.k", "last dim 8", "bits"]),  # 8-bit keys read as 4-bit
        (lambda: mixed_case(v_pool=mixed_case()["k_pool"]), ["pool.v", "last dim", "64 * 4 / 32"]),
    ],
)
def test_bad_mixed_bits_raise(make, words):
    with pytest.raises(ValueError) as info:
        paged_decode_attention(**{"backend": "reference", **make()})
    for w in words:
        assert w in str(info.value), f"{w!r} not in {str(info.value)!r}"


# ---------------------------------------------------------------- per-channel keys (KIVI)


@pytest.mark.parametrize("bits, block_size, D", [(4, 16, 64), (8, 32, 96)])
def test_quantize_channels_round_trips(bits, block_size, D):
    # the pool reference.quantize_channels writes, read back by the layout's definition (unpack_channels):
    # every token in use is within half a step of its float, and padding is never needed
    rng = np.random.default_rng(20 + bits)
    x = rng.standard_normal((3, block_size, 2, D)).astype(np.float32)
    valid = np.array([block_size, 5, 1], dtype=np.int32)
    packed, scales, biases = reference.quantize_channels(mx.array(x), mx.array(valid), bits)
    assert packed.shape == (3, block_size, 2, D * bits // 32)
    assert scales.shape == biases.shape == (3, block_size, 2, D // block_size)
    got = unpack_channels(np.array(packed), np.array(scales), np.array(biases), bits)
    for blk, n in enumerate(valid):
        step = (x[blk, :n].max(axis=0) - x[blk, :n].min(axis=0)) / ((1 << bits) - 1)  # (Hkv, D)
        assert np.all(np.abs(got[blk, :n] - x[blk, :n]) <= step / 2 + 1e-5)


@st.composite
def channel_cases(draw, max_len: int = 150, max_batch: int = 3):
    block_size = draw(st.sampled_from([16, 32]))
    D = draw(st.sampled_from([64, 96, 128]))  # 80 has no group size for the values
    ratio = draw(st.sampled_from([1, 3, 4]))
    Hkv = draw(st.sampled_from([1, 2]))
    bits = draw(st.sampled_from([4, 8]))
    k_bits = draw(st.sampled_from([None, 4, 8]))
    group_size = draw(st.sampled_from([g for g in (32, 64) if D % g == 0]))
    dtype = DTYPES[draw(st.sampled_from(list(DTYPES)))]
    edge = st.sampled_from([1, block_size - 1, block_size, block_size + 1])
    lens = draw(st.lists(st.one_of(edge, st.integers(1, max_len)), min_size=1, max_size=max_batch))
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    return make_case(rng, lens, Hkv, ratio, D, block_size, dtype, bits, group_size, k_bits=k_bits,
                     k_per_channel=True)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=channel_cases())
def test_reference_per_channel_matches_naive(case):
    assert_close(run(case, "reference"), naive_attention(case), case["q"].dtype)


def test_per_channel_keys_are_not_per_token():
    # the same pool read as per-token groups gives other keys: the tests above do tell the layouts apart
    rng = np.random.default_rng(21)
    case = make_case(rng, [40], Hkv=1, ratio=1, D=64, block_size=32, dtype=mx.float32, bits=4, group_size=32,
                     k_per_channel=True)
    assert case["k_scales"].shape == (case["k_pool"].shape[0], 32, 1, 2)  # D // block_size = D // group_size
    per_token = run({**case, "k_per_channel": False}, "reference")
    assert float(np.max(np.abs(per_token - naive_attention(case)))) > 0.1


# Both key bits with both value bits, block sizes 16 and 32 (D / block_size of 4, 2, 6 and 3), GQA 1
# and 3, float32 and float16; partial last blocks throughout, split-K where partition_size < the length.
@needs_interpreter
@pytest.mark.parametrize(
    "k_bits, bits, block_size, D, ratio, dtype, lens, partition_size",
    [
        (4, 4, 16, 64, 1, mx.float32, [1, 15, 16], 512),
        (4, 8, 32, 64, 3, mx.float16, [5, 33, 64], 32),
        (8, 4, 16, 96, 3, mx.float32, [17, 40], 16),
        (8, 8, 32, 96, 1, mx.float16, [31, 65], 512),
        (8, 8, 16, 128, 3, mx.float32, [50], 16),
        (4, 4, 32, 128, 1, mx.float16, [100, 2], 64),
    ],
)
def test_interpreter_per_channel_matches_reference(
    k_bits, bits, block_size, D, ratio, dtype, lens, partition_size
):
    rng = np.random.default_rng(30 + D + k_bits + bits)
    case = make_case(rng, lens, Hkv=2, ratio=ratio, D=D, block_size=block_size, dtype=dtype, bits=bits,
                     group_size=32, k_bits=k_bits, k_per_channel=True)
    got = run(case, "interpret", partition_size=partition_size)
    assert_close(got, run(case, "reference"), dtype)
    assert_close(got, naive_attention(case), dtype)


@needs_interpreter
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=channel_cases(max_len=70, max_batch=2), partition_size=st.sampled_from([32, 512]))
def test_interpreter_per_channel_matches_reference_random(case, partition_size):
    got = run(case, "interpret", partition_size=partition_size)
    assert_close(got, run(case, "reference"), case["q"].dtype)


@needs_interpreter
def test_interpreter_per_channel_long_split_k():
    rng = np.random.default_rng(22)
    case = make_case(rng, [1100, 30], Hkv=1, ratio=3, D=64, block_size=16, dtype=mx.float16, bits=4,
                     group_size=64, k_bits=8, k_per_channel=True)
    got = run(case, "interpret")  # 3 partitions of 512, then the reduce kernel
    assert_close(got, run(case, "reference"), mx.float16)


def channel_case(**overrides) -> dict:
    return fixed_case(23, overrides, [20], Hkv=1, ratio=1, D=64, block_size=16, dtype=mx.float16, bits=4,
                      group_size=32, k_per_channel=True)


def per_token_case(**overrides) -> dict:
    # a block size (64) that does not divide the head dim (96)
    return fixed_case(24, overrides, [20], Hkv=1, ratio=1, D=96, block_size=64, dtype=mx.float16, bits=4,
                      group_size=32)


@pytest.mark.parametrize(
    "make, error, words",
    [
        # k_scales of per-token groups (D // group_size = 2) where per-channel keys need D // block_size = 4
        (lambda: channel_case(k_scales=mx.zeros((5, 16, 1, 2), dtype=mx.float16)), ValueError,
         ["k_scales", "expected shape (5, 16, 1, 4)", "per-channel", "got (5, 16, 1, 2)"]),
        (lambda: channel_case(k_biases=mx.zeros((5, 16, 1, 2), dtype=mx.float16)), ValueError,
         ["k_biases", "(5, 16, 1, 4)", "(5, 16, 1, 2)"]),
        (lambda: channel_case(k_biases=None), ValueError, ["k_biases", "(5, 16, 1, 4)", "None"]),
        # the values stay per token
        (lambda: channel_case(v_scales=channel_case()["k_scales"]), ValueError,
         ["v_scales", "(5, 16, 1, 2)", "(5, 16, 1, 4)"]),
        (lambda: small_case(k_per_channel=True), ValueError, ["k_per_channel", "bits is None", "True"]),
        (lambda: per_token_case(k_per_channel=True), ValueError,
         ["k_per_channel needs block_size dividing the head dim", "64", "96"]),
        (lambda: channel_case(k_per_channel=1), TypeError, ["k_per_channel", "bool", "int"]),
    ],
)
def test_bad_per_channel_input_raises(make, error, words):
    with pytest.raises(error) as info:
        paged_decode_attention(**{"backend": "reference", **make()})
    for w in words:
        assert w in str(info.value), f"{w!r} not in {str(info.value)!r}"


# ---------------------------------------------------------------- the self-check


@pytest.fixture
def fresh_checks():
    """No check remembered, kernels built afresh (a test breaks them on purpose), before and after."""
    from kernels_metal import paged_attention as pa

    _backend.forget_checks()
    pa._interpret_kernels.cache_clear()
    yield
    _backend.forget_checks()
    pa._interpret_kernels.cache_clear()


class WrongKernel:
    """A kernel whose every output is off by one."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __call__(self, **kwargs):
        return [o + 1 for o in self.kernel(**kwargs)]


def test_kernel_pool_argument_is_checked():
    case = call(small_case())
    with pytest.raises(TypeError, match="pool: expected a kernels_metal.KVPool, got dict"):
        _paged_decode_attention(**{**case, "pool": {"k": case["pool"].k}}, backend="reference")


@needs_interpreter
@pytest.mark.parametrize("failure", ["compile", "numbers"])
def test_a_kernel_that_fails_its_check_gives_way_to_its_reference(failure, fresh_checks, monkeypatch):
    """On "auto", a kernel variant that does not compile, or computes wrong numbers, fails its check once; the
    reference then runs (the same result), and the failure is recorded once. Asked for by name, the kernel still
    runs, so the tests above see a broken kernel."""
    from kernels_metal import paged_attention as pa
    from kernels_metal.interpret import MetalCompileError, compiler

    monkeypatch.setenv(_backend.INTERPRET_ENV, "1")
    if failure == "compile":
        def no_compiler(*args, **kwargs):
            raise MetalCompileError("simulated: error: use of undeclared identifier 'simd_sum'")

        monkeypatch.setattr(compiler, "build_kernel", no_compiler)
    else:
        kernels = {key: WrongKernel(k) for key, k in pa._interpret_kernels().items()}
        monkeypatch.setattr(pa, "_interpret_kernels", lambda: kernels)
    case = quant_case()  # 4-bit KV, float16
    want = run(case, "reference")
    for _ in range(2):
        assert np.array_equal(run(case, "auto"), want)
    failures = _backend.failures("paged_decode_attention")
    assert len(failures) == 1
    ((kernel, backend, variant), why), = failures.items()
    assert (kernel, backend) == ("paged_decode_attention", "interpret")
    assert variant == ("mlx.core.float16", 64, 4, None, False)  # dtype, head dim, bits, key bits, keys per channel
    assert ("MetalCompileError: simulated" in why) if failure == "compile" else ("differs from the reference" in why)
    if failure == "compile":
        with pytest.raises(MetalCompileError):
            run(case, "interpret")
    else:
        assert float(np.abs(run(case, "interpret") - want).max()) > 0.5


@needs_interpreter
def test_a_sound_kernel_passes_its_check(fresh_checks, monkeypatch):
    from kernels_metal import paged_attention as pa

    monkeypatch.setenv(_backend.INTERPRET_ENV, "1")
    for dtype in (mx.float32, mx.bfloat16):
        for fmt in ({}, {"bits": 8}, {"bits": 4, "k_bits": 8}, {"bits": 4, "k_per_channel": True}):
            assert pa.self_check("interpret", dtype, 128, **fmt) is None, (dtype, fmt)
    assert _backend.failures() == {}
