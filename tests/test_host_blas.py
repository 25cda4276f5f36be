"""MLX's CPU backend: projections on resident float32 weights in numpy's BLAS give MLX's own numbers.

The fast path (backends.mlx.host_blas.use_host_weights) replaces every quantized projection by a float32 copy,
fuses q/k/v and gate/up into one GEMM each and multiplies a tied head by the embedding's copy; these
tests hold it to MLX's quantized matmuls on a tiny model, at decode, batched-decode and prefill widths,
and check the memory it reports to the byte.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from threadpoolctl import threadpool_info

from mlx_engine import Engine, RooflineError
from mlx_engine.attention import host
from mlx_engine.backends.mlx import host_blas
from mlx_engine.models.llama import Model, ModelArgs
from tests.support.tiny_models import random_llama_folder, write_gguf_from_folder
from tests.support.tolerance import assert_f32_close

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB, LAYERS = 64, 4, 2, 16, 96, 160, 2


def tiny_model(tied: bool, bias: bool = False, bits: int = 4) -> Model:
    mx.random.seed(3)
    args = ModelArgs(model_type="llama", hidden_size=HIDDEN, num_hidden_layers=LAYERS, intermediate_size=FFN,
                     num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, vocab_size=VOCAB,
                     tie_word_embeddings=tied, qkv_bias=bias)
    model = Model(args)
    if bias:  # zero-initialized biases would test nothing
        for layer in model.layers:
            for p in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                p.bias = mx.random.normal(p.bias.shape)
    nn.quantize(model, group_size=32, bits=bits)
    mx.eval(model.parameters())
    return model


def logits(model: Model, ids: mx.array) -> np.ndarray:
    return np.array(model.logits(model(ids)))


INPUTS = {
    "decode, 1 row": mx.array([[7]]),
    "batched decode, 5 rows": mx.array([[7], [1], [150], [42], [9]]),
    "prefill, 24 rows": mx.array([list(range(3, 27))]),
}


@pytest.mark.parametrize("tied,bias", [(True, False), (False, True)], ids=["tied-head", "untied-head+qkv-bias"])
def test_resident_weights_match_mlx_quantized_matmuls(tied: bool, bias: bool) -> None:
    model = tiny_model(tied, bias)
    want = {name: logits(model, ids) for name, ids in INPUTS.items()}
    quantized_bytes = {name: sum(v.nbytes for v in m.values() if isinstance(v, mx.array))
                       for name, m in model.named_modules() if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))}
    expected_host = host_blas.host_weights_bytes(model)

    allocated, idle = host_blas.use_host_weights(model)

    # every projection (q k v o gate up down per layer) plus the head, in float32, plus qkv biases
    per_layer = HIDDEN * (HEADS * HEAD_DIM + 2 * KV_HEADS * HEAD_DIM) + HEADS * HEAD_DIM * HIDDEN + 3 * HIDDEN * FFN
    floats = LAYERS * per_layer + VOCAB * HIDDEN
    biases = LAYERS * (HEADS + 2 * KV_HEADS) * HEAD_DIM if bias else 0
    assert expected_host == 4 * floats
    assert allocated == 4 * (floats + biases)
    if not tied:  # an untied input embedding stays a lookup into the packed table
        quantized_bytes.pop("model.embed_tokens")
    assert idle == sum(quantized_bytes.values())  # the packed copies the float32 path no longer reads
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    assert attn.fused_qkv.weight.shape == (HIDDEN, (HEADS + 2 * KV_HEADS) * HEAD_DIM)
    assert mlp.fused_gate_up.weight.shape == (HIDDEN, 2 * FFN)
    head = model.model.embed_tokens if tied else model.lm_head
    assert head.host.weight.shape == (HIDDEN, VOCAB) and head.host.weight.flags.c_contiguous

    for name, ids in INPUTS.items():
        got = logits(model, ids)
        scale = np.abs(want[name]).max()
        assert np.abs(got - want[name]).max() <= 2e-5 * scale, name
        assert (got.argmax(-1) == want[name].argmax(-1)).all(), name


def test_non_float32_inputs_take_the_modules_own_path() -> None:
    model = tiny_model(tied=True)
    proj = model.layers[0].self_attn.o_proj
    x = mx.random.normal((2, HEADS * HEAD_DIM)).astype(mx.bfloat16)
    want = np.array(proj(x).astype(mx.float32))
    want_head = np.array(model.model.embed_tokens.as_linear(x[:, :HIDDEN]).astype(mx.float32))
    host_blas.use_host_weights(model)
    assert isinstance(proj, nn.QuantizedLinear) and proj.host is not None
    np.testing.assert_array_equal(np.array(proj(x).astype(mx.float32)), want)
    np.testing.assert_array_equal(np.array(model.model.embed_tokens.as_linear(x[:, :HIDDEN]).astype(mx.float32)),
                                  want_head)
    # lookups stay on MLX's packed table
    ids = mx.array([[5, 9]])
    np.testing.assert_array_equal(np.array(model.model.embed_tokens(ids)),
                                  np.array(nn.QuantizedEmbedding.__call__(model.model.embed_tokens, ids)))


def test_float32_weights_are_used_in_place() -> None:
    mx.random.seed(0)
    lin = nn.Linear(48, 80)
    x = mx.random.normal((3, 48))
    want = np.array(lin(x))
    model = nn.Sequential(lin)
    allocated, idle = host_blas.use_host_weights(model)
    assert (allocated, idle) == (0, 0)  # a view of MLX's buffer: nothing new resident, nothing idle
    np.testing.assert_allclose(np.array(lin(x)), want, rtol=1e-5, atol=1e-5)


def test_fp32_weights_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(host_blas.HOST_WEIGHTS_ENV, "off")
    assert host_blas.host_weights_fit(1, 10**12)[0] is False
    monkeypatch.setenv(host_blas.HOST_WEIGHTS_ENV, "on")
    assert host_blas.host_weights_fit(10**12, 1)[0] is True
    monkeypatch.setenv(host_blas.HOST_WEIGHTS_ENV, "auto")
    assert host_blas.host_weights_fit(500, 1000)[0] is True  # within HOST_WEIGHTS_MEMORY_FRACTION = 0.5
    assert host_blas.host_weights_fit(501, 1000)[0] is False
    monkeypatch.setenv(host_blas.HOST_WEIGHTS_ENV, "fast")
    with pytest.raises(RooflineError, match=r"ROOFLINE_CPU_FP32_WEIGHTS='fast': expected auto, on or off"):
        host_blas.host_weights_fit(1, 1)


def test_one_blas_thread_nests_and_restores() -> None:
    def threads() -> int:  # numpy's OpenBLAS (and any other BLAS loaded, e.g. by torch)
        return max((i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"), default=1)

    before = threads()
    with host_blas.one_blas_thread():
        assert threads() == 1
        with host_blas.one_blas_thread():
            assert threads() == 1
        assert threads() == 1  # the inner exit leaves the outer limit in place
    assert threads() == before


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hostw")
    folder = random_llama_folder(root / "hf", vocab=160)
    path = root / "tiny-q4_1.gguf"
    write_gguf_from_folder(folder, path, {"attn": "Q4_1", "ffn": "Q4_1"}, default_type="Q4_1")
    return path


def test_engine_on_and_off_agree_and_count_the_copies(tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same GGUF with and without resident float32 weights: the same greedy tokens, logits within
    float32 rounding, and the float32 copies counted in weight bytes, decode bytes and peak memory."""
    from tests.support.loading import greedy

    ids = [3, 17, 42, 99, 7, 64, 120, 5, 33, 81, 12, 2] * 2
    runs = {}
    for setting in ("off", "on"):
        monkeypatch.setenv(host_blas.HOST_WEIGHTS_ENV, setting)
        engine = Engine.load(str(tiny_gguf))
        try:
            runner = engine.diagnostics().runner
            runs[setting] = dict(tokens=greedy(engine, ids), logits=engine.forward_logits(ids),
                                 weight_bytes=engine.info.weight_bytes, notes=engine.info.notes,
                                 host=runner._host_bytes, decode=runner.decode_bytes_per_token(0),
                                 idle=runner._shape["idle_bytes"])
        finally:
            engine.close()
    off, on = runs["off"], runs["on"]
    assert on["tokens"] == off["tokens"]
    np.testing.assert_allclose(on["logits"], off["logits"], atol=2e-5 * np.abs(off["logits"]).max())
    assert off["host"] == 0 and "quantized weights stay packed (ROOFLINE_CPU_FP32_WEIGHTS=off)" in off["notes"][0]
    # every matrix but the untied input embedding (a row lookup) gets a float32 copy
    h, v, ffn, heads, kv, hd, n = 64, 160, 96, 4, 2, 16, 2
    floats = n * (h * (heads + 2 * kv) * hd + heads * hd * h + 3 * h * ffn) + v * h
    assert on["host"] == 4 * floats
    assert on["weight_bytes"] == off["weight_bytes"] + on["host"]
    assert on["decode"] == off["decode"] - on["idle"] + on["host"]
    assert "float32 copies of the weights" in on["notes"][0]


@pytest.mark.parametrize("rows", [2, 5, 8])
def test_row_gemvs_over_column_slices_equal_one_gemm(rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Small row counts go through one gemv per row and column slice (OpenBLAS's sgemm repacks the whole
    weight for them); slices of 3 columns here so that the slicing, ragged last slice included, is used."""
    monkeypatch.setattr(host_blas, "GEMV_SLICE_BYTES", 4 * 40 * 3)
    rng = np.random.default_rng(rows)
    x, w = rng.standard_normal((rows, 40), dtype=np.float32), rng.standard_normal((40, 23), dtype=np.float32)
    np.testing.assert_allclose(host_blas._gemv_rows(x, w), x @ w, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(host_blas._gemv_rows(x, w.T.copy().T), x @ w, rtol=1e-5, atol=1e-5)  # a strided view
    got = np.array(host_blas._host_gemm(mx.array(x), w, bias=np.arange(23, dtype=np.float32)))
    np.testing.assert_allclose(got, x @ w + np.arange(23), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("length,keys,causal", [(1, 300, False), (5, 5, True), (24, 150, True), (7, 200, False)])
def test_host_attention_equals_mlx_sdpa(length: int, keys: int, causal: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """GQA (9 query heads over 3 KV heads), queries aligned with the last keys, and query slabs of 2 rows
    (HOST_ATTENTION_MAX_SCORES shrunk) so that the slab loop and its causal offsets are used."""
    monkeypatch.setattr(host, "HOST_ATTENTION_MAX_SCORES", 2 * 9 * keys)
    monkeypatch.setattr(host, "HOST_ATTENTION_MIN_PAIRS", 1)
    mx.random.seed(length)
    q = mx.random.normal((1, 9, length, 32))
    k, v = mx.random.normal((1, 3, keys, 32)), mx.random.normal((1, 3, keys, 32))
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.3, mask="causal" if causal else None)
    got = host.sdpa(q, k, v, 0.3, causal)
    # float32 floor: 6.1 units (tests/support/tolerance.py) on an AMD EPYC; x4.6 headroom
    assert_f32_close(np.array(got), np.array(want), 28, "host vs MLX sdpa")
    cuts = [0, keys // 3, keys // 3 + 1, keys]  # three segments, one of a single key (a paged sequence's runs)
    parts = lambda x: [x[:, :, a:b] for a, b in zip(cuts[:-1], cuts[1:])]  # noqa: E731
    # float32 floor: 5.8 units (tests/support/tolerance.py) on an AMD EPYC; x4 headroom
    assert_f32_close(np.array(host.sdpa(q, parts(k), parts(v), 0.3, causal)), np.array(want), 24, "segments")
    monkeypatch.setattr(host, "HOST_ATTENTION_MIN_PAIRS", 10**9)  # MLX's kernel over the segments joined
    # float32 floor: 0.0 units (tests/support/tolerance.py) on an AMD EPYC; the same allowance as its twin above
    assert_f32_close(np.array(host.sdpa(q, parts(k), parts(v), 0.3, causal)), np.array(want), 24, "joined")
    monkeypatch.setattr(host, "HOST_ATTENTION_MIN_PAIRS", 1)
    if causal:  # the first query sees keys 0..keys-length only: changing a later key leaves it alone
        k2 = mx.concatenate([k[:, :, : keys - length + 1], k[:, :, keys - length + 1:] * 7], axis=2)
        first = np.array(host.sdpa(q, k2, v, 0.3, True))[:, :, 0]
        np.testing.assert_allclose(first, np.array(got)[:, :, 0], rtol=1e-6, atol=1e-7)
