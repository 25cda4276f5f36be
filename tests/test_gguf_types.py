"""The GGUF tensor types beside the k-quants that common files hold (Q5_0, Q5_1, IQ4_NL, IQ4_XS, MXFP4), each
against llama.cpp's own dequantization (`gguf.quants.dequantize`) through the loader's reader, and a model holding
all of them against the folder of its dequantized weights."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from mlx_engine import Engine, GenerationRequest, SamplingParams
from tests.tiny_models import (
    OTHER_LAYOUT,
    folder_with_weights,
    gguf_to_hf_names,
    kquant_llama_gguf,
    kquants_as_float16,
    random_blocks,
)

IDS = [3, 17, 42, 99, 7, 64, 120, 5, 33, 81, 12, 2]


def _file_with(tmp_path: Path, ggml_type: str, raw: np.ndarray, shape: tuple[int, ...]) -> Path:
    import gguf

    path = tmp_path / f"{ggml_type}.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("blk.0.ffn_up.weight", raw, raw_shape=raw.shape, raw_dtype=Q[ggml_type])  # shape in bytes
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _read_back(path: Path) -> np.ndarray:
    """The tensor as the loader holds it, dequantized by MLX (quantized kinds) or as stored (dense kinds)."""
    from mlx_engine.loading.gguf_file import read_gguf
    from mlx_engine.loading.gguf_tensors import read_tensors

    t = read_tensors(read_gguf(path))
    w, scales, biases = t["blk.0.ffn_up.weight"], t.get("blk.0.ffn_up.scales"), t.get("blk.0.ffn_up.biases")
    if scales is None:
        return np.array(w.astype(mx.float32))
    mode = "mxfp4" if scales.dtype == mx.uint8 else "affine"
    if mode == "affine":  # float16 on disk, the activation dtype once built (float32 on the CPU)
        scales, biases = scales.astype(mx.float32), biases.astype(mx.float32)
    bits = 4 if mode == "mxfp4" else w.shape[-1] * 32 // (scales.shape[-1] * 32)
    return np.array(mx.dequantize(w, scales, biases, group_size=32, bits=bits, mode=mode).astype(mx.float32))


def _weights(shape: tuple[int, ...]) -> np.ndarray:
    rng = np.random.default_rng(7)  # rows of different scales, a few outliers
    return (rng.standard_normal(shape) * rng.uniform(0.01, 3.0, (*shape[:-1], 1))).astype(np.float32)


@pytest.mark.parametrize("ggml_type", ["Q5_0", "Q5_1", "MXFP4"])
@pytest.mark.parametrize("shape", [(16, 96), (3, 8, 64)], ids=["matrix", "experts"])
def test_repacked_types_equal_llama_cpp_exactly(tmp_path: Path, ggml_type: str, shape: tuple[int, ...]) -> None:
    """Held as MLX quantized layers (affine 5-bit, mxfp4): MLX's dequantization is llama.cpp's, bit for bit."""
    raw = quantize(_weights(shape), Q[ggml_type])
    want = dequantize(raw, Q[ggml_type]).reshape(shape)
    got = _read_back(_file_with(tmp_path, ggml_type, raw, shape))
    assert got.shape == want.shape
    np.testing.assert_array_equal(got, want)  # maxdiff 0


@pytest.mark.parametrize("ggml_type", ["IQ4_NL", "IQ4_XS"])
def test_iquants_equal_llama_cpp_to_float16(tmp_path: Path, ggml_type: str) -> None:
    """No quantizer for these in gguf-py: random blocks (finite fp16 scales); every nibble and 6-bit scale pattern
    is valid. Dequantized exactly in float32, held as float16: within float16's half ulp."""
    from quant.codebook import dequantize_iq4

    rng = np.random.default_rng(3)
    raw = random_blocks(rng, ggml_type, 16, 512, std=0.5)
    want = dequantize(raw, Q[ggml_type]).reshape(16, 512)
    np.testing.assert_array_equal(dequantize_iq4(raw, ggml_type, (16, 512)), want)  # the float32 unpacking: exact
    got = _read_back(_file_with(tmp_path, ggml_type, raw, (16, 512)))
    np.testing.assert_array_equal(got, want.astype(np.float16).astype(np.float32))


def test_model_of_every_other_type_matches_its_dequantized_folder(tmp_path: Path) -> None:
    gguf_path, src, deq = kquant_llama_gguf(tmp_path, OTHER_LAYOUT)
    ref_folder = folder_with_weights(src, tmp_path / "ref", gguf_to_hf_names(kquants_as_float16(deq, OTHER_LAYOUT)))
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    with Engine.load(str(gguf_path)) as got, Engine.load(str(ref_folder)) as ref:
        maxdiff = float(np.abs(got.forward_logits(IDS) - ref.forward_logits(IDS)).max())
        assert maxdiff <= 1e-4, f"maxdiff {maxdiff:.3e}"
        tokens = [[t for e in m.generate(GenerationRequest(prompt_token_ids=IDS, sampling=params)) for t in e.token_ids]
                  for m in (got, ref)]
        assert tokens[0] == tokens[1]
