"""Triton kernels of the torch backend, each beside its plain-torch reference.

- `paged_decode_attention`: one query token per sequence against K/V read through a block table
  (vLLM's paged attention; FlashDecoding's split over the sequence when there are few programs).
- `dequant_matmul`: x @ W.T with W in MLX's affine quantized format (`mx.quantize`), dequantized
  tile by tile in registers, accumulated in float32.
- `rms_norm`, `rope`, `silu_mul`: a decoder layer's elementwise work, one kernel each where torch launches
  8 (a norm), 9 (rope of q or k) and 2 (the MLP's gate): a decode step of a small model is bound by its
  kernel count, not by bytes (docs/benchmarks/h200.md, the H200 check).

GGUF Q4_0 / Q4_1 / Q8_0 weights reach the kernel in that affine format (the loader's exact repack,
`quant.affine.affine_from_gguf`, or MLX's own); k-quants arrive dequantized at load.

Dispatch: the Triton kernel runs when the tensors are on CUDA, or when TRITON_INTERPRET=1 and
triton is importable (Triton's CPU interpreter, for tests); otherwise the torch reference, so CPU
users get the same numbers. Triton reads TRITON_INTERPRET when a kernel is decorated, so kernels
are built on first use, once per mode. The wrappers never sync the host (CUDA-graph safe).
"""

from __future__ import annotations

from collections import Counter

import torch

from mlx_engine.backends.torch import switches
from mlx_engine.backends.torch.triton_sources import interpreting as _interpreting
from mlx_engine.backends.torch.triton_sources import kernels as _kernels
from mlx_engine.backends.torch.triton_sources import triton

SUPPORTED_BITS = (4, 8)
SUPPORTED_GROUP_SIZES = (16, 32, 64, 128)  # 16: the sub-blocks of Q2_K, Q3_K, Q6_K
SUPPORTED_BLOCK_SIZES = (16, 32)
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_LOG2E = 1.4426950408889634

# The norms, rope and the MLP's gate as one Triton kernel each on CUDA (their torch references, op for op the
# code they replace, elsewhere), which the model picks by this (`switches.UNFUSED`, read when this module is imported)
FUSED = switches.fused()

# kernel launches by name; tests read it to prove the Triton path (not the fallback) ran
launch_counts: Counter[str] = Counter()


def triton_available() -> bool:
    """True when triton imports (it may still have no GPU: see `_use_triton`)."""
    return triton is not None


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
