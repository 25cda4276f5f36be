"""GGUF for issue 23's families, as llama.cpp writes them (tests/support/gguf_writer.py), against the transformers
golden of the checkpoint each file was written from; quantized experts against the file holding their values as floats;
llama.cpp's defaults where a file lacks a key; one line for an architecture no table maps."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from mlx_engine import Engine, GenerationRequest, ModelLoadError, SamplingParams
from tests.support.cli import assert_one_line_error, roofline
from tests.support.gguf_writer import write_family_gguf
from tests.support.tiny_models import GOLDEN

FAMILIES = ["phi3", "gemma2", "gemma3_text", "olmo2", "granite", "qwen3_moe", "mixtral", "starcoder2", "gpt_oss"]
LOGITS_TOL = 1e-4  # as tests/test_engine_parity_golden.py: float32 both sides, observed <= 1.1e-5


def greedy(engine: Engine, ids: list[int], n: int) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    return [t for e in engine.generate(GenerationRequest(prompt_token_ids=ids, sampling=params)) for t in e.token_ids]


@pytest.mark.parametrize("name", FAMILIES)
def test_family_gguf_matches_transformers(tmp_path: Path, name: str) -> None:
    gold = np.load(GOLDEN / name / "golden.npz")
    path = write_family_gguf(GOLDEN / name, tmp_path / f"{name}.gguf")
    ids = gold["input_ids"].tolist()
    with Engine.load(str(path)) as e:
        assert e.info.source_format == "gguf" and e.info.model_type == name
        maxdiff = float(np.abs(e.forward_logits(ids) - gold["logits"]).max())
        assert maxdiff <= LOGITS_TOL, f"{name}: maxdiff {maxdiff:.3e}"
        assert greedy(e, ids, len(gold["greedy_tokens"])) == gold["greedy_tokens"].tolist()


@pytest.mark.parametrize("name, qtype, tensors", [
    ("mixtral", "Q4_0", ("_exps",)),  # stacked experts (E, out, in) in MLX's affine groups: QuantizedSwitchLinear
    ("qwen3_moe", "Q8_0", ("_exps", "attn_q.")),
    ("gpt_oss", "MXFP4", ("_exps",)),  # as gpt-oss ships: experts in MXFP4, MLX's mxfp4 mode
    ("phi3", "Q5_1", ("attn_qkv", "ffn_up")),
    ("starcoder2", "Q5_0", ("ffn_",)),
])
def test_quantized_family_gguf_matches_its_float_twin(tmp_path: Path, name: str, qtype: str,
                                                      tensors: tuple[str, ...]) -> None:
    quantized = write_family_gguf(GOLDEN / name, tmp_path / "q.gguf", qtype, tensors)
    twin = write_family_gguf(GOLDEN / name, tmp_path / "f.gguf", qtype, tensors, as_float=True)
    from mlx_engine.loading import load_checkpoint

    # held as MLX quantized layers, not dequantized: affine 4 / 5 / 8 bits or mxfp4, groups of 32
    spec = load_checkpoint(str(quantized)).quantization
    want = {"Q4_0": (4, "affine"), "Q8_0": (8, "affine"), "Q5_0": (5, "affine"), "Q5_1": (5, "affine"),
            "MXFP4": (4, "mxfp4")}[qtype]
    held = {(v["bits"], v.get("mode", "affine")) for k, v in spec.items() if isinstance(v, dict)}
    assert held == {want}, spec
    ids = np.load(GOLDEN / name / "golden.npz")["input_ids"].tolist()
    with Engine.load(str(quantized)) as q, Engine.load(str(twin)) as f:
        maxdiff = float(np.abs(q.forward_logits(ids) - f.forward_logits(ids)).max())
        assert maxdiff <= LOGITS_TOL, f"{name} {qtype}: maxdiff {maxdiff:.3e}"
        assert greedy(q, ids, 12) == greedy(f, ids, 12)


def _config_of(tmp_path: Path, name: str, drop: tuple[str, ...]) -> dict:
    """gguf_config of `name`'s GGUF with metadata keys ending in `drop` removed (as llama.cpp's converter writes)."""
    import gguf

    from mlx_engine.loading.gguf_file import read_gguf
    from mlx_engine.loading.gguf_model import gguf_config

    src = gguf.GGUFReader(str(write_family_gguf(GOLDEN / name, tmp_path / "full.gguf")))
    w = gguf.GGUFWriter(str(tmp_path / "lean.gguf"), src.fields["general.architecture"].contents())
    for key, field in src.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key.endswith(drop):
            continue
        value = field.contents()
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_key_value(key, value, vtype, sub_type=field.types[-1])
        else:
            w.add_key_value(key, value, vtype)
    for t in src.tensors:
        w.add_tensor(t.name, np.asarray(t.data), raw_shape=list(reversed(t.shape.tolist())), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return gguf_config(read_gguf(tmp_path / "lean.gguf"))


def test_gemma_without_the_extra_keys_follows_llama_cpp(tmp_path: Path) -> None:
    """What llama.cpp's converter writes for Gemma 3: no pattern, no local base, no scale: llama.cpp's rules."""
    c = _config_of(tmp_path, "gemma3_text", (".attention.scale", ".sliding_window_pattern", ".rope.freq_base_swa"))
    assert c["layer_types"] == ["sliding_attention"] * 4  # period 6: layers 0..4 slide
    assert c["rope_local_base_freq"] == 10000.0 and c["query_pre_attn_scalar"] == c["head_dim"] == 16
    g2 = _config_of(tmp_path, "gemma2", (".attention.scale",))
    assert g2["layer_types"] == ["sliding_attention", "full_attention"] and g2["query_pre_attn_scalar"] == 16
    assert g2["attn_logit_softcapping"] == 5.0 and g2["final_logit_softcapping"] == 10.0


def _gguf_of_arch(tmp_path: Path, arch: str) -> Path:
    import gguf

    path = tmp_path / f"{arch}.gguf"
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_unmapped_architecture_lists_the_supported_ones(tmp_path: Path) -> None:
    path = _gguf_of_arch(tmp_path, "mamba")
    with pytest.raises(ModelLoadError, match=r"unsupported GGUF architecture 'mamba' \(supported: llama, .*gemma3.*"
                                             r"qwen3moe.*gpt-oss\)"):
        Engine.load(str(path))
    r = roofline("logits", "-m", str(path), "--token-ids", "1,2", "-o", str(tmp_path / "o.npy"))
    assert_one_line_error(r, "unsupported GGUF architecture 'mamba'", "phi3", "starcoder2")
