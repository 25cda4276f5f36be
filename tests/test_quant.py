"""`quant/`, the one home of the quantization formats: each layout against gguf-py's block sizes, each numpy unpacking
against llama.cpp's values (`quant.dequantize`, gguf-py's) bit for bit, MLX's packed layout against `mx.dequantize`,
the kernels' own copies of a layout against `quant`'s, and no format's block constants written anywhere else."""

from __future__ import annotations

import re
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quantize

import quant
from quant.affine import affine_codes, affine_from_gguf
from quant.codebook import dequantize_iq4, mxfp4_codes
from quant.kquant import kquant_affine, kquant_scales, q6k_scales
from quant.mlx_layout import pack_codes
from tests.tiny_models import random_blocks

ROOT = Path(__file__).resolve().parent.parent


def _weights(shape: tuple[int, int], seed: int = 7) -> np.ndarray:
    rng = np.random.default_rng(seed)  # rows of different scales
    return (rng.standard_normal(shape) * rng.uniform(0.01, 3.0, (shape[0], 1))).astype(np.float32)


def _equal(got: np.ndarray, want: np.ndarray) -> None:
    """Equal values in float32 (a zero's sign aside: d * (q - 8) is -0 where d < 0, d q - 8 d is +0)."""
    assert got.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("ggml_type", list(quant.FORMATS))
def test_each_layout_has_gguf_pys_block_size(ggml_type: str) -> None:
    f = quant.FORMATS[ggml_type]
    assert (f.block_weights, f.block_bytes) == GGML_QUANT_SIZES[GGMLQuantizationType[ggml_type]]
    assert [fl.offset for fl in f.fields] == [0] + [fl.stop for fl in f.fields[:-1]]  # packed, in order


def test_a_wrong_type_or_size_is_named() -> None:
    with pytest.raises(ValueError, match=r"ggml_type: expected one of Q4_0, .* got 'Q7_K'"):
        quant.block_format("Q7_K")
    with pytest.raises(ValueError, match=r"raw: 143 bytes do not hold a Q4_K tensor of shape \(1, 256\)"):
        quant.dequantize(np.zeros(143, np.uint8), "Q4_K", (1, 256))


@pytest.mark.parametrize("ggml_type", list(quant.MLX_AFFINE_BITS))
def test_affine_formats_unpack_to_llama_cpps_values(ggml_type: str) -> None:
    """Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 as codes, scales and biases: scale * q + bias is llama.cpp's weight exactly,
    and packed as MLX holds them, `mx.dequantize` gives it too."""
    raw = quantize(_weights((6, 96)), GGMLQuantizationType[ggml_type])
    want = quant.dequantize(raw, ggml_type, (6, 96))
    q, scales, biases = affine_codes(raw, ggml_type, (6, 96))
    bits = quant.MLX_AFFINE_BITS[ggml_type]
    assert q.dtype == np.uint8 and int(q.max()) < 2**bits
    got = (q.reshape(6, 3, 32) * scales[..., None] + biases[..., None]).astype(np.float32).reshape(6, 96)
    _equal(got, want)
    words, s, b, bits = affine_from_gguf(raw, ggml_type, (6, 96))
    got = mx.dequantize(mx.array(words), mx.array(s), mx.array(b), group_size=quant.MLX_GROUP, bits=bits)
    _equal(np.array(got), want)


@pytest.mark.parametrize("ggml_type", quant.KQUANT_TYPES)
def test_kquant_affine_is_the_same_weights(ggml_type: str) -> None:
    """The affine form of each k-quant: exactly the dequantized weights for Q2_K / Q4_K / Q5_K (the same
    products and sums), within two float32 ulps for Q3_K / Q6_K (an offset multiplied out)."""
    out_features, in_features = 5, 512
    w = random_blocks(np.random.default_rng(7), ggml_type, out_features, in_features)
    q, scales, biases, bits, group = kquant_affine(w, ggml_type, out_features, in_features)
    assert (bits, group) == quant.KQUANT_AFFINE[ggml_type] and q.dtype == np.uint8
    assert int(q.max()) < 2 ** quant.KQUANT_CODE_BITS[ggml_type] <= 2**bits
    got = (q.reshape(out_features, -1, group) * scales[..., None] + biases[..., None]).reshape(out_features, -1)
    want = quant.dequantize(w, ggml_type, (out_features, in_features))
    if ggml_type in ("Q2_K", "Q4_K", "Q5_K"):
        _equal(got.astype(np.float32), want)
    else:
        np.testing.assert_allclose(got, want, rtol=2.5e-7, atol=np.abs(want).max() * 2.5e-7)


@pytest.mark.parametrize("ggml_type", quant.TWO_LEVEL_SCALES)
def test_two_level_scales_multiply_out_to_the_affine_form(ggml_type: str) -> None:
    w = random_blocks(np.random.default_rng(3), ggml_type, 4, 768)
    _, scales, biases, _, _ = kquant_affine(w, ggml_type, 4, 768)
    d, dmin, sc, mn = kquant_scales(w, ggml_type, 4, 768)
    assert sc.max() < 64 and mn.max() < 64
    np.testing.assert_array_equal(np.repeat(d, 8, axis=1) * sc, scales)
    np.testing.assert_array_equal(-(np.repeat(dmin, 8, axis=1) * mn), biases)


def test_q6k_scales_are_the_files() -> None:
    w = random_blocks(np.random.default_rng(4), "Q6_K", 4, 512)
    _, scales, _, _, _ = kquant_affine(w, "Q6_K", 4, 512)
    sc, d = q6k_scales(w, 4)
    assert sc.dtype == np.int8 and d.dtype == np.float16 and sc.shape == (4, 32) and d.shape == (4, 2)
    np.testing.assert_array_equal(np.repeat(d.astype(np.float32), 16, axis=1) * sc, scales)


def test_mxfp4_codes_are_llama_cpps_values() -> None:
    raw = quantize(_weights((4, 128)), GGMLQuantizationType.MXFP4)
    q, e = mxfp4_codes(raw, (4, 128))
    e2m1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32)
    got = e2m1[q] * np.repeat(np.exp2(e.astype(np.float32) - 127), 32, axis=1)
    np.testing.assert_array_equal(got, quant.dequantize(raw, "MXFP4", (4, 128)))


@pytest.mark.parametrize("ggml_type", ["IQ4_NL", "IQ4_XS"])
def test_iq4_dequantizes_to_llama_cpps_values(ggml_type: str) -> None:
    raw = random_blocks(np.random.default_rng(3), ggml_type, 16, 512, std=0.5)
    want = quant.dequantize(raw, ggml_type, (16, 512))
    np.testing.assert_array_equal(dequantize_iq4(raw, ggml_type, (16, 512)), want)


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_packed_codes_are_mlx_affine_layout(bits: int) -> None:
    """Read back by `mx.dequantize` with unit scales and zero biases: the codes, for every width MLX packs."""
    q = np.random.default_rng(bits).integers(0, 2**bits, (3, 128)).astype(np.uint8)
    words = pack_codes(q, bits)
    assert words.dtype == np.uint32 and words.shape == (3, 128 * bits // 32)
    unit, zero = mx.ones((3, 2)), mx.zeros((3, 2))
    np.testing.assert_array_equal(np.array(mx.dequantize(mx.array(words), unit, zero, group_size=64, bits=bits)), q)
    with pytest.raises(ValueError, match="rows of 40 codes of 3 bits do not fill whole uint32 words"):
        pack_codes(q[:, :40], 3)


def test_the_metal_kernels_block_sizes_are_quants() -> None:
    """The Metal source cannot import Python: its table of super-block sizes, read from the source, is quant's."""
    src = (ROOT / "kernels_metal" / "kquant_matmul.metal").read_text()
    line = re.search(r"constexpr int BLOCK_BYTES = (.*);", src).group(1)
    table = {f"Q{k}_K": int(v) for k, v in re.findall(r"QTYPE == (\d) \? (\d+)", line)}
    table["Q6_K"] = int(line.rpartition(": ")[2])  # the last arm: QTYPE 6 (the kernel takes 2..6)
    assert table == {t: quant.block_bytes(t) for t in quant.KQUANT_TYPES}


def _layout_literals() -> list[re.Pattern[str]]:
    """Ways a format's block constants get written down: a type mapped to its block bytes (alone or first in a
    tuple) or to its fp16 fields' offsets, and a super-block size or block-bytes constant of one's own."""
    patterns = [re.compile(r"\bQK_K\s*=\s*\d"), re.compile(r"\b\w*BLOCK_BYTES\w*\s*=\s*[{(\d]")]
    for name, f in quant.FORMATS.items():
        offsets = r"\s*,\s*".join(map(str, f.fp16_offsets()))
        facts = [rf"\(?\s*{f.block_bytes}\b"] + ([rf"\(\s*{offsets}\s*,?\s*\)"] if offsets else [])
        patterns += [re.compile(rf"[\"']{name}[\"']\s*:\s*(?:{fact})") for fact in facts]
    return patterns


def test_block_constants_live_only_in_quant() -> None:
    """No Python file outside quant/ writes down a GGUF block format's size, field offsets or super-block size:
    each imports them (the C++ and Metal kernels keep their own, checked above and by their tests)."""
    patterns = _layout_literals()
    found = []
    for folder in ("app", "mlx_engine", "kernels_metal", "bench", "tests"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == Path(__file__).resolve():
                continue
            text = path.read_text()
            found += [f"{path.relative_to(ROOT)}: {m.group(0)}" for p in patterns for m in p.finditer(text)]
    assert found == []


def test_the_literal_check_finds_what_it_looks_for() -> None:
    patterns = _layout_literals()
    for text in ('{"Q6_K": 210}', "_AFFINE_BLOCK = {'Q4_1': (20, 4)}", 'FP16 = {"Q2_K": (80, 82)}', "QK_K = 256",
                 "KQUANT_BLOCK_BYTES = {", '{"Q3_K": (108,)}'):
        assert any(p.search(text) for p in patterns), text
    for text in ('{"Q4_0": 8, "Q5_1": 5}', 'GREEDY = {"Q8_0": 0.078}', "QK = 32"):
        assert not any(p.search(text) for p in patterns), text
