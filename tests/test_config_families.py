"""Configs read once, for every family (mlx_engine.models.config): transformers-5 fields and multimodal
`text_config` brought to one form before a model class sees them, and one line, no traceback, for a config
no class can run. The families' logits and greedy tokens against transformers: tests/test_engine_parity_golden.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from mlx_engine.api import ModelLoadError
from mlx_engine.models.config import normalize_config, text_weights
from tests.support.cli import assert_one_line_error, roofline
from tests.support.tiny_models import GOLDEN


def config_of(name: str) -> dict:
    return json.loads((GOLDEN / name / "config.json").read_text())


def test_gemma3_rope_per_layer_type_and_layer_types() -> None:
    c = normalize_config(config_of("gemma3_text"))
    assert c["rope_theta"] == 1e6 and c["rope_local_base_freq"] == 10000.0
    assert c["rope_scaling"] == {"rope_type": "linear", "type": "linear", "factor": 8.0}
    # layer_types [sliding, sliding, full, sliding]: layer i is full iff (i + 1) % 3 == 0
    assert c["sliding_window_pattern"] == 3 and c["sliding_window"] == 8


def test_phi3_partial_rotary_and_qwen3_moe_experts_lifted() -> None:
    phi3 = normalize_config(config_of("phi3"))
    assert phi3["partial_rotary_factor"] == 0.75 and phi3["rope_theta"] == 10000.0 and phi3["rope_scaling"] is None
    moe = normalize_config(config_of("qwen3_moe"))
    assert "num_experts" not in config_of("qwen3_moe")  # transformers 5 writes num_local_experts
    assert moe["num_experts"] == moe["num_local_experts"] == 4 and moe["num_experts_per_tok"] == 2


def test_yarn_keeps_its_fields_and_legacy_scaling_gets_both_type_keys() -> None:
    oss = normalize_config(config_of("gpt_oss"))
    assert oss["rope_theta"] == 150000.0
    assert oss["rope_scaling"]["truncate"] is False and oss["rope_scaling"]["original_max_position_embeddings"] == 64
    legacy = normalize_config({"model_type": "phi3", "rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert legacy["rope_scaling"] == {"type": "linear", "rope_type": "linear", "factor": 2.0}
    assert legacy["rope_theta"] == 5e5


def test_multimodal_text_config_becomes_the_config() -> None:
    raw = config_of("gemma3_vlm")
    assert raw["model_type"] == "gemma3" and "num_hidden_layers" not in raw
    c = normalize_config(raw)
    assert c["model_type"] == "gemma3_text" and c["multimodal_model_type"] == "gemma3"
    assert c["num_hidden_layers"] == 2 and c["vocab_size"] == 128 and c["tie_word_embeddings"] is True
    assert c["sliding_window_pattern"] == 2 and c["rope_local_base_freq"] == 10000.0
    weights = {"language_model.model.norm.weight": 1, "language_model.lm_head.weight": 2,
               "vision_tower.embeddings.patch_embedding.weight": 3, "multi_modal_projector.mm_soft_emb_norm.weight": 4}
    assert text_weights(weights, c) == {"model.norm.weight": 1, "lm_head.weight": 2}
    # transformers 5's own layout of the same (model.language_model.*, top-level lm_head)
    v5 = {"model.language_model.norm.weight": 1, "lm_head.weight": 2, "model.vision_tower.x.weight": 3}
    assert text_weights(v5, c) == {"model.norm.weight": 1, "lm_head.weight": 2}


def test_transformers5_hybrid_layer_kinds_in_each_class_form() -> None:
    """Issue 47: `layer_types` with linear_attention / conv beside full_attention, as each mlx-lm class reads it."""
    assert normalize_config(config_of("qwen3_next"))["full_attention_interval"] == 2  # [linear, full]
    assert normalize_config(config_of("granitemoehybrid"))["layer_types"] == ["mamba", "attention"]
    lfm2 = normalize_config(config_of("lfm2"))
    assert lfm2["block_dim"] == 64 and lfm2["full_attn_idxs"] == [1]  # transformers writes neither
    assert normalize_config(config_of("exaone4"))["sliding_window_pattern"] == "LG"
    # every kind transformers 5 allows passes (DeepSeek-V3.2's indexer layers, Zamba 2's hybrids)
    for kind in ("indexed_attention", "hybrid", "compressed_sparse_attention"):
        assert normalize_config({"model_type": "x", "layer_types": [kind]})["layer_types"] == [kind]


def test_derived_fields_infinity_and_per_layer_head_sizes() -> None:
    raw = config_of("exaone4")
    del raw["head_dim"]  # as EXAONE 4's own configs: transformers derives it, mlx-lm's class requires it
    assert normalize_config(raw)["head_dim"] == 64 // 4
    nemotron = normalize_config(config_of("nemotron_h"))
    assert config_of("nemotron_h")["time_step_limit"][1] == {"__float__": "Infinity"}
    assert nemotron["time_step_limit"] == [0.0, float("inf")]
    gemma4 = normalize_config(config_of("gemma4_text"))
    assert config_of("gemma4_text")["per_layer_config"] == {"1": {"head_dim": 32}}
    assert gemma4["global_head_dim"] == 32 and gemma4["head_dim"] == 16
    assert gemma4["rope_scaling"]["rope_type"] == "proportional"


def test_qwen3_5_multimodal_lifts_its_text_config() -> None:
    raw = config_of("qwen3_5_vlm")
    assert raw["model_type"] == "qwen3_5" and raw["text_config"]["model_type"] == "qwen3_5_text"
    c = normalize_config(raw)
    assert c["model_type"] == "qwen3_5_text" and c["multimodal_model_type"] == "qwen3_5"
    assert c["full_attention_interval"] == 2 and c["num_hidden_layers"] == 2


@pytest.mark.parametrize("name", sorted(p.name for p in GOLDEN.iterdir() if (p / "config.json").exists()))
def test_normalize_is_idempotent(name: str) -> None:
    once = normalize_config(config_of(name))
    assert normalize_config(once) == once


def _folder_with_config(tmp_path: Path, src: str, edit) -> Path:
    dst = tmp_path / src
    shutil.copytree(GOLDEN / src, dst)
    config = json.loads((dst / "config.json").read_text())
    edit(config)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def _drop(*keys: str):
    return lambda c: [c.pop(k) for k in keys]


BAD_CONFIGS = {
    "unknown architecture": ("llama", lambda c: c.update(model_type="florp"),
                             ["unsupported architecture 'florp'", "llama, mistral, qwen2, qwen3"]),
    # the two refusals, now only where the field is really absent (neither rope_parameters nor rope_theta)
    "granite without rope_theta": ("granite", _drop("rope_parameters"),
                                   ["config.json has no 'rope_theta'", "mlx-lm's 'granite' model"]),
    "qwen3_moe without experts": ("qwen3_moe", _drop("num_local_experts", "num_experts_per_tok"),
                                  ["config.json has no 'num_experts', 'num_experts_per_tok'", "'qwen3_moe'"]),
    "native family without a field": ("llama", _drop("hidden_size"), ["config.json has no 'hidden_size'"]),
    "layer_types no gemma3 can run": ("gemma3_text", lambda c: c.update(layer_types=[
        "full_attention", "sliding_attention", "sliding_attention", "full_attention"]),
        ["layer_types", "not a repeating pattern"]),
    "layer_types too short": ("gemma2", lambda c: c.update(layer_types=["sliding_attention"]),
                              ["layer_types has 1 entries for num_hidden_layers=2"]),
    "sliding layers without a window": ("gpt_oss", lambda c: c.update(sliding_window=None),
                                        ["sliding_attention layers but sliding_window is None"]),
    # issue 47: a hybrid whose layer_types names a kind no class runs
    "unknown layer kind": ("qwen3_next", lambda c: c.update(layer_types=["linear_attention", "florp_attention"]),
                           ["config.json", "layer_types[1] is 'florp_attention'", "linear_attention"]),
    "rope type nobody runs": ("olmo2", lambda c: c.update(rope_parameters={"rope_type": "florp", "rope_theta": 1.0}),
                              ["unsupported rope type 'florp'"]),
}


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_bad_config_is_one_line(tmp_path: Path, case: str) -> None:
    from mlx_engine import Engine

    src, edit, needles = BAD_CONFIGS[case]
    folder = _folder_with_config(tmp_path, src, edit)
    with pytest.raises(ModelLoadError) as e:
        Engine.load(str(folder))
    message = str(e.value)
    assert "\n" not in message and str(folder) in message, message
    for needle in needles:
        assert needle in message, message


@pytest.mark.parametrize("case", ["unknown architecture", "granite without rope_theta", "qwen3_moe without experts",
                                  "unknown layer kind"])
def test_bad_config_from_the_cli_is_one_line_without_traceback(tmp_path: Path, case: str) -> None:
    src, edit, needles = BAD_CONFIGS[case]
    folder = _folder_with_config(tmp_path, src, edit)
    r = roofline("logits", "-m", str(folder), "--token-ids", "1,2,3", "-o", str(tmp_path / "out.npy"))
    assert_one_line_error(r, str(folder), *needles)


def test_weights_of_another_shape_are_one_line(tmp_path: Path) -> None:
    """A checkpoint whose weights do not fit its config: the names on one line, not mlx's list of lines."""
    folder = _folder_with_config(tmp_path, "mixtral", lambda c: c.update(num_local_experts=2))
    r = roofline("logits", "-m", str(folder), "--token-ids", "1,2,3", "-o", str(tmp_path / "out.npy"))
    assert_one_line_error(r, "weights do not match the 'mixtral' architecture")


def test_multimodal_checkpoint_runs_as_its_text_model() -> None:
    from mlx_engine import Engine

    gold = np.load(GOLDEN / "gemma3_vlm" / "golden.npz")
    with Engine.load(str(GOLDEN / "gemma3_vlm")) as e:
        assert e.info.model_type == "gemma3_text" and e.info.vocab_size == 128
        assert float(np.abs(e.forward_logits(gold["input_ids"].tolist()) - gold["logits"]).max()) <= 1e-4


# --- `roofline kv` for sliding-window and mixture-of-experts configs ------------------------------------------


def test_kv_counts_gemma3_sliding_layers_at_their_window(tmp_path: Path) -> None:
    """Gemma 3 12B as it ships (multimodal, text_config, a 5:1 sliding pattern of 1,024 tokens): at 100K tokens the
    8 full layers hold every token, the 40 sliding ones 1,024 each: 6.9 GB, not the 39.3 GB of 48 full layers."""
    text = {"model_type": "gemma3_text", "hidden_size": 3840, "num_hidden_layers": 48, "num_attention_heads": 16,
            "num_key_value_heads": 8, "head_dim": 256, "sliding_window": 1024, "sliding_window_pattern": 6,
            "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "max_position_embeddings": 131072}
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma3", "text_config": text,
                                                      "vision_config": {"model_type": "siglip_vision_model"}}))
    r = roofline("kv", "--model", str(tmp_path), "--context", "100000", "--dtype", "float16")
    assert r.returncode == 0, r.stderr
    # (8 x 100,000 + 40 x 1,024) layer-tokens x 8 KV heads x 256 x 2 bytes x (K, V)
    assert r.stdout.startswith("6.9 GB (6,889,144,320 bytes) of KV for 1 x 100,000 tokens in float16: 48 layers")
    assert "393,216 bytes per token" in r.stdout
    assert "sliding window: 40 of 48 layers attend to the last 1,024 tokens" in r.stdout
    assert "past the window a token adds 65,536 bytes" in r.stdout


def test_kv_reads_a_moe_config_and_says_the_experts_add_none(tmp_path: Path) -> None:
    """Qwen3-30B-A3B's config (transformers 5 names: num_local_experts, rope_parameters)."""
    config = {"model_type": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 32,
              "num_key_value_heads": 4, "head_dim": 128, "num_local_experts": 128, "num_experts_per_tok": 8,
              "moe_intermediate_size": 768, "max_position_embeddings": 40960,
              "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    r = roofline("kv", "--model", str(tmp_path), "--context", "32768", "--batch", "2", "--dtype", "float16")
    assert r.returncode == 0, r.stderr
    assert "(6,442,450,944 bytes) of KV for 2 x 32,768 tokens" in r.stdout and "98,304 bytes per token" in r.stdout
    assert "mixture of experts: 128 experts, 8 per token" in r.stdout and "sliding" not in r.stdout


def test_kv_of_a_gguf_reads_its_sliding_layers(tmp_path: Path) -> None:
    from tests.support.gguf_writer import write_family_gguf

    path = write_family_gguf(GOLDEN / "gpt_oss", tmp_path / "oss.gguf")
    r = roofline("kv", "--model", str(path), "--context", "100", "--dtype", "float16")
    assert r.returncode == 0, r.stderr
    # one full layer of 100 tokens, one sliding layer of 8, 2 KV heads x 16 x 2 bytes x (K, V)
    assert "(13,824 bytes) of KV for 1 x 100 tokens" in r.stdout
    assert "sliding window: 1 of 2 layers attend to the last 8 tokens" in r.stdout
    assert "mixture of experts: 4 experts, 2 per token" in r.stdout


def test_logits_command_on_nemotron_h(tmp_path: Path) -> None:
    """Issue 47: `roofline logits` failed on Nemotron-H (`Invalid type dict`: its time_step_limit's infinity)."""
    from tests.support.tolerance import HEADROOM, assert_f32_close

    gold = np.load(GOLDEN / "nemotron_h" / "golden.npz")
    out = tmp_path / "out.npy"
    ids = ",".join(str(t) for t in gold["input_ids"].tolist())
    r = roofline("logits", "-m", str(GOLDEN / "nemotron_h"), "--token-ids", ids, "-o", str(out))
    assert r.returncode == 0, r.stderr
    assert_f32_close(np.load(out), gold["logits"], 14 * HEADROOM, "nemotron_h")  # floor: test_engine_parity_families


def test_kv_of_deepseek_v3_counts_the_mla_latent(tmp_path: Path) -> None:
    """DeepSeek-V3's config: 61 layers keep a 576-element latent (kv_lora_rank 512 + rope 64) per token, 70 KB in
    float16, not the 5.0 MB of 128 heads' K (192) and V (128)."""
    config = {"model_type": "deepseek_v3", "hidden_size": 7168, "num_hidden_layers": 61, "num_attention_heads": 128,
              "num_key_value_heads": 128, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
              "qk_nope_head_dim": 128, "v_head_dim": 128, "n_routed_experts": 256, "num_experts_per_tok": 8,
              "max_position_embeddings": 163840, "rope_theta": 10000, "vocab_size": 129280}
    (tmp_path / "config.json").write_text(json.dumps(config))
    r = roofline("kv", "--model", str(tmp_path), "--context", "32768", "--dtype", "float16")
    assert r.returncode == 0, r.stderr
    # 61 x 576 x 2 bytes = 70,272 a token; x 32,768
    assert r.stdout.startswith("2.3 GB (2,302,672,896 bytes) of KV for 1 x 32,768 tokens in float16: 61 layers x "
                               "one MLA latent of 576, 70,272 bytes per token"), r.stdout
    assert "would take 4,997,120 bytes per token" in r.stdout  # 61 x 128 x (192 + 128) x 2
    assert "mixture of experts: 256 experts, 8 per token" in r.stdout


@pytest.mark.parametrize("name, kv_layers", [("qwen3_next", 1), ("lfm2", 1), ("granitemoehybrid", 1),
                                             ("nemotron_h", 1), ("qwen3_5_vlm", 1), ("falcon_h1", 2)])
def test_kv_of_a_hybrid_counts_only_its_attention_layers(name: str, kv_layers: int) -> None:
    r = roofline("kv", "--model", str(GOLDEN / name), "--context", "100", "--dtype", "float16")
    assert r.returncode == 0, r.stderr
    # 2 KV heads x 16 x 2 bytes x (K, V) = 128 bytes a token and attention layer
    assert f"({kv_layers * 12_800:,} bytes) of KV for 1 x 100 tokens" in r.stdout, r.stdout
    assert ("keep no KV of their own" in r.stdout) == (name != "falcon_h1"), r.stdout  # Falcon-H1: attention in every layer


def test_kv_of_gemma4_counts_wide_full_layers_and_shared_kv(tmp_path: Path) -> None:
    """Gemma 4 E2B's shape as transformers 5 writes it: 35 layers, a 4:1 sliding pattern of 512 tokens, the last
    20 layers reusing earlier layers' KV, full-attention heads of 512 (`per_layer_config`) beside sliding ones of
    256, one KV head. The 15 layers that store KV: 12 sliding, 3 full."""
    types = ["full_attention" if (i + 1) % 5 == 0 else "sliding_attention" for i in range(35)]
    config = {"model_type": "gemma4_text", "hidden_size": 1536, "num_hidden_layers": 35, "num_attention_heads": 8,
              "num_key_value_heads": 1, "head_dim": 256, "sliding_window": 512, "layer_types": types,
              "num_kv_shared_layers": 20, "max_position_embeddings": 131072,
              "per_layer_config": {str(i): {"head_dim": 512} for i, t in enumerate(types) if t == "full_attention"},
              "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                  "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                     "rope_theta": 1e6}}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    r = roofline("kv", "--model", str(tmp_path), "--context", "100000", "--dtype", "float16")
    assert r.returncode == 0, r.stderr
    # 12 sliding x 512 tokens x 256 x 2 bytes x (K, V) + 3 full x 100,000 x 512 x 2 x 2
    assert "(620,691,456 bytes) of KV for 1 x 100,000 tokens" in r.stdout, r.stdout
    assert "(3 full-attention layers: 1 x 512), 18,432 bytes per token" in r.stdout, r.stdout
    assert "20 of 35 layers keep no KV of their own" in r.stdout
    assert "sliding window: 12 of 15 layers attend to the last 512 tokens" in r.stdout
    assert "past the window a token adds 6,144 bytes" in r.stdout


@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "granitemoehybrid", "nemotron_h",
                                  "falcon_h1", "lfm2"])
def test_recurrent_state_bytes_are_what_mlx_lm_caches_hold(name: str) -> None:
    """The state a hybrid's recurrent layers keep per sequence (what the fit check adds and `roofline kv` prints),
    from its config alone, against the bytes mlx-lm's caches hold after a forward in float32."""
    import mlx.core as mx
    from mlx_lm.models.cache import ArraysCache, CacheList

    from mlx_engine.catalog import kv_shape
    from mlx_engine.loading import load_checkpoint
    from mlx_engine.memory import state_bytes
    from mlx_engine.models import build_model

    ckpt = load_checkpoint(str(GOLDEN / name))
    model = build_model(ckpt.config, ckpt.weights, mx.float32, None, name).model.inner  # mlx-lm's class, adapted
    cache = model.make_cache()
    mx.eval(model(mx.array([[1, 2, 3, 4, 5]]), cache=cache))

    def arrays(c):
        if isinstance(c, CacheList):
            return [a for inner in c.caches for a in arrays(inner)]
        return [a for a in c.cache if a is not None] if isinstance(c, ArraysCache) else []

    held = sum(a.nbytes for c in cache for a in arrays(c))
    assert held > 0 and state_bytes(kv_shape(str(GOLDEN / name)), 1, 4) == held


def test_kv_of_a_hybrid_prints_its_recurrent_state() -> None:
    r = roofline("kv", "--model", str(GOLDEN / "qwen3_next"), "--context", "100", "--batch", "2", "--dtype", "float16")
    assert r.returncode == 0, r.stderr
    # one Gated DeltaNet layer: a conv window of 3 x (2 x 2 x 16 + 4 x 16) in float16, 4 x 16 x 16 float32
    assert "recurrent state: 9,728 bytes for 2 sequences whatever their length (4,864 each" in r.stdout, r.stdout
