"""Golden files for issue 47's families (tests/data/golden/<name>/), written the way make_golden.py writes
issue 23's: tiny random checkpoints saved by transformers 5 and its float32 logits and greedy tokens.

Run by hand, in the venv make_golden.py describes (torch 2.13.0+cpu, transformers 5.25.0 here):

    /tmp/hf5fam/bin/python tests/golden/make_golden_2026.py [--only lfm2,exaone4]

Each hybrid has both its layer kinds (linear attention / Mamba / short convolution beside full attention), each
MoE 4 experts with top 2, each sliding window 8 tokens (shorter than prompt + continuation), so a model class that
ignores a part fails its logits or its tokens.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
from transformers import (AutoModelForCausalLM, DeepseekV3Config, Exaone4Config, FalconH1Config, Gemma4TextConfig,
                          Glm4MoeConfig, GraniteMoeHybridConfig, Lfm2Config, NemotronHConfig, Olmo3Config,
                          Qwen3_5Config, Qwen3_5ForConditionalGeneration, Qwen3_5MoeTextConfig, Qwen3_5TextConfig,
                          Qwen3NextConfig,
                          SmolLM3Config)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_golden import COMMON, MIN_MARGIN, NUM_PROMPT, ROOT, golden_of, load, write  # noqa: E402

MIN_DISTINCT = 8
FULL, SLIDING, LINEAR = "full_attention", "sliding_attention", "linear_attention"
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
GATED_DELTA = dict(linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
                   linear_num_key_heads=2, linear_num_value_heads=4, layer_types=[LINEAR, FULL],
                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
QWEN3_5_TEXT = dict(GATED_DELTA, tie_word_embeddings=False)
QWEN3_5_VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=14, out_hidden_size=64,
                      num_position_embeddings=16, spatial_merge_size=2, temporal_patch_size=2)

# name -> (config class, config kwargs, base seed)
FAMILIES = {
    "qwen3_5_text": (Qwen3_5TextConfig, QWEN3_5_TEXT, 20000),
    "qwen3_5_moe_text": (Qwen3_5MoeTextConfig, dict(QWEN3_5_TEXT, **MOE, num_experts=4,
                                                     shared_expert_intermediate_size=32), 33000),
    "qwen3_next": (Qwen3NextConfig, dict(GATED_DELTA, **MOE, tie_word_embeddings=False, num_experts=4,
                                         shared_expert_intermediate_size=32, decoder_sparse_step=1,
                                         mlp_only_layers=[]), 21000),
    "granitemoehybrid": (GraniteMoeHybridConfig, dict(tie_word_embeddings=True, layer_types=[LINEAR, FULL],
                                                      num_local_experts=4, num_experts_per_tok=2, intermediate_size=32,
                                                      shared_intermediate_size=32, mamba_n_heads=8, mamba_d_head=16,
                                                      mamba_n_groups=1, mamba_d_state=16, mamba_d_conv=4,
                                                      mamba_expand=2, mamba_chunk_size=16, embedding_multiplier=2.0,
                                                      attention_multiplier=0.1, residual_multiplier=0.5,
                                                      logits_scaling=2.0, position_embedding_type="rope"), 22000),
    "nemotron_h": (NemotronHConfig, dict(tie_word_embeddings=False, layers_block_type=[LINEAR, "moe", FULL, "mlp"],
                                         num_hidden_layers=4, mamba_num_heads=8, mamba_head_dim=16, n_groups=2,
                                         ssm_state_size=16, conv_kernel=4, expand=2, chunk_size=16,
                                         n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                         moe_shared_expert_intermediate_size=32, n_group=1, topk_group=1,
                                         routed_scaling_factor=1.5, num_nextn_predict_layers=0,
                                         mtp_layers_block_type=[]), 23000),
    "falcon_h1": (FalconH1Config, dict(tie_word_embeddings=False, mamba_d_ssm=128, mamba_n_heads=8, mamba_d_head=16,
                                       mamba_n_groups=1, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2,
                                       mamba_chunk_size=16, embedding_multiplier=2.0, lm_head_multiplier=0.5,
                                       key_multiplier=0.7, attention_in_multiplier=0.8, attention_out_multiplier=0.9,
                                       ssm_in_multiplier=1.2, ssm_out_multiplier=0.8, mlp_multipliers=[1.5, 0.5],
                                       ssm_multipliers=[1.0, 0.5, 1.5, 1.0, 0.8]), 24000),
    "lfm2": (Lfm2Config, dict(tie_word_embeddings=True, layer_types=["conv", FULL], full_attn_idxs=[1],
                              block_multiple_of=32, block_auto_adjust_ff_dim=True, conv_L_cache=3), 25000),
    "deepseek_v3": (DeepseekV3Config, dict(MOE, tie_word_embeddings=False, num_key_value_heads=4, q_lora_rank=32,
                                           kv_lora_rank=32, qk_rope_head_dim=8, head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                                           n_routed_experts=4, n_shared_experts=1, n_group=2, topk_group=1,
                                           first_k_dense_replace=1, routed_scaling_factor=2.5,
                                           num_nextn_predict_layers=0), 26000),
    "gemma4_text": (Gemma4TextConfig, dict(tie_word_embeddings=True, hidden_size=80, intermediate_size=64,
                                           sliding_window=8, layer_types=[SLIDING, FULL], global_head_dim=32,
                                           hidden_size_per_layer_input=8, vocab_size_per_layer_input=128,
                                           final_logit_softcapping=10.0), 27000),
    "exaone4": (Exaone4Config, dict(tie_word_embeddings=False, sliding_window=8, sliding_window_pattern=2,
                                    layer_types=[SLIDING, FULL]), 28000),
    "glm4_moe": (Glm4MoeConfig, dict(MOE, tie_word_embeddings=False, n_routed_experts=4, n_shared_experts=1,
                                     first_k_dense_replace=1, use_qk_norm=True, routed_scaling_factor=1.5,
                                     num_nextn_predict_layers=0,
                                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                      "partial_rotary_factor": 0.5}), 29000),
    "olmo3": (Olmo3Config, dict(tie_word_embeddings=False, sliding_window=8, layer_types=[SLIDING, FULL],
                                pad_token_id=0, eos_token_id=2), 30000),
    "smollm3": (SmolLM3Config, dict(tie_word_embeddings=True, no_rope_layers=[1, 0], no_rope_layer_interval=2,
                                    pad_token_id=0, bos_token_id=1, eos_token_id=2), 31000),
}
MULTIMODAL = {"qwen3_5_vlm": 32000}  # Qwen3.5 as released: Qwen3_5ForConditionalGeneration, text_config inside


def randomize_(model: torch.nn.Module, seed: int) -> None:
    """make_golden.randomize_, but every norm drawn around 1: Gemma 4 scales by its weight, not 1 + weight (and a
    1 + weight norm drawn around 1 just scales by about 2). Gemma 4's embeddings are multiplied by sqrt(hidden):
    drawn at 0.3 / sqrt(hidden) as make_golden draws Gemma's."""
    g = torch.Generator().manual_seed(seed)
    hidden = model.config.get_text_config().hidden_size
    embed_std = 0.3 / hidden**0.5 if model.config.model_type.startswith("gemma") else 0.2
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if "norm" in name:
                p.copy_(1.0 + 0.2 * noise)
            elif "embed_tokens" in name:
                p.copy_(embed_std * noise)
            else:
                p.copy_(0.2 * noise)


def build(name: str) -> torch.nn.Module:
    if name == "qwen3_5_vlm":
        config = Qwen3_5Config(text_config={**COMMON, **QWEN3_5_TEXT}, vision_config=QWEN3_5_VISION,
                               tie_word_embeddings=False)
        return Qwen3_5ForConditionalGeneration(config)
    cls, extra, _ = FAMILIES[name]
    return AutoModelForCausalLM.from_config(cls(**{**COMMON, **extra}), attn_implementation="eager")


def main(only: set[str] | None) -> None:
    rng = np.random.default_rng(0)
    input_ids = rng.integers(0, COMMON["vocab_size"], NUM_PROMPT)
    seeds = {**{k: v[2] for k, v in FAMILIES.items()}, **MULTIMODAL}
    for name, base_seed in seeds.items():
        if only is not None and name not in only:
            continue
        folder = ROOT / name
        for seed in range(base_seed, base_seed + 100):
            shutil.rmtree(folder, ignore_errors=True)
            model = build(name)
            randomize_(model, seed)
            model.save_pretrained(folder)
            gold = golden_of(load(folder), input_ids)
            if gold["greedy_margins"].min() >= MIN_MARGIN and len(set(gold["greedy_tokens"].tolist())) >= MIN_DISTINCT:
                break
        else:
            sys.exit(f"{name}: no seed with greedy margins >= {MIN_MARGIN} and {MIN_DISTINCT} distinct greedy tokens")
        write(folder, gold, seed)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated names (default: all)")
    args = parser.parse_args()
    torch.set_num_threads(2)
    main(set(args.only.split(",")) if args.only else None)
