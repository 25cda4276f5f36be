"""MLX-ops references for the Metal kernels: the slow, obviously correct twins.

`paged_decode_attention` is also the engine's CPU path for paged decode, so it is vectorized over
the batch (one gather, one masked softmax attention), never a Python loop over tokens.
"""

from __future__ import annotations

import mlx.core as mx

from kernels_metal.pool import KVPool

QK_K = 256  # weights per k-quant super-block

# ggml type name -> bytes per super-block of 256 weights (ggml's sizeof(block_qN_K))
KQUANT_BLOCK_BYTES: dict[str, int] = {
    "Q2_K": 84,  # scales[16], qs[64], d, dmin
    "Q3_K": 110,  # hmask[32], qs[64], scales[12], d
    "Q4_K": 144,  # d, dmin, scales[12], qs[128]
    "Q5_K": 176,  # d, dmin, scales[12], qh[32], qs[128]
    "Q6_K": 210,  # ql[128], qh[64], scales[16], d
}


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


def _fp16_at(b: mx.array, i: int) -> mx.array:
    """(n, bpb) uint8 -> (n, 1) float32 from the little-endian fp16 at byte i."""
    u = b[:, i].astype(mx.uint16) | (b[:, i + 1].astype(mx.uint16) << 8)
    return mx.view(u, mx.float16).astype(mx.float32)[:, None]


def _bits(x: mx.array, shifts: list[int], mask: int) -> mx.array:
    """(..., n) uint8 -> (..., len(shifts), n): (x >> shift) & mask for each shift."""
    s = mx.array(shifts, dtype=mx.uint8)[:, None]
    return (x[..., None, :] >> s) & mask


def _q4k_scale_min(scales: mx.array) -> tuple[mx.array, mx.array]:
    """(n, 12) uint8, six-bit packed -> (n, 8) scales and (n, 8) mins as float32 (ggml's
    get_scale_min_k4: sub-blocks 0-3 in the low six bits of bytes 0-3 / 4-7, sub-blocks 4-7 from
    the nibbles of bytes 8-11 with the top two bits of bytes 0-3 / 4-7)."""
    d, m, md = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = mx.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=1)
    mn = mx.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=1)
    return sc.astype(mx.float32), mn.astype(mx.float32)


def _dequant_q2_k(b: mx.array) -> mx.array:
    n = b.shape[0]
    scales, qs = b[:, 0:16], b[:, 16:80]
    d, dmin = _fp16_at(b, 80), _fp16_at(b, 82)
    dl = (d * (scales & 0xF).astype(mx.float32)).reshape(n, 16, 1)
    ml = (dmin * (scales >> 4).astype(mx.float32)).reshape(n, 16, 1)
    # qs in two halves of 32 bytes; each byte holds four 2-bit weights, 32 weights apart
    q = _bits(qs.reshape(n, 2, 32), [0, 2, 4, 6], 3).reshape(n, 16, 16).astype(mx.float32)
    return (dl * q - ml).reshape(n, QK_K)


def _dequant_q3_k(b: mx.array) -> mx.array:
    n = b.shape[0]
    hmask, qs, scales = b[:, 0:32], b[:, 32:96], b[:, 96:108]
    d = _fp16_at(b, 108)
    lsc = _bits(scales[:, 0:8], [0, 4], 0x0F).reshape(n, 16)
    hsc = _bits(scales[:, 8:12], [0, 2, 4, 6], 0x03).reshape(n, 16)
    sc = (lsc | (hsc << 4)).astype(mx.int8) - 32
    dl = (d * sc.astype(mx.float32)).reshape(n, 16, 1)
    ql = _bits(qs.reshape(n, 2, 32), [0, 2, 4, 6], 3).reshape(n, 16, 16)
    qh = _bits(hmask.reshape(n, 1, 32), list(range(8)), 1).reshape(n, 16, 16)
    # a set hmask bit means no -4 offset
    q = ql.astype(mx.int8) - ((qh ^ 1) << 2).astype(mx.int8)
    return (dl * q.astype(mx.float32)).reshape(n, QK_K)


def _dequant_q4_k(b: mx.array) -> mx.array:
    n = b.shape[0]
    d, dmin = _fp16_at(b, 0), _fp16_at(b, 2)
    sc, mn = _q4k_scale_min(b[:, 4:16])
    dl = (d * sc).reshape(n, 8, 1)
    ml = (dmin * mn).reshape(n, 8, 1)
    # four chunks of 32 bytes: low nibbles are sub-block 2j, high nibbles sub-block 2j+1
    q = _bits(b[:, 16:144].reshape(n, 4, 32), [0, 4], 0x0F).reshape(n, 8, 32).astype(mx.float32)
    return (dl * q - ml).reshape(n, QK_K)


def _dequant_q5_k(b: mx.array) -> mx.array:
    n = b.shape[0]
    d, dmin = _fp16_at(b, 0), _fp16_at(b, 2)
    sc, mn = _q4k_scale_min(b[:, 4:16])
    dl = (d * sc).reshape(n, 8, 1)
    ml = (dmin * mn).reshape(n, 8, 1)
    ql = _bits(b[:, 48:176].reshape(n, 4, 32), [0, 4], 0x0F).reshape(n, 8, 32)
    qh = _bits(b[:, 16:48].reshape(n, 1, 32), list(range(8)), 1).reshape(n, 8, 32)  # bit s: sub-block s
    q = (ql | (qh << 4)).astype(mx.float32)
    return (dl * q - ml).reshape(n, QK_K)


def _dequant_q6_k(b: mx.array) -> mx.array:
    n = b.shape[0]
    ql, qh = b[:, 0:128], b[:, 128:192]
    sc = mx.view(b[:, 192:208], mx.int8).astype(mx.float32)  # (n, 16), one per 16 weights
    d = _fp16_at(b, 208)
    dl = (d * sc).reshape(n, 16, 1)
    # two halves of 128 weights; ql: 64 bytes, low then high nibbles; qh: 32 bytes, 4 x 2 bits
    lo = _bits(ql.reshape(n, 2, 64), [0, 4], 0x0F).reshape(n, 8, 32)
    hi = _bits(qh.reshape(n, 2, 32), [0, 2, 4, 6], 0x03).reshape(n, 8, 32)
    q = (lo | (hi << 4)).astype(mx.int8) - 32
    return (dl * q.reshape(n, 16, 16).astype(mx.float32)).reshape(n, QK_K)


_DEQUANT = {
    "Q2_K": _dequant_q2_k,
    "Q3_K": _dequant_q3_k,
    "Q4_K": _dequant_q4_k,
    "Q5_K": _dequant_q5_k,
    "Q6_K": _dequant_q6_k,
}


def dequantize_kquant(w_blocks: mx.array, ggml_type: str, out_features: int, in_features: int) -> mx.array:
    """GGUF k-quant bytes (out_features, in_features // 256 * bytes per block), uint8, to float32
    weights (out_features, in_features); bit for bit what `gguf.quants.dequantize` gives."""
    bpb = KQUANT_BLOCK_BYTES[ggml_type]
    blocks = w_blocks.reshape(-1, bpb)  # (out_features * in_features // 256, bpb)
    return _DEQUANT[ggml_type](blocks).reshape(out_features, in_features)


# k-quant -> affine groups (w = scale * q + bias): container bits, group size
KQUANT_AFFINE = {"Q2_K": (4, 16), "Q3_K": (4, 16), "Q4_K": (4, 32), "Q5_K": (8, 32), "Q6_K": (8, 16)}


def kquant_scales(w_blocks: mx.array, ggml_type: str, out_features: int,
                  in_features: int) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """A Q4_K or Q5_K matrix's two levels of scales: (d, dmin (out, in / 256) float32, each a float16's value;
    sc, mn (out, in / 32) float32, integers in [0, 64)): block j of super-block s scales by d[s] sc[j] and is
    offset by -dmin[s] mn[j], `kquant_affine`'s scales and biases."""
    if ggml_type not in ("Q4_K", "Q5_K"):
        raise ValueError(f"kquant_scales: Q4_K or Q5_K, not {ggml_type}")
    b = w_blocks.reshape(-1, KQUANT_BLOCK_BYTES[ggml_type])
    sc, mn = _q4k_scale_min(b[:, 4:16])
    supers = in_features // 256
    return (_fp16_at(b, 0).reshape(out_features, supers), _fp16_at(b, 2).reshape(out_features, supers),
            sc.reshape(out_features, -1), mn.reshape(out_features, -1))


def kquant_affine(w_blocks: mx.array, ggml_type: str, out_features: int,
                  in_features: int) -> tuple[mx.array, mx.array, mx.array, int, int]:
    """GGUF k-quant bytes -> (q uint8 (out, in), scales, biases float32 (out, in / group), bits, group):
    the same weights as an affine quantization whose groups are the k-quant's sub-blocks, for kernels that
    read affine groups (the torch backend's `dequant_matmul`). `scales * q + biases` equals
    `dequantize_kquant` bit for bit for Q2_K, Q4_K and Q5_K (d * sc * q - dmin * m); Q3_K's and Q6_K's
    d * sc * (q - offset) becomes d * sc * q - offset * d * sc, within an ulp or two."""
    bits, group = KQUANT_AFFINE[ggml_type]
    b = w_blocks.reshape(-1, KQUANT_BLOCK_BYTES[ggml_type])
    n = b.shape[0]
    if ggml_type in ("Q4_K", "Q5_K"):
        d, dmin = _fp16_at(b, 0), _fp16_at(b, 2)
        sc, mn = _q4k_scale_min(b[:, 4:16])
        scale, bias = d * sc, -(dmin * mn)  # (n, 8)
        qs = b[:, 16:144] if ggml_type == "Q4_K" else b[:, 48:176]
        q = _bits(qs.reshape(n, 4, 32), [0, 4], 0x0F).reshape(n, 8, 32)
        if ggml_type == "Q5_K":
            q = q | (_bits(b[:, 16:48].reshape(n, 1, 32), list(range(8)), 1).reshape(n, 8, 32) << 4)
    elif ggml_type == "Q6_K":
        sc = mx.view(b[:, 192:208], mx.int8).astype(mx.float32)
        scale = _fp16_at(b, 208) * sc  # (n, 16)
        bias = -32 * scale
        lo = _bits(b[:, 0:128].reshape(n, 2, 64), [0, 4], 0x0F).reshape(n, 8, 32)
        hi = _bits(b[:, 128:192].reshape(n, 2, 32), [0, 2, 4, 6], 0x03).reshape(n, 8, 32)
        q = lo | (hi << 4)
    elif ggml_type == "Q2_K":
        scales = b[:, 0:16]
        scale = _fp16_at(b, 80) * (scales & 0xF).astype(mx.float32)
        bias = -(_fp16_at(b, 82) * (scales >> 4).astype(mx.float32))
        q = _bits(b[:, 16:80].reshape(n, 2, 32), [0, 2, 4, 6], 3)
    else:  # Q3_K
        scales = b[:, 96:108]
        lsc = _bits(scales[:, 0:8], [0, 4], 0x0F).reshape(n, 16)
        hsc = _bits(scales[:, 8:12], [0, 2, 4, 6], 0x03).reshape(n, 16)
        scale = _fp16_at(b, 108) * ((lsc | (hsc << 4)).astype(mx.int8) - 32).astype(mx.float32)
        bias = -4 * scale
        ql = _bits(b[:, 32:96].reshape(n, 2, 32), [0, 2, 4, 6], 3).reshape(n, 16, 16)
        qh = _bits(b[:, 0:32].reshape(n, 1, 32), list(range(8)), 1).reshape(n, 16, 16)
        q = ql | (qh << 2)  # a set hmask bit: no -4 offset, so q + 4
    groups = in_features // group
    return (q.astype(mx.uint8).reshape(out_features, in_features), scale.reshape(out_features, groups),
            bias.reshape(out_features, groups), bits, group)


def dequant_matmul_kquant(
    x: mx.array, w_blocks: mx.array, ggml_type: str, out_features: int, in_features: int
) -> mx.array:
    """y = x @ W.T with W dequantized from k-quant bytes; float32 math, y in x's dtype when x is
    half precision, else float32."""
    w = dequantize_kquant(w_blocks, ggml_type, out_features, in_features)
    y = x.astype(mx.float32) @ w.T  # (M, out_features)
    return y.astype(x.dtype) if x.dtype in (mx.float16, mx.bfloat16) else y
