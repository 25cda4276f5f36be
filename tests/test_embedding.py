"""Embedding models at the engine: tiny random sentence-transformers checkpoints (tests/golden/make_embedding_golden.py)
against sentence-transformers' own `encode`, every pooling mode, Matryoshka truncation, packed forwards against one
input at a time, a GGUF file's pooling type, and bad input refused in one line naming the input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from mlx_engine import Engine, ModelLoadError, RequestError, RooflineError
from mlx_engine.api import EmbedderLike

from tests.tiny_models import GOLDEN
from tests.tolerance import assert_f32_close

LAST, MEAN = GOLDEN / "st_qwen3_last", GOLDEN / "st_qwen3_mean"
SENTENCES = json.loads((LAST / "sentences.json").read_text())
# measured floors (units of eps32 x max|want|) against sentence-transformers on torch: 3-14 here, x HEADROOM 4
VS_ST = 56
# packed against alone, a GGUF against the same weights in safetensors: the same math over other row counts, which
# numpy's BLAS (the projections on MLX's CPU backend) blocks differently: measured up to 11.5 here, x HEADROOM 4
PACKED = 48
# numpy's attention per input against MLX's masked attention over the packed row: measured 5.8 here, x HEADROOM 4
PACKED_VS_TWIN = 24


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


@pytest.fixture(scope="module")
def last() -> Engine:
    with Engine.load(str(LAST)) as engine:
        yield engine


@pytest.fixture(scope="module")
def mean() -> Engine:
    with Engine.load(str(MEAN)) as engine:
        yield engine


@pytest.mark.parametrize("name", ["last", "mean"])
def test_encode_matches_sentence_transformers(name: str, request: pytest.FixtureRequest) -> None:
    engine = request.getfixturevalue(name)
    gold = np.load((LAST if name == "last" else MEAN) / "golden.npz")
    assert isinstance(engine, EmbedderLike) and engine.info.embeddings
    for prompt_name, want in ((None, gold["plain"]), ("query", gold["query"])):
        got = engine.embed(SENTENCES, prompt_name=prompt_name)
        assert got.vectors.shape == want.shape == (len(SENTENCES), 64) and got.vectors.dtype == np.float32
        assert cosines(got.vectors, want).min() >= 0.9999
        assert_f32_close(got.vectors, want, VS_ST, f"{name} {prompt_name}")


def test_layouts_are_read_from_the_checkpoint(last, mean) -> None:
    assert (last.layout.pooling, last.layout.normalize, last.layout.include_prompt) == ("lasttoken", True, True)
    assert (mean.layout.pooling, mean.layout.normalize, mean.layout.include_prompt) == ("mean", False, False)
    assert last.layout.prompts["query"] == "Instruct: find it\nQuery: " and last.info.context_length == 256
    np.testing.assert_allclose(np.linalg.norm(last.embed(SENTENCES).vectors, axis=1), 1.0, atol=1e-6)


def test_usage_counts_each_inputs_tokens_with_its_prompt(last, mean) -> None:
    # byte-level tokens, one per character, and the appended <|endoftext|>
    assert last.embed(SENTENCES).num_tokens == tuple(len(s.encode()) + 1 for s in SENTENCES)
    prompt = len("Instruct: find it\nQuery: ")
    assert last.embed(["abc"], prompt_name="query").prompt_tokens == prompt + 4
    # include_prompt False: the prefix's tokens count in usage, though the mean leaves them out
    assert mean.embed(["abc"], prompt_name="query").num_tokens == (len("query: abc") + 1,)


def test_cls_pooling(tmp_path: Path) -> None:
    folder = shutil.copytree(MEAN, tmp_path / "cls")
    config = json.loads((folder / "1_Pooling" / "config.json").read_text())
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({**config, "pooling_mode": "cls"}))
    with Engine.load(str(folder)) as engine:
        assert engine.layout.pooling == "cls"
        got = engine.embed(SENTENCES).vectors
    want = np.load(MEAN / "golden.npz")["cls"]
    assert cosines(got, want).min() >= 0.9999
    assert_f32_close(got, want, VS_ST, "cls")


def test_dimensions_truncate_and_renormalize(last, mean) -> None:
    full = np.load(LAST / "golden.npz")["plain"]
    got = last.embed(SENTENCES, dimensions=16).vectors
    want = full[:, :16] / np.linalg.norm(full[:, :16], axis=1, keepdims=True)
    assert got.shape == (len(SENTENCES), 16)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-6)
    assert_f32_close(got, want, VS_ST, "dimensions=16")
    # a model without Normalize is truncated as it is
    raw = np.load(MEAN / "golden.npz")["plain"]
    assert_f32_close(mean.embed(SENTENCES, dimensions=8).vectors, raw[:, :8], VS_ST, "mean dimensions=8")


def test_64_inputs_packed_equal_each_alone(last) -> None:
    rng = np.random.default_rng(7)
    inputs = [rng.integers(0, 128, int(n)).tolist() for n in rng.integers(1, 40, 64)]
    assert sum(map(len, inputs)) > 1024  # more than one pack (embedding.packed.PACK_TOKENS)
    packed = last.embed(inputs).vectors
    alone = np.concatenate([last.embed([ids]).vectors for ids in inputs])
    assert packed.shape == (64, 64)
    assert_f32_close(packed, alone, PACKED, "packed vs alone")


def test_one_input_of_token_ids_and_one_string(last) -> None:
    ids = last.tokenizer.encode(SENTENCES[0])
    np.testing.assert_array_equal(last.embed(ids).vectors, last.embed([ids]).vectors)
    np.testing.assert_array_equal(last.embed(SENTENCES[0]).vectors, last.embed([ids]).vectors)


@pytest.mark.parametrize("inputs, kwargs, words", [
    ([], {}, "input is empty"),
    (["fine", ""], {}, "input[1] is an empty string"),
    (["x" * 300], {}, "input[0] is 301 tokens but the model's context is 256 tokens"),
    ([[1, 2], [3, 999]], {}, "input[1]: token id 999 is outside the vocabulary (0..135)"),
    ([[1, 2], "a"], {}, "input[1] is a str"),
    ([[1], []], {}, "input[1] is an empty list"),
    (["a"], {"prompt_name": "passage"}, "prompt_name='passage' is not one of this model's prompts ('document', "
                                        "'query'"),
    ([[1, 2]], {"prompt_name": "query"}, "prompt_name='query' applies to text inputs"),
    (["a"], {"dimensions": 0}, "dimensions=0: expected an integer from 1 to 64"),
    (["a"], {"dimensions": 65}, "dimensions=65: expected an integer from 1 to 64"),
])
def test_bad_input_is_one_line_naming_the_part(last, inputs, kwargs, words) -> None:
    with pytest.raises(RequestError) as e:
        last.embed(inputs, **kwargs)
    assert words in str(e.value) and "\n" not in str(e.value)
    assert last.embed(["still healthy"]).vectors.shape == (1, 64)


def test_an_embedding_model_refuses_to_generate(last) -> None:
    from mlx_engine import GenerationRequest

    with pytest.raises(RequestError, match="is an embedding model: it answers embeddings"):
        last.generate(GenerationRequest(prompt="hi"))


def test_a_chat_model_is_no_embedding_model() -> None:
    with Engine.load(str(GOLDEN / "qwen3")) as engine:
        assert not engine.info.embeddings and not isinstance(engine, EmbedderLike)


def test_unsupported_layouts_and_options_are_one_line(tmp_path: Path) -> None:
    folder = shutil.copytree(LAST, tmp_path / "bert")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "bert"}))
    with pytest.raises(ModelLoadError, match="not 'bert' .bidirectional encoders such as BERT"):
        Engine.load(str(folder))
    folder = shutil.copytree(LAST, tmp_path / "max")
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_max_tokens": True}))
    with pytest.raises(ModelLoadError, match="pooling max is not supported"):
        Engine.load(str(folder))
    with pytest.raises(RooflineError, match="an embedding model takes no kv_bits"):
        Engine.load(str(LAST), kv_bits=8)


def test_gguf_pooling_type_from_metadata(tmp_path: Path, last) -> None:
    from safetensors.numpy import load_file, save_file

    from tests.gguf_writer import write_family_gguf

    hf = tmp_path / "hf"
    hf.mkdir()
    shutil.copy(LAST / "config.json", hf / "config.json")
    save_file({f"model.{k}": v for k, v in load_file(str(LAST / "model.safetensors")).items()},
              str(hf / "model.safetensors"))
    # the same weights as a sentence-transformers folder under mean pooling + Normalize (llama.cpp normalizes)
    st_mean = shutil.copytree(LAST, tmp_path / "st_mean")
    (st_mean / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode": "mean"}))
    ids = [[5, 6, 7, 128], [9, 10, 11, 12, 13, 128], [40, 128]]
    for pooling_type, name, folder in ((3, "lasttoken", LAST), (1, "mean", st_mean)):
        path = write_family_gguf(hf, tmp_path / f"emb{pooling_type}.gguf", pooling_type=pooling_type)
        with Engine.load(str(path)) as engine, Engine.load(str(folder)) as st:
            assert engine.info.embeddings and engine.layout.pooling == name and engine.layout.normalize
            assert engine.info.source_format == "gguf" and st.layout.pooling == name
            assert_f32_close(engine.embed(ids).vectors, st.embed(ids).vectors, PACKED, f"gguf {name}")
    plain = write_family_gguf(hf, tmp_path / "chat.gguf")
    with Engine.load(str(plain)) as engine:
        assert not engine.info.embeddings


def test_the_embedding_engine_has_the_engine_surface(last) -> None:
    from tests.test_engine_like import mismatches

    assert mismatches(last) == [] and mismatches(last, EmbedderLike) == []


def run_cli(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str, str]:
    from app.cli import main

    rc = main(list(args))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_roofline_embed_prints_or_writes_npy(tmp_path: Path, capsys: pytest.CaptureFixture, last) -> None:
    out = tmp_path / "v.npy"
    rc, _, err = run_cli(capsys, "embed", "-m", str(LAST), *SENTENCES[:3], "-o", str(out), "--prompt-name", "query")
    assert rc == 0 and f"wrote {out} float32 (3, 64)" in err
    np.testing.assert_array_equal(np.load(out), last.embed(SENTENCES[:3], prompt_name="query").vectors)
    rc, printed, _ = run_cli(capsys, "embed", "-m", str(LAST), "a", "b", "--dimensions", "8")
    rows = np.array([json.loads(line) for line in printed.splitlines()], dtype=np.float32)
    assert rc == 0 and rows.shape == (2, 8)
    np.testing.assert_allclose(rows, last.embed(["a", "b"], dimensions=8).vectors, rtol=1e-6, atol=1e-7)


def test_roofline_embed_refuses_a_chat_model_in_one_line(capsys: pytest.CaptureFixture) -> None:
    rc, _, err = run_cli(capsys, "embed", "-m", str(GOLDEN / "qwen3"), "hi")
    assert rc == 2 and err.count("\n") == 1 and "is a chat model: it has no pooling" in err


@pytest.mark.parametrize("window", [None, 5])
def test_per_input_attention_equals_its_masked_twin(window: int | None) -> None:
    """The fast path (each input's attention alone, attention.host.sdpa) against one attention over the packed row
    under a block-diagonal causal mask, with and without a sliding window."""
    from mlx_engine.embedding.model import load_decoder
    from mlx_engine.embedding.packed import embed_packed

    model = load_decoder(str(LAST)).model
    model.args.sliding_window = window
    rng = np.random.default_rng(3)
    inputs = [rng.integers(0, 128, int(n)).tolist() for n in (1, 9, 30, 4, 17)]
    for pooling in ("lasttoken", "mean"):
        fast = embed_packed(model, inputs, pooling, [0] * 5)
        twin = embed_packed(model, inputs, pooling, [0] * 5, masked=True)
        assert_f32_close(fast, twin, PACKED_VS_TWIN, f"window {window} {pooling}")
    if window is not None:  # the window shows: the last token of a 30-token input sees 5, not 30
        model.args.sliding_window = None
        assert not np.allclose(embed_packed(model, inputs, "lasttoken", [0] * 5), fast)


def test_roofline_bench_gives_embeddings_rows(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "bench.json"
    rc, printed, _ = run_cli(capsys, "bench", "-m", str(LAST), "-p", "12", "-b", "1,3", "-r", "2", "--json", str(out))
    assert rc == 0 and "embed b=1 p=12" in printed and "embed b=3 p=12" in printed
    result = json.loads(out.read_text())
    assert result["schema"] == "roofline-bench-embed-1" and [r["batch"] for r in result["rows"]] == [1, 3]
    for r in result["rows"]:
        t = float(np.median(r["seconds"]))
        assert len(r["seconds"]) == 2 and r["inputs_per_s"] == pytest.approx(r["batch"] / t)
        assert r["tokens_per_s"] == pytest.approx(12 * r["batch"] / t)
    rc, _, err = run_cli(capsys, "bench", "-m", str(LAST), "-p", "300", "-b", "1", "-r", "1")
    assert rc == 2 and "-p 300: the model's context is 256 tokens" in err
