"""The k-quants (Q2_K .. Q6_K) unpacked with numpy: each super-block of 256 weights as its codes and the scales of
its sub-blocks of 16 or 32 (`kquant_affine`), and the two levels of Q4_K's and Q5_K's scales as the file holds them
(`kquant_scales`). Field names and offsets are `formats.FORMATS`'. Dequantization is gguf-py's (`quant.dequantize`),
which these forms reproduce: bit for bit for Q2_K, Q4_K and Q5_K, within an ulp or two for Q3_K and Q6_K (whose
d * sc * (q - offset) becomes d * sc * q - offset * d * sc).
"""

from __future__ import annotations

import numpy as np

from quant.formats import KQUANT_AFFINE, QK_K, TWO_LEVEL_SCALES, block_format


def _supers(w_blocks: np.ndarray, ggml_type: str) -> np.ndarray:
    """(out, in / 256 * bytes per super-block) uint8 -> (n super-blocks, bytes per super-block)."""
    return np.ascontiguousarray(w_blocks).view(np.uint8).reshape(-1, block_format(ggml_type).block_bytes)


def bits_of(x: np.ndarray, shifts: list[int], mask: int) -> np.ndarray:
    """(..., n) uint8 -> (..., len(shifts), n): (x >> shift) & mask for each shift."""
    s = np.array(shifts, dtype=np.uint8)[:, None]
    return (x[..., None, :] >> s) & np.uint8(mask)


def scale_min_k4(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(n, 12) uint8, six-bit packed -> (n, 8) scales and (n, 8) mins, uint8 in [0, 64) (ggml's get_scale_min_k4:
    sub-blocks 0-3 in the low six bits of bytes 0-3 / 4-7, sub-blocks 4-7 from the nibbles of bytes 8-11 with the
    top two bits of bytes 0-3 / 4-7)."""
    d, m, md = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=1)
    return sc, mn


def q3k_scales(scales: np.ndarray) -> np.ndarray:
    """Q3_K's (n, 12) packed scales -> (n, 16) int8 in [-32, 32): low nibbles from bytes 0-7, two high bits each
    from bytes 8-11, less 32."""
    n = scales.shape[0]
    low = bits_of(scales[:, 0:8], [0, 4], 0x0F).reshape(n, 16)
    high = bits_of(scales[:, 8:12], [0, 2, 4, 6], 0x03).reshape(n, 16)
    return (low | (high << 4)).astype(np.int8) - np.int8(32)


def _every_byte(mask: int) -> np.uint64:
    return np.uint64(int.from_bytes(bytes([mask]) * 8, "little"))


_M1, _M2, _M4 = _every_byte(0x01), _every_byte(0x03), _every_byte(0x0F)


def kquant_codes(w_blocks: np.ndarray, ggml_type: str) -> np.ndarray:
    """The codes of each super-block in weight order, (n super-blocks, 256) uint8: Q3_K's with its high bit set
    where the hmask bit is (no -4 offset), Q6_K's unsigned (the -32 offset not applied). Computed eight bytes at a
    time (uint64 words, each shift masked per byte so no bit crosses into the next byte): numpy shifts uint8
    arrays several times slower."""
    f = block_format(ggml_type)
    b = _supers(w_blocks, ggml_type)
    n = b.shape[0]

    def words(name: str) -> np.ndarray:  # a field's bytes as uint64 words, (n, bytes / 8)
        fl = f.field(name)
        return np.ascontiguousarray(b[:, fl.offset:fl.stop]).view(np.uint64)

    out = np.empty((n, QK_K), np.uint8)
    by_sub = out.view(np.uint64).reshape(n, 8, 4)  # weight 32 s + l: byte l % 8 of word [s, l // 8]
    by_half = by_sub.reshape(n, 2, 4, 4)  # weight 128 h + 32 j + l at [h, j, l // 8]
    if ggml_type in TWO_LEVEL_SCALES:
        # four chunks of 32 bytes: low nibbles are sub-block 2j, high nibbles sub-block 2j + 1
        qs = words("qs").reshape(n, 4, 4)
        by_sub[:, 0::2] = qs & _M4
        by_sub[:, 1::2] = (qs >> np.uint64(4)) & _M4
        if ggml_type == "Q5_K":  # bit s of qh byte l: the fifth bit of weight 32 s + l
            qh = words("qh")
            for s in range(8):
                by_sub[:, s] |= ((qh >> np.uint64(s)) & _M1) << np.uint64(4)
    elif ggml_type == "Q6_K":
        # each half: ql's 64 bytes, low nibbles weights 0-63, high nibbles 64-127; qh's 32 bytes, 2 bits for j
        ql = words("ql").reshape(n, 2, 2, 4)
        by_half[:, :, 0:2] = ql & _M4
        by_half[:, :, 2:4] = (ql >> np.uint64(4)) & _M4
        qh = words("qh").reshape(n, 2, 4)
        for j in range(4):
            by_half[:, :, j] |= ((qh >> np.uint64(2 * j)) & _M2) << np.uint64(4)
    elif ggml_type in ("Q2_K", "Q3_K"):  # qs in two halves of 32 bytes; each byte holds four 2-bit weights, 32 apart
        qs = words("qs").reshape(n, 2, 4)
        for j in range(4):
            by_half[:, :, j] = (qs >> np.uint64(2 * j)) & _M2
        if ggml_type == "Q3_K":  # bit s of hmask byte l: weight 32 s + l's third bit
            hmask = words("hmask")
            for s in range(8):
                by_sub[:, s] |= ((hmask >> np.uint64(s)) & _M1) << np.uint64(2)
    else:
        raise ValueError(f"ggml_type: expected one of Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, got {ggml_type!r}")
    return out


def kquant_affine(w_blocks: np.ndarray, ggml_type: str, out_features: int,
                  in_features: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, int]:
    """GGUF k-quant bytes (out, in / 256 * bytes per super-block) -> (q uint8 (out, in), scales, biases float32
    (out, in / group), bits, group): the same weights as an affine quantization whose groups are the k-quant's
    sub-blocks, `scales * q + biases` (bits and group: `formats.KQUANT_AFFINE`)."""
    bits, group = KQUANT_AFFINE[ggml_type]
    f = block_format(ggml_type)
    b = _supers(w_blocks, ggml_type)
    if ggml_type in TWO_LEVEL_SCALES:
        sc, mn = scale_min_k4(f.read(b, "scales"))
        scale, bias = f.read(b, "d") * sc, -(f.read(b, "dmin") * mn)  # (n, 8)
    elif ggml_type == "Q6_K":
        scale = f.read(b, "d") * f.read(b, "scales").astype(np.float32)  # (n, 16)
        bias = -32 * scale
    elif ggml_type == "Q2_K":
        scales = f.read(b, "scales")
        scale = f.read(b, "d") * (scales & 0xF).astype(np.float32)
        bias = -(f.read(b, "dmin") * (scales >> 4).astype(np.float32))
    else:  # Q3_K: a set hmask bit means no -4 offset, so q + 4
        scale = f.read(b, "d") * q3k_scales(f.read(b, "scales")).astype(np.float32)
        bias = -4 * scale
    groups = in_features // group
    q = kquant_codes(b, ggml_type)
    return (q.reshape(out_features, in_features), scale.astype(np.float32).reshape(out_features, groups),
            bias.astype(np.float32).reshape(out_features, groups), bits, group)


def kquant_scales(w_blocks: np.ndarray, ggml_type: str, out_features: int,
                  in_features: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A Q4_K or Q5_K matrix's two levels of scales: (d, dmin (out, in / 256) float32, each a float16's value;
    sc, mn (out, in / 32) float32, integers in [0, 64)): block j of super-block s scales by d[s] sc[j] and is
    offset by -dmin[s] mn[j], `kquant_affine`'s scales and biases."""
    if ggml_type not in TWO_LEVEL_SCALES:
        raise ValueError(f"kquant_scales: Q4_K or Q5_K, not {ggml_type}")
    f = block_format(ggml_type)
    b = _supers(w_blocks, ggml_type)
    sc, mn = scale_min_k4(f.read(b, "scales"))
    supers = in_features // QK_K
    return (f.read(b, "d").reshape(out_features, supers), f.read(b, "dmin").reshape(out_features, supers),
            sc.astype(np.float32).reshape(out_features, -1), mn.astype(np.float32).reshape(out_features, -1))


def q6k_scales(w_blocks: np.ndarray, out_features: int) -> tuple[np.ndarray, np.ndarray]:
    """A Q6_K matrix's scales as the file holds them: (sc (out, in / 16) int8, one per 16 weights; d (out, in / 256)
    float16): w = d sc (q - 32)."""
    f = block_format("Q6_K")
    b = _supers(w_blocks, "Q6_K")
    d = np.ascontiguousarray(b[:, f.field("d").offset:f.field("d").stop]).view(np.float16)
    return f.read(b, "scales").reshape(out_features, -1), d.reshape(out_features, -1)
