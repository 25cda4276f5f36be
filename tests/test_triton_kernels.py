"""The torch backend's Triton kernels against their references, run by Triton's CPU interpreter.

Triton 3.9 reads TRITON_INTERPRET at each `@triton.jit` decoration. `triton_kernels` decorates its
kernels on first use, once per mode, and calls none of triton.language's own jit'd helpers (those are
decorated at `import triton`, which here happens before the variable is set: that is the case this
file exercises). So a fixture sets it for this module only; a module-level setting would leak into
every later test in the process and send the torch runner's CPU tests through the interpreter.
Every kernel test asserts that the kernel ran (`launch_counts`), not the torch fallback.

Tolerances: attention in float32 differs from the reference only by summation order (5e-6 abs on
unit-scale outputs); dequant_matmul in float32 by at most 1e-5 * (|x| @ |W|.T), the scale of the
terms; float16/bfloat16 outputs add a few ulp of the output dtype (W is rounded to x's dtype, and
the interpreter rounds float32 -> bfloat16 by truncation).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from tests.torch_support import require

torch = require("torch")
require("triton")

from mlx_engine.backends.torch import triton_kernels as tk  # noqa: E402
from tests.tolerance import assert_f32_close  # noqa: E402

mx = pytest.importorskip("mlx.core")


@pytest.fixture(autouse=True, scope="module")
def interpret():
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    yield
    if old is None:
        del os.environ["TRITON_INTERPRET"]
    else:
        os.environ["TRITON_INTERPRET"] = old


class launched:
    """Asserts that `name`'s Triton kernel was launched `n` times inside the block."""

    def __init__(self, name: str, n: int = 1):
        self.name, self.n = name, n

    def __enter__(self):
        self.before = tk.launch_counts[self.name]

    def __exit__(self, *exc):
        if exc[0] is None:
            assert tk.launch_counts[self.name] - self.before == self.n, f"{self.name}: Triton path not taken"


def test_kernels_are_interpreted():
    from triton.runtime.interpreter import InterpretedFunction

    assert tk.triton_available()
    assert all(isinstance(k, InterpretedFunction) for k in tk._kernels(True).values())


# ---------------------------------------------------------------------------------------------
# paged decode attention


def make_paged(seq_lens, Hq, Hkv, D, block_size, dtype=torch.float32, seed=0, pad_blocks=2):
    """Dense per-sequence K/V scattered into a pool through shuffled block tables; returns the
    dense K/V too, for the independent check. Tables padded with valid ids past each sequence."""
    g = torch.Generator().manual_seed(seed)
    B = len(seq_lens)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    max_blocks = max(blocks_per_seq) + pad_blocks
    num_blocks = sum(blocks_per_seq) + 3  # spare blocks hold garbage the kernel must not read
    perm = torch.randperm(num_blocks, generator=g)
    k_pool = torch.randn(num_blocks * block_size, Hkv, D, generator=g).to(dtype) * 100  # garbage
    v_pool = torch.randn(num_blocks * block_size, Hkv, D, generator=g).to(dtype) * 100
    tables = torch.full((B, max_blocks), int(perm[-1]), dtype=torch.int32)
    dense_k, dense_v, used = [], [], 0
    for b, n in enumerate(seq_lens):
        ids = perm[used : used + blocks_per_seq[b]]
        used += blocks_per_seq[b]
        tables[b, : len(ids)] = ids.int()
        k = torch.randn(n, Hkv, D, generator=g).to(dtype)
        v = torch.randn(n, Hkv, D, generator=g).to(dtype)
        slots = (ids[:, None] * block_size + torch.arange(block_size)).reshape(-1)[:n]
        k_pool[slots], v_pool[slots] = k, v
        dense_k.append(k)
        dense_v.append(v)
    q = torch.randn(B, Hq, D, generator=g).to(dtype)
    return q, k_pool, v_pool, tables, torch.tensor(seq_lens, dtype=torch.int32), dense_k, dense_v


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("Hq,Hkv", [(2, 2), (4, 2), (8, 2)])
def test_paged_attention_matches_reference_and_dense(Hq, Hkv, block_size):
    D = 32
    seq_lens = [1, block_size + 3, 2 * block_size]  # one token; a partial last block; full blocks only
    q, k_pool, v_pool, tables, lens, dense_k, dense_v = make_paged(seq_lens, Hq, Hkv, D, block_size)
    scale = D**-0.5
    with launched("paged_decode_attention"):
        out = tk.paged_decode_attention(q, k_pool, v_pool, tables, lens, scale, block_size)
    ref = tk.paged_decode_attention_ref(q, k_pool, v_pool, tables, lens, scale, block_size)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out, ref, atol=5e-6, rtol=0)
    for b in range(len(seq_lens)):  # independent: softmax(q K^T) V on the dense, never-paged K/V
        k = dense_k[b].double().repeat_interleave(Hq // Hkv, dim=1).transpose(0, 1)  # (Hq, n, D)
        v = dense_v[b].double().repeat_interleave(Hq // Hkv, dim=1).transpose(0, 1)
        p = torch.softmax(q[b].double()[:, None, :] @ k.transpose(1, 2) * scale, dim=-1)  # (Hq, 1, n)
        torch.testing.assert_close(out[b].double(), (p @ v)[:, 0], atol=5e-6, rtol=0)


@pytest.mark.parametrize("partition_size", [16, 32])
def test_paged_attention_split_partitions(partition_size):
    # FlashDecoding split: several partitions per sequence, some empty for the short sequences
    q, k_pool, v_pool, tables, lens, _, _ = make_paged([1, 20, 70], 4, 1, 16, 16, pad_blocks=1, seed=1)
    with launched("paged_decode_attention"):
        out = tk.paged_decode_attention(q, k_pool, v_pool, tables, lens, 0.25, 16, partition_size=partition_size)
    ref = tk.paged_decode_attention_ref(q, k_pool, v_pool, tables, lens, 0.25, 16)
    torch.testing.assert_close(out, ref, atol=5e-6, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_paged_attention_half(dtype):
    q, k_pool, v_pool, tables, lens, _, _ = make_paged([5, 40], 4, 2, 64, 16, dtype=dtype, seed=2)
    with launched("paged_decode_attention"):
        out = tk.paged_decode_attention(q, k_pool, v_pool, tables, lens, 0.125, 16)
    ref = tk.paged_decode_attention_ref(q, k_pool, v_pool, tables, lens, 0.125, 16)
    assert out.dtype == dtype
    ulp = 2.0**-10 if dtype == torch.float16 else 2.0**-7
    torch.testing.assert_close(out.float(), ref.float(), atol=2 * ulp, rtol=0)


def test_paged_attention_cpu_without_interpreter_uses_reference(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k_pool, v_pool, tables, lens, _, _ = make_paged([3, 17], 2, 1, 16, 16)
    with launched("paged_decode_attention", 0):
        out = tk.paged_decode_attention(q, k_pool, v_pool, tables, lens, 0.25, 16)
    assert torch.equal(out, tk.paged_decode_attention_ref(q, k_pool, v_pool, tables, lens, 0.25, 16))


def test_paged_attention_bad_arguments():
    q, k_pool, v_pool, tables, lens, _, _ = make_paged([3, 17], 4, 2, 16, 16)
    call = tk.paged_decode_attention
    with pytest.raises(ValueError, match=r"q: expected shape \(B, Hq, D\)"):
        call(q[0], k_pool, v_pool, tables, lens, 0.25, 16)
    k3, v3 = torch.zeros(32, 3, 16), torch.zeros(32, 3, 16)
    with pytest.raises(ValueError, match="Hq=4 must be a multiple of k_pool's Hkv=3"):
        call(q, k3, v3, tables, lens, 0.25, 16)
    with pytest.raises(ValueError, match=r"block_size=8: expected one of \(16, 32\)"):
        call(q, k_pool, v_pool, tables, lens, 0.25, 8)
    with pytest.raises(ValueError, match="num_slots=.* is not a multiple of block_size=32"):
        call(q, k_pool[:-16], v_pool[:-16], tables, lens, 0.25, 32)
    with pytest.raises(ValueError, match=r"block_tables: expected int32 of shape \(2, max_blocks\)"):
        call(q, k_pool, v_pool, tables.long(), lens, 0.25, 16)
    with pytest.raises(ValueError, match=r"seq_lens: expected int32 of shape \(2,\)"):
        call(q, k_pool, v_pool, tables, lens[:1], 0.25, 16)
    with pytest.raises(ValueError, match=r"v_pool: expected shape"):
        call(q, k_pool, v_pool[:, :1], tables, lens, 0.25, 16)
    with pytest.raises(ValueError, match="partition_size=24: expected a multiple of block_size=16"):
        call(q, k_pool, v_pool, tables, lens, 0.25, 16, partition_size=24)


# ---------------------------------------------------------------------------------------------
# affine-quantized matmul, against MLX's own quantizer and dequantizer


def mlx_quantized(out_features, in_features, bits, group_size, seed=0):
    """(w_packed int32, scales, biases, W) from mx.quantize of a random W; W = mx.dequantize."""
    mx.random.seed(seed)
    w = mx.random.normal((out_features, in_features))
    wq, s, b = mx.quantize(w, group_size=group_size, bits=bits)
    deq = mx.dequantize(wq, s, b, group_size=group_size, bits=bits)
    as_torch = lambda a: torch.from_numpy(np.array(a))  # noqa: E731
    return torch.from_numpy(np.array(wq).view(np.int32)), as_torch(s), as_torch(b), as_torch(deq)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_dequantize_ref_equals_mx_dequantize(bits, group_size):
    wq, s, b, deq = mlx_quantized(24, 256, bits, group_size)
    assert torch.equal(tk.dequantize_ref(wq, s, b, bits, group_size), deq)
    assert torch.equal(tk.dequantize_ref(wq.view(torch.uint32), s, b, bits, group_size), deq)  # uint32 too


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64])
@pytest.mark.parametrize("M", [1, 5])
def test_dequant_matmul_float32(bits, group_size, M):
    wq, s, b, deq = mlx_quantized(40, 192, bits, group_size, seed=bits + group_size)  # N not a tile multiple
    x = torch.randn(M, 192, generator=torch.Generator().manual_seed(M))
    with launched("dequant_matmul"):
        y = tk.dequant_matmul(x, wq, s, b, bits, group_size)
    exact = x.double() @ deq.double().T
    bound = 1e-5 * (x.abs().double() @ deq.abs().double().T)
    assert y.shape == (M, 40) and y.dtype == torch.float32
    assert ((y.double() - exact).abs() <= bound).all(), f"maxdiff {(y.double() - exact).abs().max():.3g}"


@pytest.mark.parametrize("ggml_type", ["Q6_K", "Q4_K", "Q3_K"])
def test_dequant_matmul_reads_kquants_as_affine_groups(ggml_type):
    """k-quant sub-blocks as affine groups of 16 (Q6_K, Q3_K) or 32 (Q4_K), float32 scales
    (`quant.kquant.kquant_affine`), through the kernel: the k-quant's own matmul."""
    from kernels_metal.reference import dequantize_kquant
    from quant.kquant import kquant_affine
    from quant.mlx_layout import pack_codes
    from tests.tiny_models import random_blocks

    blocks = mx.array(random_blocks(np.random.default_rng(5), ggml_type, 24, 512, std=0.05))
    q, sc, bi, bits, group = kquant_affine(np.array(blocks), ggml_type, 24, 512)
    wq = torch.from_numpy(pack_codes(q, bits).view(np.int32))
    s, b = torch.from_numpy(np.array(sc)), torch.from_numpy(np.array(bi))
    deq = torch.from_numpy(np.array(dequantize_kquant(blocks, ggml_type, 24, 512)))
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(1))
    with launched("dequant_matmul"):
        y = tk.dequant_matmul(x, wq, s, b, bits, group)
    exact = x.double() @ deq.double().T
    bound = 1e-5 * (x.abs().double() @ deq.abs().double().T)
    assert ((y.double() - exact).abs() <= bound).all(), f"maxdiff {(y.double() - exact).abs().max():.3g}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("M", [1, 20])
def test_dequant_matmul_half(dtype, M):
    wq, s, b, _ = mlx_quantized(48, 128, 4, 64, seed=3)
    s, b = s.to(dtype), b.to(dtype)
    x = torch.randn(M, 128, generator=torch.Generator().manual_seed(7)).to(dtype)
    with launched("dequant_matmul"):
        y = tk.dequant_matmul(x, wq, s, b, 4, 64)
    w = tk.dequantize_ref(wq, s, b, 4, 64)  # in dtype, as the kernel's W tiles
    exact = x.double() @ w.double().T
    ulp = 2.0**-10 if dtype == torch.float16 else 2.0**-7
    # W tiles: fma then one rounding vs torch's two roundings (<= 1 ulp of |W|); output: <= 1 ulp
    bound = ulp * (x.abs().double() @ w.abs().double().T) + ulp * exact.abs() + 1e-6
    assert y.dtype == dtype
    assert ((y.double() - exact).abs() <= bound).all(), f"maxdiff {(y.double() - exact).abs().max():.3g}"


def test_dequant_matmul_cpu_without_interpreter_uses_reference(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    wq, s, b, deq = mlx_quantized(8, 64, 4, 32)
    x = torch.randn(2, 64)
    with launched("dequant_matmul", 0):
        y = tk.dequant_matmul(x, wq, s, b, 4, 32)
    torch.testing.assert_close(y, x @ deq.T, atol=1e-5, rtol=1e-5)


def test_dequant_matmul_bad_arguments():
    wq, s, b, _ = mlx_quantized(8, 64, 4, 32)
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match=r"bits=3: expected one of \(4, 8\)"):
        tk.dequant_matmul(x, wq, s, b, 3, 32)
    with pytest.raises(ValueError, match=r"group_size=8: expected one of \(16, 32, 64, 128\)"):
        tk.dequant_matmul(x, wq, s, b, 4, 8)
    with pytest.raises(ValueError, match=r"w_packed: expected int32 .* or uint32, got torch.int64"):
        tk.dequant_matmul(x, wq.long(), s, b, 4, 32)
    with pytest.raises(ValueError, match=r"scales: expected shape \(8, 2\)"):
        tk.dequant_matmul(x, wq, s[:, :1], b, 4, 32)
    with pytest.raises(ValueError, match=r"x: expected shape \(M, 64\), got \(2, 32\)"):
        tk.dequant_matmul(x[:, :32], wq, s, b, 4, 32)
    with pytest.raises(ValueError, match=r"x: expected shape \(M, 64\), got \(64,\)"):
        tk.dequant_matmul(x[0], wq, s, b, 4, 32)


# ---------------------------------------------------------------------------------------------
# GGUF


@pytest.mark.parametrize("ggml_type", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_affine_repack_is_exact_through_the_kernel(ggml_type):
    """The loader's repack of GGUF blocks (`quant.affine.affine_from_gguf`), float32 scales, read by
    dequant_matmul: exactly gguf's dequantized weights."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    from quant.affine import affine_from_gguf

    w = np.random.default_rng(0).standard_normal((6, 96)).astype(np.float32)
    raw = quantize(w, GGMLQuantizationType[ggml_type])
    words, s, b, bits = affine_from_gguf(raw, ggml_type, (6, 96))
    wq, s, b = torch.from_numpy(words.view(np.int32)), torch.from_numpy(s), torch.from_numpy(b)
    want = torch.from_numpy(dequantize(raw, GGMLQuantizationType[ggml_type]).reshape(6, 96))
    assert torch.equal(tk.dequantize_ref(wq, s, b, bits, 32), want)
    x = torch.randn(3, 96)
    with launched("dequant_matmul"):
        y = tk.dequant_matmul(x, wq, s, b, bits, 32)
    torch.testing.assert_close(y, x @ want.T, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"bytes do not hold a .* tensor of shape \(6, 64\)"):
        affine_from_gguf(raw, ggml_type, (6, 64))
    with pytest.raises(ValueError, match="ggml_type='Q4_K': expected one of"):
        affine_from_gguf(np.zeros(144, np.uint8), "Q4_K", (1, 256))


def test_module_imports_and_falls_back_without_triton():
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "from mlx_engine.backends.torch import triton_kernels as tk\n"
        "assert not tk.triton_available()\n"
        "w = torch.zeros(4, 8, dtype=torch.int32); s = torch.ones(4, 2); b = torch.zeros(4, 2)\n"
        "y = tk.dequant_matmul(torch.ones(1, 64), w, s, b, 4, 32)\n"
        "assert y.shape == (1, 4) and not tk.launch_counts\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=os.path.dirname(os.path.dirname(__file__)))


# --- the fused elementwise kernels: rms_norm, rope, silu_mul -----------------------------------------

# float32: summation order alone. Half dtypes: two ulps of the output. The references round at the same
# points, so only float32 differences that straddle a rounding boundary remain, twice where a rounded
# value is multiplied again; the interpreter also truncates float32 -> bfloat16.
ULP = {torch.float32: 2e-6, torch.float16: 2 * 2**-10, torch.bfloat16: 2 * 2**-7}


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    err = (got.float() - want.float()).abs()
    assert float((err / want.float().abs().clamp_min(1.0)).max()) <= ULP[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("H, weight_float32", [(96, False), (576, False), (64, True)])
def test_rms_norm_matches_reference(dtype, H, weight_float32):
    g = torch.Generator().manual_seed(H)
    x = (torch.randn(7, 3, H, generator=g) * 3).to(dtype)
    w = (torch.rand(H, generator=g) + 0.5).to(torch.float32 if weight_float32 else dtype)
    with launched("rms_norm"):
        got = tk.rms_norm(x, w, 1e-5)
    close(got, tk.rms_norm_ref(x, w, 1e-5), dtype)
    assert got.dtype == (torch.float32 if weight_float32 else dtype)  # torch's promotion
    with launched("rms_norm"):  # rows that are not contiguous in memory
        got = tk.rms_norm(x.transpose(0, 1), w, 1e-5)
    close(got, tk.rms_norm_ref(x.transpose(0, 1), w, 1e-5), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("traditional, mscale, D", [(False, 1.0, 64), (True, 1.0, 32), (False, 1.25, 128)])
def test_rope_matches_reference(dtype, traditional, mscale, D):
    from mlx_engine.backends.torch.model import RoPE

    B, L, H = 2, 5, 3
    g = torch.Generator().manual_seed(D)
    rope = RoPE(D, 10000.0, None, 4096, traditional=traditional)
    cos, sin = rope.angles(torch.tensor([[0, 1, 2, 3, 4], [100, 101, 102, 103, 2000]]))
    x = torch.randn(B, L, H, D, generator=g).to(dtype).transpose(1, 2)  # (B, H, L, D), as the projections give
    with launched("rope"):
        got = tk.rope(x, cos, sin, mscale, traditional)
    assert got.is_contiguous()
    close(got, tk.rope_ref(x, cos, sin, mscale, traditional), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_silu_mul_matches_reference(dtype):
    g = torch.Generator().manual_seed(1)
    gate, up = (torch.randn(3, 1100, generator=g) * 4).to(dtype), torch.randn(3, 1100, generator=g).to(dtype)
    with launched("silu_mul"):
        got = tk.silu_mul(gate, up)
    close(got, tk.silu_mul_ref(gate, up), dtype)


def test_fused_kernels_bad_arguments_and_cpu_fallback(monkeypatch):
    x = torch.randn(2, 3, 4, 8)
    cos = sin = torch.zeros(2, 1, 4, 4)
    with pytest.raises(ValueError, match="rms_norm: x torch.float32 \\(2, 3, 4, 8\\) and weight \\(7,\\)"):
        tk.rms_norm(x, torch.ones(7), 1e-5)
    with pytest.raises(ValueError, match="rope: x \\(2, 3, 4, 8\\), cos \\(2, 1, 4, 3\\)"):
        tk.rope(x, cos[..., :3], sin[..., :3])
    with pytest.raises(ValueError, match="float32 cos/sin"):
        tk.rope(x, cos.half(), sin.half())
    with pytest.raises(ValueError, match="silu_mul: gate"):
        tk.silu_mul(x, x[..., :4])
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # CPU tensors without the interpreter: the references
    with launched("rms_norm", 0), launched("rope", 0), launched("silu_mul", 0):
        assert torch.equal(tk.rms_norm(x, torch.ones(8), 1e-5), tk.rms_norm_ref(x, torch.ones(8), 1e-5))
        assert torch.equal(tk.rope(x, cos, sin), tk.rope_ref(x, cos, sin, 1.0, False))
        assert torch.equal(tk.silu_mul(x, x), tk.silu_mul_ref(x, x))


def test_model_through_the_fused_kernels_equals_the_references(monkeypatch):
    """The tiny golden llama with its layer's norms, rope and gate through the kernels (interpreted here, as
    CUDA runs them) gives the logits of the torch references."""
    from mlx_engine import Engine
    from tests.tiny_models import GOLDEN

    ids = [3, 17, 42, 99, 7, 64, 120, 5, 9]
    with Engine.load(str(GOLDEN / "llama"), backend="torch", device="cpu") as engine:
        with launched("rms_norm", 2 * 2 + 1), launched("rope", 2 * 2), launched("silu_mul", 2):
            fused = engine.forward_logits(ids)
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        ref = engine.forward_logits(ids)
    # float32 floor: 5.7 units (tests/tolerance.py) on an AMD EPYC; x4 headroom
    assert_f32_close(fused, ref, 24, "fused vs references")
