"""MLX-ops references for the Metal kernels: the slow, obviously correct twins.

`paged_decode_attention` is also the engine's CPU path for paged decode, so it is vectorized over
the batch (one gather, one masked softmax attention), never a Python loop over tokens.
"""

from __future__ import annotations

import mlx.core as mx

from kernels_metal.pool import KVPool
from quant.formats import QK_K, BlockFormat, block_format


def paged_decode_attention(
    q: mx.array,
    pool: KVPool,
    block_tables: mx.array,
    seq_lens: mx.array,
    scale: float,
    max_seq_len: int | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: mx.array | None = None,
) -> mx.array:
    """Decode attention over a paged KV pool: gather through the block tables, then masked attention.

    Arguments as `kernels_metal.paged_decode_attention` (not validated here; `window`: the query at position
    seq_lens[b] - 1 reads keys at positions >= seq_lens[b] - window only). `max_seq_len`, when
    known, bounds the gather to the blocks in use instead of the tables' full capacity. Computes in
    float32; a sequence of length 0 yields zeros. `softcap` (Gemma 2): scores -> tanh(scores / cap) * cap before
    the mask; `sinks` (Hq,) (gpt-oss): one logit per query head that joins each softmax's denominator only.
    """
    B, Hq, D = q.shape
    _, block_size, Hkv, _ = pool.k.shape
    num_used = block_tables.shape[1]
    if max_seq_len is not None:
        num_used = max(1, min(num_used, -(-max_seq_len // block_size)))
    # Entries past a sequence's length may hold anything; clamp them to a valid id (masked below).
    tables = mx.clip(block_tables[:, :num_used], 0, pool.k.shape[0] - 1)  # (B, nb)
    T = num_used * block_size

    def gather(a: mx.array, scales: mx.array | None, biases: mx.array | None, nbits: int | None,
               per_channel: bool = False) -> mx.array:
        x = a[tables]  # (B, nb, block_size, Hkv, D or packed)
        if per_channel:  # one scale and bias per (block, head, channel)
            s, z = channel_params(scales[tables]), channel_params(biases[tables])  # (B, nb, Hkv, D)
            x = unpack_codes(x, nbits) * s[:, :, None] + z[:, :, None]
        elif nbits is not None:
            # float32 scales: K and V are not rounded to half precision before the float32 math
            x = mx.dequantize(x, scales[tables].astype(mx.float32), biases[tables].astype(mx.float32),
                              group_size=pool.group_size, bits=nbits)
        x = x.astype(mx.float32).reshape(B, T, Hkv, D)
        return x.transpose(0, 2, 1, 3)  # (B, Hkv, T, D)

    k = gather(pool.k, pool.k_scales, pool.k_biases, pool.key_bits, pool.k_per_channel)
    v = gather(pool.v, pool.v_scales, pool.v_biases, pool.bits)
    valid = mx.arange(T)[None, :] < seq_lens[:, None]  # (B, T)
    if window is not None:
        valid = valid & (mx.arange(T)[None, :] >= seq_lens[:, None] - window)
    # GQA by grouping the q heads of each kv head, so K and V are never repeated (on the CPU faster than
    # mx.fast.scaled_dot_product_attention on the strided gather).
    qg = q.astype(mx.float32).reshape(B, Hkv, Hq // Hkv, D)  # (B, Hkv, G, D)
    scores = (qg @ k.swapaxes(-1, -2)) * scale  # (B, Hkv, G, T)
    if softcap is not None:
        scores = mx.tanh(scores / softcap) * softcap
    scores = mx.where(valid[:, None, None, :], scores, -mx.inf)
    if sinks is None:
        out = (mx.softmax(scores, axis=-1) @ v).reshape(B, Hq, D)
    else:  # the sink's column joins the softmax, then is dropped: it weighs no value
        sink = mx.broadcast_to(sinks.astype(mx.float32).reshape(1, Hkv, Hq // Hkv, 1), (B, Hkv, Hq // Hkv, 1))
        p = mx.softmax(mx.concatenate([scores, sink], axis=-1), axis=-1)[..., :T]
        out = (p @ v).reshape(B, Hq, D)
    # A sequence of length 0 has every score masked (a NaN row); it attends to nothing.
    out = mx.where((seq_lens > 0)[:, None, None], out, 0.0)
    return out.astype(q.dtype)


def unpack_codes(packed: mx.array, bits: int) -> mx.array:
    """uint32 words packed as `mx.quantize` packs them (field j of a word is element j, lowest bits first)
    -> the codes as float32 (..., words * 32 / bits)."""
    shifts = mx.arange(0, 32, bits, dtype=mx.uint32)
    codes = (packed[..., None] >> shifts) & mx.array((1 << bits) - 1, dtype=mx.uint32)
    return codes.reshape(*packed.shape[:-1], -1).astype(mx.float32)


def channel_params(a: mx.array) -> mx.array:
    """Per-channel key scales (or biases) of whole blocks as a pool stores them, (..., block_size, Hkv,
    D / block_size) -> (..., Hkv, D). A block's D scales per head fill the slots of its block_size tokens:
    entry (i, h, g) belongs to channel g * block_size + i, so they take the room per-token groups of
    block_size channels would, and travel with the block (copies, saves) like any slot."""
    *lead, bs, hkv, g = a.shape
    n = len(lead)
    return a.transpose(*range(n), n + 1, n + 2, n).reshape(*lead, hkv, g * bs)


def channel_codes(x: mx.array, lo: mx.array, hi: mx.array, bits: int) -> tuple[mx.array, mx.array]:
    """The per-channel affine rule, float32: x's codes in [0, 2^bits) on the grid from lo to hi (lo, hi broadcast
    against x), and the grid's step. `quantize_channels` stores blocks with it, and the engine re-quantizes a
    query's own block with it (`kv.paged`): both must round alike."""
    levels = (1 << bits) - 1
    step = mx.maximum(hi - lo, 1e-12) / levels
    return mx.clip(mx.round((x - lo) / step), 0, levels), step


def quantize_channels(x: mx.array, valid: mx.array, bits: int) -> tuple[mx.array, mx.array, mx.array]:
    """Per-channel affine quantization of whole blocks, x (nb, block_size, Hkv, D), over each block's first
    `valid` (nb,) tokens (the rest are padding: quantized as the block's minimum, never read) -> codes packed
    as `mx.quantize` packs them (nb, block_size, Hkv, D * bits / 32) uint32, scales and biases (nb, block_size,
    Hkv, D / block_size) as `channel_params` reads them, in x's dtype. w = scale * q + bias, q in [0, 2^bits)."""
    nb, bs, hkv, d = x.shape
    x32 = x.astype(mx.float32)
    mask = (mx.arange(bs)[None, :] < valid[:, None])[:, :, None, None]  # (nb, bs, 1, 1)
    lo = mx.where(mask, x32, mx.inf).min(axis=1)  # (nb, Hkv, D)
    hi = mx.where(mask, x32, -mx.inf).max(axis=1)
    q, scale = channel_codes(mx.where(mask, x32, lo[:, None]), lo[:, None], hi[:, None], bits)
    scale = scale[:, 0]
    q = q.astype(mx.uint32).reshape(nb, bs, hkv, d * bits // 32, 32 // bits)
    shifts = mx.arange(0, 32, bits, dtype=mx.uint32)
    packed = (q << shifts).sum(axis=-1).astype(mx.uint32)

    def slots(p: mx.array) -> mx.array:  # (nb, Hkv, D) -> (nb, bs, Hkv, D / bs), channel g * bs + i at (i, g)
        return p.reshape(nb, hkv, d // bs, bs).transpose(0, 3, 1, 2).astype(x.dtype)

    return packed, slots(scale), slots(lo)


def _field(b: mx.array, f: BlockFormat, name: str) -> mx.array:
    """(n, block bytes) uint8 -> field `name`'s bytes (n, its bytes), where `quant.formats` places it."""
    fld = f.field(name)
    return b[:, fld.offset:fld.stop]


def _fp16(b: mx.array, f: BlockFormat, name: str) -> mx.array:
    """(n, block bytes) uint8 -> (n, 1) float32 from the block's little-endian fp16 field `name`."""
    i = f.field(name).offset
    u = b[:, i].astype(mx.uint16) | (b[:, i + 1].astype(mx.uint16) << 8)
    return mx.view(u, mx.float16).astype(mx.float32)[:, None]


def _bits(x: mx.array, shifts: list[int], mask: int) -> mx.array:
    """(..., n) uint8 -> (..., len(shifts), n): (x >> shift) & mask for each shift."""
    s = mx.array(shifts, dtype=mx.uint8)[:, None]
    return (x[..., None, :] >> s) & mask


def _q4k_scale_min(scales: mx.array) -> tuple[mx.array, mx.array]:
    """(n, 12) uint8, six-bit packed -> (n, 8) scales and (n, 8) mins as float32 (`quant.kquant.scale_min_k4`)."""
    d, m, md = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = mx.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=1)
    mn = mx.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=1)
    return sc.astype(mx.float32), mn.astype(mx.float32)


def _dequant_q2_k(b: mx.array) -> mx.array:
    f, n = block_format("Q2_K"), b.shape[0]
    scales = _field(b, f, "scales")
    dl = (_fp16(b, f, "d") * (scales & 0xF).astype(mx.float32)).reshape(n, 16, 1)
    ml = (_fp16(b, f, "dmin") * (scales >> 4).astype(mx.float32)).reshape(n, 16, 1)
    # qs in two halves of 32 bytes; each byte holds four 2-bit weights, 32 weights apart
    q = _bits(_field(b, f, "qs").reshape(n, 2, 32), [0, 2, 4, 6], 3).reshape(n, 16, 16).astype(mx.float32)
    return (dl * q - ml).reshape(n, QK_K)


def _dequant_q3_k(b: mx.array) -> mx.array:
    f, n = block_format("Q3_K"), b.shape[0]
    scales = _field(b, f, "scales")
    lsc = _bits(scales[:, 0:8], [0, 4], 0x0F).reshape(n, 16)
    hsc = _bits(scales[:, 8:12], [0, 2, 4, 6], 0x03).reshape(n, 16)
    sc = (lsc | (hsc << 4)).astype(mx.int8) - 32
    dl = (_fp16(b, f, "d") * sc.astype(mx.float32)).reshape(n, 16, 1)
    ql = _bits(_field(b, f, "qs").reshape(n, 2, 32), [0, 2, 4, 6], 3).reshape(n, 16, 16)
    qh = _bits(_field(b, f, "hmask").reshape(n, 1, 32), list(range(8)), 1).reshape(n, 16, 16)
    # a set hmask bit means no -4 offset
    q = ql.astype(mx.int8) - ((qh ^ 1) << 2).astype(mx.int8)
    return (dl * q.astype(mx.float32)).reshape(n, QK_K)


def _dequant_q45_k(b: mx.array, ggml_type: str) -> mx.array:
    f, n = block_format(ggml_type), b.shape[0]
    sc, mn = _q4k_scale_min(_field(b, f, "scales"))
    dl = (_fp16(b, f, "d") * sc).reshape(n, 8, 1)
    ml = (_fp16(b, f, "dmin") * mn).reshape(n, 8, 1)
    # four chunks of 32 bytes: low nibbles are sub-block 2j, high nibbles sub-block 2j+1
    q = _bits(_field(b, f, "qs").reshape(n, 4, 32), [0, 4], 0x0F).reshape(n, 8, 32)
    if ggml_type == "Q5_K":  # bit s of qh byte j: weight j of sub-block s
        q = q | (_bits(_field(b, f, "qh").reshape(n, 1, 32), list(range(8)), 1).reshape(n, 8, 32) << 4)
    return (dl * q.astype(mx.float32) - ml).reshape(n, QK_K)


def _dequant_q6_k(b: mx.array) -> mx.array:
    f, n = block_format("Q6_K"), b.shape[0]
    sc = mx.view(_field(b, f, "scales"), mx.int8).astype(mx.float32)  # (n, 16), one per 16 weights
    dl = (_fp16(b, f, "d") * sc).reshape(n, 16, 1)
    # two halves of 128 weights; ql: 64 bytes, low then high nibbles; qh: 32 bytes, 4 x 2 bits
    lo = _bits(_field(b, f, "ql").reshape(n, 2, 64), [0, 4], 0x0F).reshape(n, 8, 32)
    hi = _bits(_field(b, f, "qh").reshape(n, 2, 32), [0, 2, 4, 6], 0x03).reshape(n, 8, 32)
    q = (lo | (hi << 4)).astype(mx.int8) - 32
    return (dl * q.reshape(n, 16, 16).astype(mx.float32)).reshape(n, QK_K)


_DEQUANT = {
    "Q2_K": _dequant_q2_k,
    "Q3_K": _dequant_q3_k,
    "Q4_K": lambda b: _dequant_q45_k(b, "Q4_K"),
    "Q5_K": lambda b: _dequant_q45_k(b, "Q5_K"),
    "Q6_K": _dequant_q6_k,
}


def dequantize_kquant(w_blocks: mx.array, ggml_type: str, out_features: int, in_features: int) -> mx.array:
    """GGUF k-quant bytes (out_features, in_features // 256 * bytes per block), uint8, to float32
    weights (out_features, in_features); bit for bit `quant.dequantize` (gguf-py's), the layouts `quant.formats`'."""
    blocks = w_blocks.reshape(-1, block_format(ggml_type).block_bytes)  # (out * in // 256, bytes per block)
    return _DEQUANT[ggml_type](blocks).reshape(out_features, in_features)


def dequant_matmul_kquant(
    x: mx.array, w_blocks: mx.array, ggml_type: str, out_features: int, in_features: int
) -> mx.array:
    """y = x @ W.T with W dequantized from k-quant bytes; float32 math, y in x's dtype when x is
    half precision, else float32."""
    w = dequantize_kquant(w_blocks, ggml_type, out_features, in_features)
    y = x.astype(mx.float32) @ w.T  # (M, out_features)
    return y.astype(x.dtype) if x.dtype in (mx.float16, mx.bfloat16) else y
