"""Loading: GGUF (quantized, Q/K un-permuted), MLX-quantized folders, fp16, and every bad input named."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from mlx_engine import Engine, GenerationRequest, ModelLoadError, RequestError, SamplingParams
from tests.support.loading import _quantized_folder, greedy
from tests.support.tiny_models import (
    GOLDEN,
    folder_with_weights,
    gguf_to_hf_names,
    kquant_llama_gguf,
    kquants_as_float16,
    write_gguf_from_folder,
)
from tests.support.tolerance import assert_f32_close

IDS = [3, 17, 42, 99, 7, 64, 120, 5, 33, 81, 12, 2]


@pytest.mark.parametrize(
    "qtypes",
    [
        {},  # every matrix Q8_0
        {"attn": "Q4_0", "ffn": "Q4_1"},
        {"ffn_down": "F16", "attn_q": "Q4_1"},
    ],
    ids=["q8_0", "q4_0+q4_1", "f16+q4_1"],
)
def test_gguf_matches_dequantized_folder(tmp_path: Path, qtypes: dict[str, str]) -> None:
    """A GGUF written the way llama.cpp writes llama (Q/K rows permuted, quantized blocks) gives the same
    logits as the HF folder holding its dequantized weights: proves the tensor mapping, the un-permutation
    and MLX's Q4_0/Q4_1/Q8_0 mapping."""
    src = GOLDEN / "llama"
    gguf_path = tmp_path / "tiny.gguf"
    deq = write_gguf_from_folder(src, gguf_path, qtypes)
    ref_folder = folder_with_weights(src, tmp_path / "ref", gguf_to_hf_names(deq))
    with Engine.load(str(gguf_path)) as got, Engine.load(str(ref_folder)) as ref:
        assert got.info.source_format == "gguf" and ref.info.source_format == "safetensors"
        a, b = got.forward_logits(IDS), ref.forward_logits(IDS)
        maxdiff = float(np.abs(a - b).max())
        assert maxdiff <= 1e-4, f"maxdiff {maxdiff}"
        assert greedy(got, IDS) == greedy(ref, IDS)


@pytest.fixture(scope="module")
def kquant_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """`kquant_llama_gguf`'s file and the folder of its dequantized weights, the k-quants rounded to float16
    as the loader keeps them."""
    tmp = tmp_path_factory.mktemp("kquant")
    gguf_path, src, deq = kquant_llama_gguf(tmp)
    return gguf_path, folder_with_weights(src, tmp / "ref", gguf_to_hf_names(kquants_as_float16(deq)))


def test_gguf_with_kquants_matches_its_dequantized_folder(kquant_gguf: tuple[Path, Path]) -> None:
    """Q2_K..Q6_K dequantized at load (bit for bit gguf's dequantizer, then float16), Q4_0 / Q4_1 repacked
    by the loader's own reader: the logits of the float folder. MLX's GGUF loader alone fails on Q3_K and
    Q5_K and gets Q4_K wrong."""
    gguf_path, ref_folder = kquant_gguf
    with Engine.load(str(gguf_path)) as got, Engine.load(str(ref_folder)) as ref:
        assert got.info.quantization == "Q6_K"  # the largest share of the bytes (lm_head, o_proj)
        a, b = got.forward_logits(IDS), ref.forward_logits(IDS)
        assert float(np.abs(a - b).max()) <= 1e-4
        assert greedy(got, IDS) == greedy(ref, IDS)


def test_torch_backend_reads_the_kquant_gguf_alike(kquant_gguf: tuple[Path, Path],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.support.torch_support import require

    require("torch")
    monkeypatch.setenv("ROOFLINE_TORCH_CPU_PACKED", "0")  # float32 weights, as MLX's (the packed path: its own tests)
    gguf_path, _ = kquant_gguf
    with Engine.load(str(gguf_path)) as mlx_side, Engine.load(str(gguf_path), backend="torch", device="cpu") as t:
        a, b = mlx_side.forward_logits(IDS), t.forward_logits(IDS)
        # float32 floor: 72.8 units (tests/support/tolerance.py: 1.6e-4 on max |logit| 18.3) on an AMD EPYC; x4 headroom
        assert_f32_close(b, a, 300, "torch vs MLX")
        assert greedy(mlx_side, IDS) == greedy(t, IDS)


def test_own_reader_equals_mx_load_on_types_mlx_reads(tmp_path: Path) -> None:
    """The reader used for k-quant files gives, on F32 / F16 / Q4_0 / Q4_1 / Q8_0, exactly what mx.load gives."""
    from mlx_engine.loading.gguf_file import read_gguf
    from mlx_engine.loading.gguf_tensors import read_tensors

    path = tmp_path / "mixed.gguf"
    write_gguf_from_folder(GOLDEN / "llama", path, {"attn_q": "Q4_0", "attn_k": "Q4_1", "ffn_down": "F16"})
    ours, theirs = read_tensors(read_gguf(path)), mx.load(str(path))
    assert sorted(ours) == sorted(theirs) and any(k.endswith(".scales") for k in ours)
    for name in theirs:
        assert ours[name].dtype == theirs[name].dtype and ours[name].shape == theirs[name].shape, name
        assert mx.array_equal(ours[name], theirs[name]).item(), name


def test_gguf_type_still_unsupported_is_named(tmp_path: Path) -> None:
    path = tmp_path / "iq2.gguf"
    import gguf
    from gguf.constants import GGMLQuantizationType as Q

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    data = np.zeros((4, 66), dtype=np.uint8)  # 4 rows of one 256-wide IQ2_XXS block (66 bytes)
    w.add_tensor("token_embd.weight", data, raw_dtype=Q.IQ2_XXS)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match=r"IQ2_XXS is not loadable.*Q5_0, Q5_1.*IQ4_NL, IQ4_XS, MXFP4"):
        Engine.load(str(path))


def test_mlx_quantized_folder_with_per_layer_override(tmp_path: Path) -> None:
    override = {"model.layers.0.mlp.down_proj": {"bits": 8, "group_size": 32}, "lm_head": False}
    qdir, ddir = _quantized_folder(tmp_path, bits=4, group_size=32, override=override)
    with Engine.load(str(qdir)) as got, Engine.load(str(ddir)) as ref:
        assert got.info.source_format == "mlx-quantized" and got.info.quantization == "4-bit g32"
        layer = got.diagnostics().runner.model.model.layers[0]
        assert layer.mlp.down_proj.bits == 8 and layer.mlp.up_proj.bits == 4
        a, b = got.forward_logits(IDS), ref.forward_logits(IDS)
        assert float(np.abs(a - b).max()) <= 1e-4
        assert greedy(got, IDS) == greedy(ref, IDS)


def test_fp16_checkpoint_runs_in_float32_on_cpu(tmp_path: Path) -> None:
    src = GOLDEN / "llama"
    dst = tmp_path / "fp16"
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    w16 = {k: v.astype(np.float16) for k, v in load_file(str(src / "model.safetensors")).items()}
    save_file(w16, str(dst / "model.safetensors"))
    ref = folder_with_weights(src, tmp_path / "ref", {k: v.astype(np.float32) for k, v in w16.items()})
    with Engine.load(str(dst)) as got, Engine.load(str(ref)) as want:
        assert got.info.dtype == "float32"
        assert float(np.abs(got.forward_logits(IDS) - want.forward_logits(IDS)).max()) <= 1e-5


def test_embedded_model_info() -> None:
    with Engine.load(None) as e:
        info = e.info
        assert info.source_format == "gguf" and info.model_type == "llama" and info.quantization == "Q4_1"
        assert info.context_length == 8192 and info.vocab_size == 49152
        assert 134_000_000 <= info.num_parameters <= 136_000_000
        assert 2 in info.eos_token_ids


# --- bad input -----------------------------------------------------------------------------------------


def test_missing_path_says_what_was_looked_for(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"model not found.*looked for"):
        Engine.load(str(tmp_path / "nope" / "model.gguf"))


def test_folder_without_config(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="no config.json"):
        Engine.load(str(tmp_path))


def test_truncated_safetensors_named(tmp_path: Path) -> None:
    dst = tmp_path / "m"
    shutil.copytree(GOLDEN / "llama", dst)
    data = (dst / "model.safetensors").read_bytes()
    (dst / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match=r"model.safetensors: corrupt or truncated safetensors file: tensor"):
        Engine.load(str(dst))


def test_garbage_safetensors_header_named(tmp_path: Path) -> None:
    dst = tmp_path / "m"
    shutil.copytree(GOLDEN / "llama", dst)
    data = bytearray((dst / "model.safetensors").read_bytes())
    data[8:40] = b"\xff" * 32
    (dst / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match="header is not valid JSON"):
        Engine.load(str(dst))


@pytest.mark.parametrize("damage", ["truncate", "header_noise", "not_gguf"])
def test_corrupt_gguf_named_never_crashes(tmp_path: Path, damage: str) -> None:
    """MLX's own GGUF reader segfaults on some of these; ours names the file and the problem. Run in a
    subprocess so a crash would fail this test instead of killing the suite."""
    path = tmp_path / "bad.gguf"
    write_gguf_from_folder(GOLDEN / "llama", path, {})
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[: len(data) - 5000]
    elif damage == "header_noise":
        data[8:4008] = np.random.default_rng(1).integers(0, 256, 4000, dtype=np.uint8).tobytes()
    else:
        data = b"PK\x03\x04" + data[4:]
    path.write_bytes(bytes(data))
    code = (
        "import sys\nfrom mlx_engine import Engine, ModelLoadError\n"
        f"try:\n    Engine.load({str(path)!r})\nexcept ModelLoadError as e:\n    print(e); sys.exit(3)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 3, (r.returncode, r.stdout, r.stderr)
    assert str(path) in r.stdout
    expected = {"truncate": "extends past the end of the file", "header_noise": "corrupt or truncated GGUF",
                "not_gguf": "not a GGUF file"}[damage]
    assert expected in r.stdout


def test_unsupported_architecture_names_supported(tmp_path: Path) -> None:
    dst = tmp_path / "m"
    shutil.copytree(GOLDEN / "llama", dst)
    config = json.loads((dst / "config.json").read_text())
    config["model_type"] = "florp"
    (dst / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"unsupported architecture 'florp'.*llama, mistral, qwen2, qwen3"):
        Engine.load(str(dst))


def test_fallback_runs_mlx_lm_class(tmp_path: Path) -> None:
    """A model_type we don't implement but mlx-lm does runs on mlx-lm's class, on the paged KV through
    models.adapter: smollm3 with rope in every layer is llama, so the llama golden logits must come out."""
    dst = tmp_path / "m"
    shutil.copytree(GOLDEN / "llama", dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(model_type="smollm3", no_rope_layers=[1, 1], rope_theta=10000.0)
    (dst / "config.json").write_text(json.dumps(config))
    golden = np.load(GOLDEN / "llama" / "golden.npz")
    with Engine.load(str(dst)) as e:
        assert not e.info.native and any("mlx-lm's model class" in n for n in e.info.notes)
        assert e.kv_stats()["kind"] == "paged" and e.info.warnings == ()
        ids = golden["input_ids"].ravel().tolist()
        assert float(np.abs(e.forward_logits(ids) - golden["logits"].reshape(len(ids), -1)).max()) <= 1e-4
        assert greedy(e, ids, 8) == golden["greedy_tokens"].ravel()[:8].tolist()


def test_prompt_longer_than_context_gives_both_numbers() -> None:
    with Engine.load(str(GOLDEN / "llama")) as e:
        with pytest.raises(RequestError, match=r"prompt is 300 tokens but the model's context is 256 tokens"):
            e.generate(GenerationRequest(prompt_token_ids=[5] * 300))


@pytest.mark.parametrize(
    "kwargs, field",
    [({"temperature": -1.0}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
     ({"max_tokens": 0}, "max_tokens"), ({"top_k": -3}, "top_k"), ({"temperature": float("nan")}, "temperature")],
)
def test_invalid_sampling_values(kwargs: dict, field: str) -> None:
    with pytest.raises(RequestError, match=rf"invalid sampling parameter {field}="):
        SamplingParams(**kwargs)


def test_token_id_outside_vocab() -> None:
    with Engine.load(str(GOLDEN / "llama")) as e:
        with pytest.raises(RequestError, match=r"token id 500 is outside the vocabulary \(0..127\)"):
            e.generate(GenerationRequest(prompt_token_ids=[1, 500]))


def test_unknown_load_option() -> None:
    from mlx_engine import RooflineError

    with pytest.raises(RooflineError, match="unknown Engine.load option"):
        Engine.load(str(GOLDEN / "llama"), kv_bitz=4)


def _fake_hf_cache(root: Path, repo_id: str, src: Path) -> None:
    """The layout huggingface_hub writes: models--org--name/{refs/main, snapshots/<rev>/files}."""
    repo = root / "hub" / f"models--{repo_id.replace('/', '--')}"
    rev = "0123456789abcdef0123456789abcdef01234567"
    snap = repo / "snapshots" / rev
    shutil.copytree(src, snap)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(rev)


def _load_in_subprocess(ref: str, hf_home: Path) -> subprocess.CompletedProcess:
    code = (
        "import sys\nfrom mlx_engine import Engine, ModelLoadError\n"
        f"try:\n    e = Engine.load({ref!r})\nexcept ModelLoadError as err:\n    print('ERR', err); sys.exit(3)\n"
        "print('OK', e.info.source_format, e.info.model_type)\n"
    )
    env = {**__import__("os").environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)


def test_repo_id_resolved_from_local_hf_cache_offline(tmp_path: Path) -> None:
    _fake_hf_cache(tmp_path, "tiny-org/tiny-qwen3", GOLDEN / "qwen3")
    r = _load_in_subprocess("tiny-org/tiny-qwen3", tmp_path)
    assert r.stdout.strip() == "OK hf-cache qwen3", r.stderr


def test_repo_id_not_cached_and_offline_is_clear(tmp_path: Path) -> None:
    r = _load_in_subprocess("tiny-org/not-here", tmp_path)
    assert r.returncode == 3
    assert "'tiny-org/not-here' is not in the local Hugging Face cache and HF_HUB_OFFLINE is set" in r.stdout


@pytest.mark.parametrize("embedding", ["Q4_0", "Q6_K"])
def test_kquant_layers_read_the_blocks(tmp_path: Path, monkeypatch, embedding: str) -> None:
    """What Metal runs: k-quant matrices kept as blocks (`models.kquant`), read through
    `kernels_metal.dequant_matmul_kquant` (its reference here) for up to 8 rows and dequantized for more.
    The logits are those of the exact dequantized weights: float32 here, where the float16 copies differ."""
    from mlx_engine.models import kquant
    from mlx_engine.models.kquant import KQuantEmbedding, KQuantLinear
    from tests.support.tiny_models import KQUANT_LAYOUT, random_llama_folder

    src = random_llama_folder(tmp_path / "src", num_heads=4, num_kv_heads=2, head_dim=64, hidden=256)
    path = tmp_path / "k.gguf"
    deq = write_gguf_from_folder(src, path, {**KQUANT_LAYOUT, "token_embd": embedding})
    exact = folder_with_weights(src, tmp_path / "exact", gguf_to_hf_names(deq))
    calls = []
    original = kquant.dequant_matmul_kquant
    monkeypatch.setattr(kquant, "dequant_matmul_kquant", lambda x, *a: calls.append(x.shape[0]) or original(x, *a))
    monkeypatch.setattr(kquant, "blocks_here", lambda: True)
    with Engine.load(str(path)) as got, Engine.load(str(exact)) as want:
        attn = got.diagnostics().runner.model.layers[0].self_attn
        assert isinstance(attn.q_proj, KQuantLinear) and attn.q_proj.ggml_type == "Q4_K"
        assert isinstance(got.diagnostics().runner.model.lm_head, KQuantLinear)
        embed = got.diagnostics().runner.model.model.embed_tokens
        assert isinstance(embed, KQuantEmbedding) == embedding.endswith("_K")
        assert got.info.num_parameters == want.info.num_parameters
        a, b = got.forward_logits(IDS), want.forward_logits(IDS)  # 12 rows: dequantized
        # float32 floor: 28.9 units (tests/support/tolerance.py) on an AMD EPYC; x4 headroom
        assert_f32_close(a, b, 120, "k-quant layers vs dequantized")
        # decode rows, the kernel's path: the same tokens and log-probabilities
        runs = []
        for engine in (got, want):
            events = list(engine.generate(GenerationRequest(prompt_token_ids=IDS, sampling=SamplingParams(
                temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0))))
            runs.append(([t for e in events for t in e.token_ids], [lp.logprob for e in events for lp in e.logprobs]))
        assert runs[0][0] == runs[1][0]
        # float32 floor: 59.1 units (tests/support/tolerance.py) on an AMD EPYC; x4 headroom
        assert_f32_close(runs[0][1], runs[1][1], 240, "decode logprobs")
    assert 1 in calls


def test_kquant_blocks_for_a_layer_that_cannot_hold_them_are_a_load_error() -> None:
    import mlx.core as mx

    from mlx_engine.models import build_model

    config = json.loads((GOLDEN / "llama" / "config.json").read_text())
    with pytest.raises(ModelLoadError, match=r"m.gguf: k-quant blocks .* a RMSNorm cannot hold k-quant blocks"):
        build_model(config, {}, mx.float32, {"model.norm": {"kquant": "Q4_K"}}, "m.gguf")


def test_resolve_takes_a_path_object_as_its_string():
    """A pathlib.Path is a ref like its string (it crashed in the store-prefix check with an AttributeError)."""
    from mlx_engine.catalog import kv_shape
    from mlx_engine.loading import resolve

    folder = Path(__file__).parent / "data" / "golden" / "gemma2"
    assert resolve(folder) == resolve(str(folder))
    assert kv_shape(folder) == kv_shape(str(folder))
    assert kv_shape(folder).sliding_window == 8
