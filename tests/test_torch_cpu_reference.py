"""Roofline's CPU kernel (`backends/torch/cpu_kernel/`) piece by piece against its numpy twins
(`backends/torch/cpu_reference.py`): each layout's codes and scales through `dequant` (bit for bit), the quantized
dot products through `qmatmul` (the activations' int8 rounding, each format's block dot product), the head's exact
top logits, and one layer of `forward_layers` (norms, rope, the K/V written and attended, the MLP).

It runs on any x86-64 CPU with AVX2."""

from __future__ import annotations

import math
import platform

import numpy as np
import pytest

from tests.support.torch_support import require

torch = require("torch")

from mlx_engine.backends.torch import cpu_features, cpu_native  # noqa: E402
from mlx_engine.backends.torch import cpu_reference as ref  # noqa: E402
from tests.support.torch_cpu import random_weight  # noqa: E402

pytestmark = pytest.mark.skipif(
    platform.machine().lower() not in ("x86_64", "amd64") or not cpu_features.cpu_support().packed,
    reason="Roofline's kernel is AVX2 code for x86-64")


@pytest.fixture(scope="module")
def built():
    error = cpu_native.build_error()
    assert error == "", error


def kquant_scales(N: int, K: int, bits: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two-level scales and offsets (4, 5 bits: `two_level`) or Q6_K's half-block ones (6: `halves`, no offsets)."""
    rng = np.random.default_rng(seed)
    supers = rng.uniform(1e-4, 2e-3, (N, K // 256)).astype(np.float16)
    if bits == 6:
        return cpu_native.halves(rng.integers(-128, 128, (N, K // 16)), supers), torch.empty(0)
    d = cpu_native.two_level(rng.integers(0, 64, (N, K // 32)), supers)
    return d, cpu_native.two_level(rng.integers(0, 64, (N, K // 32)), -supers)


def formats(K: int) -> list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor, int, int]]:
    """(name, codes, d, m, bits, zero) for every layout the kernel reads, N = 70 rows of K inputs."""
    out = []
    for bits in (4, 5, 8):
        for dtype in (torch.float16, torch.float32):
            for offsets in (True, False, "zero"):
                _, codes, d, m = random_weight(bits, dtype, offsets, K, N=70)
                zero = 2 ** (bits - 1) if offsets == "zero" else 0
                out.append((f"{bits}-{str(dtype)[6:]}-{offsets}", codes, d, m, bits, zero))
    if K % 256 == 0:
        g = torch.Generator().manual_seed(K)
        for bits in (4, 5, 6):
            c = torch.randint(0, 2**bits, (70, K), generator=g).numpy().astype(np.uint8)
            codes = cpu_native._pack_codes(lambda lo, hi: c[lo:hi], 70, K, bits, 0)
            d, m = kquant_scales(70, K, bits, bits)
            out.append((f"{bits}-kquant", codes, d, m, bits, 0))
    return out


@pytest.mark.parametrize("K", [96, 256, 768])
def test_dequant_is_the_layouts_reference_bit_for_bit(built, K):
    """formats.h's layouts and dequant.h: every format's rows, d (c - zero) + m in float32 rounded once to bfloat16,
    are `cpu_reference.dequant`'s."""
    for name, codes, d, m, bits, zero in formats(K):
        got = torch.ops.roofline_cpu.dequant(codes, d, m, bits, zero).float().numpy()
        want = ref.dequant(codes.numpy(), d.numpy(), m.numpy(), bits, zero)
        assert np.array_equal(got, want), name


@pytest.mark.parametrize("K", [96, 256, 576])
def test_qmatmul_is_its_reference(built, K):
    """quants.h and matvec.h: the activations rounded to int8 per block, each format's integer dot products scaled
    in float32, against `cpu_reference.qmatmul` in float64, for each row count of the kernel's 4-row blocks."""
    g = torch.Generator().manual_seed(K)
    for name, codes, d, m, bits, zero in formats(K):
        for M in (1, 2, 3, 4, 5, 9):
            x = torch.randn(M, K, generator=g) * torch.linspace(0.1, 3, K)
            x[0, :32] = 0  # a block of zeros: its scale is 0
            got = torch.ops.roofline_cpu.qmatmul(x, codes, d, m, bits, zero).double().numpy()
            want = ref.qmatmul(x.numpy(), codes.numpy(), d.numpy(), m.numpy(), bits, zero)
            assert np.abs(got - want).max() <= 4e-6 * np.abs(want).max(), (name, M)


def test_quantize_rows_rounds_half_to_even():
    """The twin's rounding, on values the kernel's vcvtps2dq meets: ties go to the even integer, a block of zeros has
    scale 0."""
    x = np.zeros((1, 64), np.float32)
    x[0, :4] = [127.0, 0.5, 1.5, -2.5]
    xq, dx = ref.quantize_rows(x)
    assert xq[0, :4].tolist() == [127, 0, 2, -2] and dx.tolist() == [[1.0, 0.0]]


def test_head_logits_is_its_reference(built):
    """qmatmul.h's head: the kernel's logits, each row's top 16 recomputed from the exact rows, against the twin."""
    g = torch.Generator().manual_seed(5)
    for name, codes, d, m, bits, zero in formats(256):
        x = torch.randn(3, 256, generator=g)
        got = torch.ops.roofline_cpu.head_logits(x, codes, d, m, bits, zero, 16).double().numpy()
        want = ref.head_logits(x.numpy(), codes.numpy(), d.numpy(), m.numpy(), bits, zero, 16)
        assert np.abs(got - want).max() <= 4e-6 * np.abs(want).max(), name


def matrix(n: int, k: int, g: torch.Generator) -> ref.Matrix:
    _, codes, d, m = random_weight(4, torch.float32, True, k, N=n)
    return ref.Matrix(codes.numpy(), (d * 0.3).numpy(), (m * 0.1).numpy(), 4)


# max |kernel - twin| / max |twin| of a layer's output: the float32 sums in another order than float64's can flip an
# activation's int8 rounding (a step of 1/127 of its block's largest value) in the projections after them
LAYER_RTOL = 1e-2


@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize("n,s", [(1, 1), (3, 9), (5, 5)])
def test_one_layer_is_its_reference(built, n, s, traditional):
    """layers.h with norm_rope.h and attention.h: one layer of `forward_layers` (decode-sized rows: its own attention
    loop, qmatmul's projections) against `cpu_reference.layer`, and the K/V it wrote."""
    H, Hq, Hkv, D, inter, slots = 64, 4, 2, 16, 96, 32
    g = torch.Generator().manual_seed(n * 10 + s)
    qkv, o, gate_up, down = matrix((Hq + 2 * Hkv) * D, H, g), matrix(H, Hq * D, g), matrix(2 * inter, H, g), \
        matrix(H, inter, g)
    in_norm, post_norm = (1 + 0.1 * torch.randn(H, generator=g) for _ in range(2))
    h = torch.randn(n, H, generator=g)
    pool_k, pool_v = (torch.randn(slots, Hkv, D, generator=g) for _ in range(2))
    where = torch.randperm(slots, generator=g)[:s]
    write, gather = where[s - n:].contiguous(), where[None].expand(n, s).contiguous()
    visible = torch.arange(s)[None, :] <= torch.arange(s - n, s)[:, None]
    bias = torch.zeros(n, s).masked_fill_(~visible, -math.inf)
    angles = torch.arange(s - n, s)[:, None].float() * torch.rand(D // 2, generator=g)
    cos, sin = angles.cos(), angles.sin()
    empty = torch.empty(0)
    ws = [in_norm, post_norm, empty, empty, empty, empty, empty]
    meta = [1, 1, 0, Hq * D, (Hq + Hkv) * D, 0, inter, inter]
    for w in (qkv, o, gate_up, down):
        ws += [torch.from_numpy(w.codes), torch.from_numpy(w.d), torch.from_numpy(w.m)]
        meta += [w.bits, w.zero]
    eps, scale = 1e-5, D**-0.5
    mine_k, mine_v = pool_k.clone(), pool_v.clone()
    got = torch.ops.roofline_cpu.forward_layers(h, ws, meta, [mine_k], [mine_v], [write], [gather], [bias], cos, sin,
                                                Hq, Hkv, D, eps, scale, 1.0, traditional, 2**62, 2**21, 48).numpy()
    twin_k, twin_v = pool_k.double().numpy(), pool_v.double().numpy()
    want = ref.layer(h.numpy(), in_norm.numpy(), post_norm.numpy(), qkv, o, gate_up, down, twin_k, twin_v,
                     write.numpy(), gather.numpy(), bias.numpy(), cos.numpy(), sin.numpy(), Hq, Hkv, D, eps, scale,
                     traditional=traditional)
    assert np.abs(got - want).max() <= LAYER_RTOL * np.abs(want).max()
    for mine, twin in ((mine_k, twin_k), (mine_v, twin_v)):
        assert np.abs(mine.numpy() - twin).max() <= 1e-4 * np.abs(twin).max()
