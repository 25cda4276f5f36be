"""Triton kernels of the torch backend, each beside its plain-torch reference.

- `paged_decode_attention`: one query token per sequence against K/V read through a block table
  (vLLM's paged attention; FlashDecoding's split over the sequence when there are few programs).
- `dequant_matmul`: x @ W.T with W in MLX's affine quantized format (`mx.quantize`), dequantized
  tile by tile in registers, accumulated in float32.
- `rms_norm`, `rope`, `silu_mul`: a decoder layer's elementwise work, one kernel each where torch launches
  8 (a norm), 9 (rope of q or k) and 2 (the MLP's gate): a decode step of a small model is bound by its
  kernel count, not by bytes (docs/benchmarks.md, the H200 check).

GGUF Q4_0 / Q4_1 / Q8_0 weights reach the kernel in that affine format (the loader's exact repack,
`loading.gguf_tensors.affine_from_gguf`, or MLX's own); k-quants arrive dequantized at load.

Dispatch: the Triton kernel runs when the tensors are on CUDA, or when TRITON_INTERPRET=1 and
triton is importable (Triton's CPU interpreter, for tests); otherwise the torch reference, so CPU
users get the same numbers. Triton reads TRITON_INTERPRET when a kernel is decorated, so kernels
are built on first use, once per mode. The wrappers never sync the host (CUDA-graph safe).
"""

from __future__ import annotations

import os
from collections import Counter
from functools import cache
from typing import Any

import torch

try:
    import triton
    import triton.language as tl
except Exception:  # triton is optional: the references serve
    triton = tl = None  # type: ignore[assignment]

SUPPORTED_BITS = (4, 8)
SUPPORTED_GROUP_SIZES = (16, 32, 64, 128)  # 16: the sub-blocks of Q2_K, Q3_K, Q6_K
SUPPORTED_BLOCK_SIZES = (16, 32)
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_LOG2E = 1.4426950408889634

# kernel launches by name; tests read it to prove the Triton path (not the fallback) ran
launch_counts: Counter[str] = Counter()


def triton_available() -> bool:
    """True when triton imports (it may still have no GPU: see `_use_triton`)."""
    return triton is not None


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def _use_triton(*tensors: torch.Tensor) -> bool:
    if not triton_available():
        return False
    return _interpreting() or all(t.is_cuda for t in tensors)


# ---------------------------------------------------------------------------------------------
# paged decode attention


def _check_attention_args(q, k_pool, v_pool, block_tables, seq_lens, block_size) -> None:
    if q.dim() != 3:
        raise ValueError(f"q: expected shape (B, Hq, D), got {tuple(q.shape)}")
    if q.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"q: expected float32/float16/bfloat16, got {q.dtype}")
    B, Hq, D = q.shape
    if k_pool.dim() != 3 or k_pool.shape[2] != D:
        raise ValueError(f"k_pool: expected shape (num_slots, Hkv, {D}), got {tuple(k_pool.shape)}")
    if v_pool.shape != k_pool.shape:
        raise ValueError(f"v_pool: expected shape {tuple(k_pool.shape)} like k_pool, got {tuple(v_pool.shape)}")
    if k_pool.dtype not in _FLOAT_DTYPES or v_pool.dtype != k_pool.dtype:
        raise ValueError(f"k_pool/v_pool: expected one float dtype, got {k_pool.dtype} and {v_pool.dtype}")
    Hkv = k_pool.shape[1]
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"q: Hq={Hq} must be a multiple of k_pool's Hkv={Hkv} (grouped-query attention)")
    if D & (D - 1) or not 8 <= D <= 256:
        raise ValueError(f"q: head dim D={D}: expected a power of two in [8, 256]")
    if block_size not in SUPPORTED_BLOCK_SIZES:
        raise ValueError(f"block_size={block_size!r}: expected one of {SUPPORTED_BLOCK_SIZES}")
    if k_pool.shape[0] % block_size:
        raise ValueError(f"k_pool: num_slots={k_pool.shape[0]} is not a multiple of block_size={block_size}")
    if block_tables.dim() != 2 or block_tables.shape[0] != B or block_tables.dtype != torch.int32:
        raise ValueError(f"block_tables: expected int32 of shape ({B}, max_blocks), "
                         f"got {block_tables.dtype} {tuple(block_tables.shape)}")
    if seq_lens.shape != (B,) or seq_lens.dtype != torch.int32:
        raise ValueError(f"seq_lens: expected int32 of shape ({B},), got {seq_lens.dtype} {tuple(seq_lens.shape)}")
    for name, t in (("k_pool", k_pool), ("v_pool", v_pool), ("block_tables", block_tables), ("seq_lens", seq_lens)):
        if t.device != q.device:
            raise ValueError(f"{name}: on {t.device}, expected q's device {q.device}")


def paged_decode_attention_ref(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, scale: float, block_size: int,
) -> torch.Tensor:
    """The reference: gather each sequence's keys and values through its block table, softmax in
    float32. Same contract as `paged_decode_attention`; syncs the host (reads seq_lens)."""
    _check_attention_args(q, k_pool, v_pool, block_tables, seq_lens, block_size)
    B, Hq, D = q.shape
    group = Hq // k_pool.shape[1]
    out = torch.empty_like(q)
    offsets = torch.arange(block_size, device=q.device)
    for b, n in enumerate(seq_lens.tolist()):
        blocks = block_tables[b, : -(-n // block_size)].long()
        slots = (blocks[:, None] * block_size + offsets).reshape(-1)[:n]  # (n,)
        k = k_pool[slots].float().repeat_interleave(group, dim=1)  # (n, Hq, D)
        v = v_pool[slots].float().repeat_interleave(group, dim=1)
        s = torch.einsum("hd,thd->ht", q[b].float(), k) * scale  # (Hq, n)
        out[b] = torch.einsum("ht,thd->hd", torch.softmax(s, dim=-1), v).to(q.dtype)
    return out


def paged_decode_attention(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, scale: float, block_size: int, *, partition_size: int | None = None,
) -> torch.Tensor:
    """softmax(q K^T * scale) V for one query token per sequence, K/V read through block tables.

    q (B, Hq, D); k_pool, v_pool (num_slots, Hkv, D), slot = block_id * block_size + offset;
    block_tables (B, max_blocks) int32, entries past a sequence's blocks any valid id; seq_lens (B,)
    int32, each >= 1; Hq % Hkv == 0 (query head h reads kv head h // (Hq // Hkv)). Returns
    (B, Hq, D) in q's dtype; float32 online softmax. `partition_size` (tokens, a multiple of
    block_size) splits each sequence across programs (FlashDecoding); None picks by occupancy.
    """
    _check_attention_args(q, k_pool, v_pool, block_tables, seq_lens, block_size)
    if not _use_triton(q, k_pool, v_pool, block_tables, seq_lens):
        return paged_decode_attention_ref(q, k_pool, v_pool, block_tables, seq_lens, scale, block_size)
    B, Hq, D = q.shape
    Hkv = k_pool.shape[1]
    group = Hq // Hkv
    max_blocks = block_tables.shape[1]
    if partition_size is None:
        # few (sequence, kv head) programs and long tables: split to fill the GPU
        few = B * Hkv < 128 and not _interpreting()
        partition_size = 512 if few and max_blocks * block_size > 1024 else max_blocks * block_size
    if partition_size < block_size or partition_size % block_size:
        raise ValueError(f"partition_size={partition_size}: expected a multiple of block_size={block_size}")
    blocks_per_part = partition_size // block_size
    num_parts = max(1, -(-max_blocks // blocks_per_part))
    q, k_pool, v_pool = q.contiguous(), k_pool.contiguous(), v_pool.contiguous()
    block_tables, seq_lens = block_tables.contiguous(), seq_lens.contiguous()
    out = torch.empty_like(q)
    split = num_parts > 1
    if split:
        m_part = torch.empty((B, Hq, num_parts), device=q.device, dtype=torch.float32)
        l_part = torch.empty_like(m_part)
        acc_part = torch.empty((B, Hq, num_parts, D), device=q.device, dtype=torch.float32)
    else:  # unused by the kernel when SPLIT is False
        m_part = l_part = acc_part = out
    k = _kernels(_interpreting())
    k["_paged_decode"][(B, Hkv, num_parts)](
        q, k_pool, v_pool, block_tables, seq_lens, out, m_part, l_part, acc_part,
        float(scale) * _LOG2E, max_blocks, num_parts,
        GROUP=group, GROUP_P=_next_pow2(group), D=D, BLOCK_SIZE=block_size,
        BLOCKS_PER_PART=blocks_per_part, SPLIT=split,
        num_warps=4 if _next_pow2(group) * block_size * D <= 8192 else 8,  # (GP, BS, D) products in registers
    )
    launch_counts["paged_decode_attention"] += 1
    if split:
        k["_paged_combine"][(B, Hq)](m_part, l_part, acc_part, out, num_parts,
                                    NUM_PARTS_P=_next_pow2(num_parts), D=D)
    return out


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


# ---------------------------------------------------------------------------------------------
# affine-quantized matmul (MLX's format)


def _as_int32_words(w_packed: torch.Tensor) -> torch.Tensor:
    if w_packed.dtype == torch.int32:
        return w_packed
    if w_packed.dtype == torch.uint32:
        return w_packed.view(torch.int32)
    raise ValueError(f"w_packed: expected int32 (uint32 words viewed as int32) or uint32, got {w_packed.dtype}")


def _check_quant_args(w_packed, scales, biases, bits, group_size) -> tuple[int, int]:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits={bits!r}: expected one of {SUPPORTED_BITS}")
    if group_size not in SUPPORTED_GROUP_SIZES:
        raise ValueError(f"group_size={group_size!r}: expected one of {SUPPORTED_GROUP_SIZES}")
    if w_packed.dim() != 2:
        raise ValueError(f"w_packed: expected shape (out, in * bits / 32), got {tuple(w_packed.shape)}")
    _as_int32_words(w_packed)
    out_features, in_features = w_packed.shape[0], w_packed.shape[1] * 32 // bits
    want = (out_features, in_features // group_size)
    for name, t in (("scales", scales), ("biases", biases)):
        if tuple(t.shape) != want:
            raise ValueError(f"{name}: expected shape {want} (out, in / group_size) for w_packed "
                             f"{tuple(w_packed.shape)} at bits={bits}, got {tuple(t.shape)}")
        if t.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"{name}: expected float32/float16/bfloat16, got {t.dtype}")
    return out_features, in_features


def dequantize_ref(
    w_packed: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor, bits: int, group_size: int
) -> torch.Tensor:
    """W (out, in) = q * scale + bias from MLX's affine format, in scales' dtype (as `mx.dequantize`).

    w_packed (out, in * bits / 32): 32 / bits values per 32-bit word, lowest bits first; int32
    (the uint32 words' bits) or uint32. scales, biases (out, in / group_size).
    """
    out_features, in_features = _check_quant_args(w_packed, scales, biases, bits, group_size)
    words = _as_int32_words(w_packed)
    shifts = torch.arange(0, 32, bits, device=words.device, dtype=torch.int32)
    q = (words[:, :, None] >> shifts) & ((1 << bits) - 1)  # (out, in / per_word, per_word)
    q = q.reshape(out_features, in_features // group_size, group_size).to(scales.dtype)
    w = q * scales[:, :, None] + biases[:, :, None]
    return w.reshape(out_features, in_features)


def _dequant_matmul_ref(x, w_packed, scales, biases, bits, group_size) -> torch.Tensor:
    w = dequantize_ref(w_packed, scales, biases, bits, group_size).float()
    return (x.float() @ w.T).to(x.dtype)


def dequant_matmul(
    x: torch.Tensor, w_packed: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor,
    bits: int, group_size: int,
) -> torch.Tensor:
    """x @ W.T, W = dequantize_ref(w_packed, scales, biases, bits, group_size), float32 accumulation.

    x (M, in) float32/float16/bfloat16 -> (M, out) in x's dtype. w_packed int32 (preferred: the
    uint32 words of `mx.quantize` viewed as int32, e.g. `torch.from_numpy(np.array(wq).view(np.int32))`)
    or uint32. float32 x multiplies in IEEE float32; float16/bfloat16 x multiplies W rounded to x's
    dtype (as MLX does with float16 scales), still accumulating in float32.
    """
    out_features, in_features = _check_quant_args(w_packed, scales, biases, bits, group_size)
    if x.dim() != 2 or x.shape[1] != in_features:
        raise ValueError(f"x: expected shape (M, {in_features}), got {tuple(x.shape)}")
    if x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"x: expected float32/float16/bfloat16, got {x.dtype}")
    if not _use_triton(x, w_packed, scales, biases):
        return _dequant_matmul_ref(x, w_packed, scales, biases, bits, group_size)
    M = x.shape[0]
    words = _as_int32_words(w_packed).contiguous()
    scales, biases = scales.contiguous(), biases.contiguous()
    y = torch.empty((M, out_features), device=x.device, dtype=x.dtype)
    if M == 0:
        return y
    block_m = 16 if M <= 16 else 32 if M <= 32 else 64
    block_n = 32 if M <= 16 else 64
    # float32 tiles of 64 x 128 with their scales and biases took 245 KB of shared memory in Triton's
    # 3-stage pipeline on an H200 (limit 227 KB): float32 steps K by 64
    wide = 64 if x.dtype == torch.float32 else 128
    block_k = wide if in_features % wide == 0 else 64 if in_features % 64 == 0 else 32
    grid = (triton.cdiv(M, block_m), triton.cdiv(out_features, block_n))
    _kernels(_interpreting())["_dequant_matmul"][grid](
        x, words, scales, biases, y, M, out_features, in_features,
        x.stride(0), x.stride(1), words.stride(0), scales.stride(0), y.stride(0),
        BITS=bits, GROUP=group_size, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        HALF_DOT=x.dtype != torch.float32 and not (x.dtype == torch.bfloat16 and _interpreting()),
    )
    launch_counts["dequant_matmul"] += 1
    return y


# ---------------------------------------------------------------------------------------------
# fused elementwise work of a decoder layer: each reference is the torch code it replaces, op for op


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()  # statistics in float32, as mx.fast.rms_norm
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x / sqrt(mean(x^2) + eps)) over the last dim: statistics in float32, the normalized x
    rounded to x's dtype before the weight (as `rms_norm_ref`); the result in torch's promoted dtype."""
    if x.dtype not in _FLOAT_DTYPES or weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"rms_norm: x {x.dtype} {tuple(x.shape)} and weight {tuple(weight.shape)}: expected a "
                         "float x whose last dim is the weight's length")
    if not _use_triton(x, weight) or x.numel() == 0:
        return rms_norm_ref(x, weight, eps)
    H = x.shape[-1]
    x2 = x.reshape(-1, H)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    _kernels(_interpreting())["_rms_norm"][(x2.shape[0],)](
        x2, weight.contiguous(), out, x2.stride(0), H, float(eps), BLOCK=_next_pow2(H))
    launch_counts["rms_norm"] += 1
    return out.view(x.shape)


def rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mscale: float, traditional: bool) -> torch.Tensor:
    half = x.shape[-1] // 2
    xf = x.float() * mscale if mscale != 1.0 else x.float()
    if traditional:  # interleaved pairs (x0, x1), (x2, x3), ...
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        out = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)
    else:  # halves
        x1, x2 = xf[..., :half], xf[..., half:]
        out = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    return out.to(x.dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mscale: float = 1.0,
         traditional: bool = False) -> torch.Tensor:
    """Rotary embedding: x (B, H, L, D), any strides (a transposed projection); cos, sin (B, 1, L, D/2)
    float32 -> contiguous (B, H, L, D) in x's dtype, computed in float32 (as `rope_ref`)."""
    if x.dim() != 4 or x.shape[-1] % 2 or cos.shape != sin.shape or cos.dim() != 4 or cos.shape[1] != 1 \
            or cos.shape[0] != x.shape[0] or cos.shape[2] != x.shape[2] or cos.shape[3] * 2 != x.shape[3]:
        raise ValueError(f"rope: x {tuple(x.shape)}, cos {tuple(cos.shape)}, sin {tuple(sin.shape)}: expected x "
                         "(B, H, L, D) with D even and cos, sin (B, 1, L, D/2)")
    if x.dtype not in _FLOAT_DTYPES or cos.dtype != torch.float32 or sin.dtype != torch.float32:
        raise ValueError(f"rope: expected a float x and float32 cos/sin, got {x.dtype}, {cos.dtype}, {sin.dtype}")
    if not _use_triton(x, cos, sin) or x.numel() == 0:
        return rope_ref(x, cos, sin, mscale, traditional)
    B, H, L, D = x.shape
    cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty((B, H, L, D), dtype=x.dtype, device=x.device)
    _kernels(_interpreting())["_rope"][(B * H * L,)](
        x, cos, sin, out, H, L, x.stride(0), x.stride(1), x.stride(2), x.stride(3), float(mscale),
        HALF=D // 2, HALF_P=_next_pow2(D // 2), TRADITIONAL=traditional)
    launch_counts["rope"] += 1
    return out


def silu_mul_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(gate) * up


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, silu rounded to gate's dtype before the product (as `silu_mul_ref`)."""
    if gate.shape != up.shape or gate.dtype != up.dtype or gate.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"silu_mul: gate {gate.dtype} {tuple(gate.shape)} and up {up.dtype} {tuple(up.shape)}: "
                         "expected one float dtype and shape")
    if not _use_triton(gate, up) or gate.numel() == 0:
        return silu_mul_ref(gate, up)
    g, u = gate.contiguous(), up.contiguous()
    out = torch.empty_like(g)
    n = g.numel()
    _kernels(_interpreting())["_silu_mul"][(triton.cdiv(n, 1024),)](g, u, out, n, BLOCK=1024)
    launch_counts["silu_mul"] += 1
    return out


# ---------------------------------------------------------------------------------------------
# the Triton sources


# Kernel sources are plain functions, decorated with triton.jit on first use, once per mode: Triton
# picks interpreter or compiler at decoration. Only builtins and our own combine functions appear in
# them: triton.language's jit'd helpers (tl.sum, tl.max, tl.cdiv, tl.zeros) were decorated when
# triton was imported, in whichever mode was set then, and the interpreter cannot call compiled-mode
# ones; so reductions go through tl.reduce with `_add` / `_max`, module globals bound per mode
# (the interpreter and the compiler both resolve a kernel's callees in its module's globals).
_add: Any = None
_max: Any = None
_SOURCES = ("_add", "_max", "_paged_decode", "_paged_combine", "_dequant_matmul", "_rms_norm", "_rope", "_silu_mul")


@cache
def _decorate(interpret: bool) -> dict[str, Any]:
    assert interpret == _interpreting()
    return {name: triton.jit(globals()[name + "_src"]) for name in _SOURCES}


def _kernels(interpret: bool) -> dict[str, Any]:
    kernels = _decorate(interpret)
    globals().update(_add=kernels["_add"], _max=kernels["_max"])
    return kernels


def _add_src(a, b):
    return a + b


def _max_src(a, b):
    return tl.maximum(a, b)


def _paged_decode_src(q_ptr, k_ptr, v_ptr, bt_ptr, sl_ptr, out_ptr, m_ptr, l_ptr, acc_ptr,
                      qk_scale, max_blocks, num_parts,
                      GROUP: tl.constexpr, GROUP_P: tl.constexpr, D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                      BLOCKS_PER_PART: tl.constexpr, SPLIT: tl.constexpr):
    # one program per (sequence b, kv head h, partition p): the GROUP query heads sharing kv
    # head h, over blocks [p * BLOCKS_PER_PART, ...) of b's table; scores in log2 units
    b = tl.program_id(0)
    h = tl.program_id(1)
    p = tl.program_id(2)
    Hkv = tl.num_programs(1)
    seq_len = tl.load(sl_ptr + b)
    first = p * BLOCKS_PER_PART
    last = tl.minimum((seq_len + BLOCK_SIZE - 1) // BLOCK_SIZE, first + BLOCKS_PER_PART)
    g = tl.arange(0, GROUP_P)
    d = tl.arange(0, D)
    t = tl.arange(0, BLOCK_SIZE)
    heads = h * GROUP + g  # (GP,) query heads
    g_ok = g < GROUP
    q = tl.load(q_ptr + (b * Hkv * GROUP + heads)[:, None] * D + d[None, :], mask=g_ok[:, None], other=0.0)
    q = q.to(tl.float32) * qk_scale  # (GP, D)
    m = tl.full((GROUP_P,), float("-inf"), tl.float32)
    l = tl.full((GROUP_P,), 0.0, tl.float32)
    acc = tl.full((GROUP_P, D), 0.0, tl.float32)
    for blk in range(first, last):
        block_id = tl.load(bt_ptr + b * max_blocks + blk).to(tl.int64)
        t_ok = blk * BLOCK_SIZE + t < seq_len  # (BS,)
        kv_off = ((block_id * BLOCK_SIZE + t) * Hkv + h)[:, None] * D + d[None, :]  # (BS, D)
        k = tl.load(k_ptr + kv_off, mask=t_ok[:, None], other=0.0).to(tl.float32)
        s = tl.reduce(q[:, None, :] * k[None, :, :], 2, _add)  # (GP, BS)
        s = tl.where(t_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.reduce(s, 1, _max))  # finite: block blk holds >= 1 token
        alpha = tl.exp2(m - m_new)
        pr = tl.exp2(s - m_new[:, None])  # (GP, BS)
        l = l * alpha + tl.reduce(pr, 1, _add)
        v = tl.load(v_ptr + kv_off, mask=t_ok[:, None], other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.reduce(pr[:, :, None] * v[None, :, :], 1, _add)  # (GP, D)
        m = m_new
    if SPLIT:  # unnormalized partials; an empty partition leaves m = -inf, l = 0, acc = 0
        row = (b * Hkv * GROUP + heads) * num_parts + p  # (GP,)
        tl.store(m_ptr + row, m, mask=g_ok)
        tl.store(l_ptr + row, l, mask=g_ok)
        tl.store(acc_ptr + row[:, None] * D + d[None, :], acc, mask=g_ok[:, None])
    else:
        o = acc / l[:, None]
        tl.store(out_ptr + (b * Hkv * GROUP + heads)[:, None] * D + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=g_ok[:, None])


def _paged_combine_src(m_ptr, l_ptr, acc_ptr, out_ptr, num_parts, NUM_PARTS_P: tl.constexpr, D: tl.constexpr):
    # one program per (sequence, query head): rescale the partitions to their common max
    row = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    p = tl.arange(0, NUM_PARTS_P)
    d = tl.arange(0, D)
    p_ok = p < num_parts
    m = tl.load(m_ptr + row * num_parts + p, mask=p_ok, other=float("-inf"))
    l = tl.load(l_ptr + row * num_parts + p, mask=p_ok, other=0.0)
    acc = tl.load(acc_ptr + (row * num_parts + p)[:, None] * D + d[None, :], mask=p_ok[:, None], other=0.0)
    w = tl.exp2(m - tl.reduce(m, 0, _max))  # partition 0 is never empty, so the max is finite
    w = tl.where(p_ok & (l > 0), w, 0.0)
    o = tl.reduce(w[:, None] * acc, 0, _add) / tl.reduce(w * l, 0, _add)
    tl.store(out_ptr + row * D + d, o.to(out_ptr.dtype.element_ty))


def _dequant_matmul_src(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, M, N, K,
                        stride_xm, stride_xk, stride_wn, stride_sn, stride_ym,
                        BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, HALF_DOT: tl.constexpr):
    # y (BLOCK_M, BLOCK_N) tile; W (BLOCK_N, BLOCK_K) dequantized per K step; K % BLOCK_K == 0
    PER_WORD: tl.constexpr = 32 // BITS
    WORDS_K: tl.constexpr = BLOCK_K // PER_WORD
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    rw = tl.arange(0, WORDS_K)
    shifts = tl.arange(0, PER_WORD) * BITS
    m_ok = rm < M
    n_ok = rn < N
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_ptr + rm[:, None] * stride_xm + (k0 + rk)[None, :] * stride_xk,
                    mask=m_ok[:, None], other=0.0)  # (BM, BK)
        words = tl.load(w_ptr + rn[:, None].to(tl.int64) * stride_wn + (k0 // PER_WORD + rw)[None, :],
                        mask=n_ok[:, None], other=0)  # (BN, BK / PER_WORD) int32
        q = (words[:, :, None] >> shifts[None, None, :]) & ((1 << BITS) - 1)  # lowest bits first
        q = tl.reshape(q, (BLOCK_N, BLOCK_K))
        sb = rn[:, None] * stride_sn + ((k0 + rk) // GROUP)[None, :]  # (BN, BK)
        scale = tl.load(s_ptr + sb, mask=n_ok[:, None], other=0.0).to(tl.float32)
        bias = tl.load(b_ptr + sb, mask=n_ok[:, None], other=0.0).to(tl.float32)
        w = q.to(tl.float32) * scale + bias  # (BN, BK)
        w = w.to(x.dtype)  # float16/bfloat16 x: W rounded to x's dtype, as MLX's half scales give
        if HALF_DOT:
            acc += tl.dot(x, tl.trans(w))
        else:  # float32; also bfloat16 under the interpreter, whose bfloat16 dot is broken
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def _rms_norm_src(x_ptr, w_ptr, out_ptr, stride_x, H, eps, BLOCK: tl.constexpr):
    # one program per row
    row = tl.program_id(0)
    c = tl.arange(0, BLOCK)
    ok = c < H
    x = tl.load(x_ptr + row * stride_x + c, mask=ok, other=0.0).to(tl.float32)
    ms = tl.reduce(x * x, 0, _add) / H  # not tl.sum: a jit helper the interpreter cannot call (module doc)
    y = (x * (1.0 / tl.sqrt(ms + eps))).to(x_ptr.dtype.element_ty)  # rounded to x's dtype, as torch
    w = tl.load(w_ptr + c, mask=ok, other=0.0)
    tl.store(out_ptr + row * H + c, (w.to(tl.float32) * y.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=ok)


def _rope_src(x_ptr, cos_ptr, sin_ptr, out_ptr, H, L, sb, sh, sl, sd, mscale,
              HALF: tl.constexpr, HALF_P: tl.constexpr, TRADITIONAL: tl.constexpr):
    # one program per (b, h, l) row of D = 2 * HALF values
    r = tl.program_id(0)
    pos = r % L
    h = (r // L) % H
    b = r // (L * H)
    i = tl.arange(0, HALF_P)
    ok = i < HALF
    base = x_ptr + b.to(tl.int64) * sb + h * sh + pos * sl
    if TRADITIONAL:
        lo, hi = 2 * i, 2 * i + 1
    else:
        lo, hi = i, i + HALF
    x1 = tl.load(base + lo * sd, mask=ok, other=0.0).to(tl.float32) * mscale
    x2 = tl.load(base + hi * sd, mask=ok, other=0.0).to(tl.float32) * mscale
    cs = (b * L + pos) * HALF + i
    c = tl.load(cos_ptr + cs, mask=ok, other=0.0)
    s = tl.load(sin_ptr + cs, mask=ok, other=0.0)
    o = out_ptr + r.to(tl.int64) * (2 * HALF)
    tl.store(o + lo, (x1 * c - x2 * s).to(out_ptr.dtype.element_ty), mask=ok)
    tl.store(o + hi, (x1 * s + x2 * c).to(out_ptr.dtype.element_ty), mask=ok)


def _silu_mul_src(g_ptr, u_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    g = tl.load(g_ptr + i, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + i, mask=ok, other=0.0)
    act = (g / (1.0 + tl.exp(-g))).to(g_ptr.dtype.element_ty)  # silu rounded to the dtype, as torch
    tl.store(out_ptr + i, (act.to(tl.float32) * u.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=ok)
