"""The Triton sources of `triton_kernels`' kernels, decorated on first use (`kernels`). Kept apart from the wrappers
that launch them and their torch references: a source's callees are resolved in this module's globals."""

from __future__ import annotations

from functools import cache
from typing import Any

from mlx_engine.backends.torch import switches

try:
    import triton
    import triton.language as tl
except Exception:  # triton is optional: the references serve
    triton = tl = None  # type: ignore[assignment]


def interpreting() -> bool:
    return switches.triton_interpret()


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
    assert interpret == interpreting()
    return {name: triton.jit(globals()[name + "_src"]) for name in _SOURCES}


def kernels(interpret: bool) -> dict[str, Any]:
    """The kernels by name, decorated for the interpreter or the compiler."""
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
