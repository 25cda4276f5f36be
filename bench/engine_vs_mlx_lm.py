"""Roofline's engine against mlx-lm's `stream_generate` on the same weights, in one run.

    uv run python bench/engine_vs_mlx_lm.py [--model M] [--prompt-tokens 64] [--gen-tokens 32] [--repeats 3]

Both run the weights Roofline loads (the embedded SmolLM2 Q4_1 GGUF by default: mlx-lm cannot read
GGUF, so its own llama class gets our loaded, renamed, un-permuted tensors), both with float32
activations on MLX's CPU backend (or the same dtype on Metal), greedy, the same prompt ids. Runs
alternate (ours, theirs, ours, ...) so load on the machine hits both alike. Prints a markdown table
with medians, ratios, peak memory, and decode as % of this machine's measured copy bandwidth.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

from mlx_engine import Engine, GenerationRequest, SamplingParams  # noqa: E402
from mlx_engine.roofline import DecodeBytes, decode_bytes_per_token, measure_bandwidth  # noqa: E402


def mlx_lm_model(engine: Engine):
    """mlx-lm's llama Model holding exactly our engine's (already quantized and cast) parameters."""
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama as lm_llama

    ours = engine.diagnostics().runner.model
    a = ours.args
    args = lm_llama.ModelArgs(
        model_type="llama", hidden_size=a.hidden_size, num_hidden_layers=a.num_hidden_layers,
        intermediate_size=a.intermediate_size, num_attention_heads=a.num_attention_heads,
        rms_norm_eps=a.rms_norm_eps, vocab_size=a.vocab_size, head_dim=a.head_dim,
        max_position_embeddings=a.max_position_embeddings, num_key_value_heads=a.num_key_value_heads,
        rope_theta=a.rope_theta, rope_scaling=a.rope_scaling, tie_word_embeddings=a.tie_word_embeddings,
    )
    model = lm_llama.Model(args)
    params = tree_flatten(ours.parameters())
    quantized = {k.rsplit(".", 1)[0] for k, _ in params if k.endswith(".scales")}
    import mlx.nn as nn

    bits = {p: m.bits for p, m in ours.named_modules() if hasattr(m, "bits")}
    nn.quantize(model, group_size=32, bits=4,
                class_predicate=lambda p, m: {"group_size": 32, "bits": bits[p]} if p in quantized else False)
    model.load_weights(params, strict=True)
    mx.eval(model.parameters())
    return model


def hf_tokenizer(engine: Engine):
    from transformers import PreTrainedTokenizerFast

    tok = engine.tokenizer
    return PreTrainedTokenizerFast(tokenizer_object=tok.backend, eos_token=tok.backend.id_to_token(tok.eos_token_ids[0]))


def run_ours(engine: Engine, ids: list[int], n: int) -> tuple[float, float, int]:
    final = None
    for final in engine.generate(GenerationRequest(
            prompt_token_ids=ids, sampling=SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))):
        pass
    assert final.usage.completion_tokens == n, final
    return final.stats.prefill_tps, final.stats.decode_tps, final.stats.peak_memory_bytes


def run_mlx_lm(model, tokenizer, ids: list[int], n: int) -> tuple[float, float, int]:
    from mlx_lm.generate import stream_generate
    from mlx_lm.sample_utils import make_sampler

    mx.reset_peak_memory()
    last = None
    for last in stream_generate(model, tokenizer, ids, max_tokens=n, sampler=make_sampler(temp=0.0)):
        pass
    return last.prompt_tps, last.generation_tps, int(last.peak_memory * 1e9)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--gen-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--memory-side", choices=("roofline", "mlx-lm"), help=argparse.SUPPRESS)
    args = p.parse_args()

    if args.memory_side:
        return memory_side(args)
    engine = Engine.load(args.model, backend="mlx", prefix_caching=False)  # every repeat prefills the whole prompt
    text = ("The roofline model bounds performance by memory bandwidth and compute. " * 40)
    ids = engine.tokenizer.encode(text, add_special_tokens=False)[: args.prompt_tokens]

    # mlx-lm's model and generation must run on the engine thread too (MLX streams are per thread)
    diag = engine.diagnostics()
    lm_model = diag.call(lambda: mlx_lm_model(engine))
    lm_tok = hf_tokenizer(engine)

    ours, theirs = [], []
    diag.call(lambda: run_mlx_lm(lm_model, lm_tok, ids, 4))  # warm-up both
    run_ours(engine, ids, 4)
    for _ in range(args.repeats):
        ours.append(run_ours(engine, ids, args.gen_tokens))
        theirs.append(diag.call(lambda: run_mlx_lm(lm_model, lm_tok, ids, args.gen_tokens)))

    memory = {side: peak_in_subprocess(side, args) for side in ("roofline", "mlx-lm")}

    def med(rows, i):
        return statistics.median(r[i] for r in rows)

    bw = measure_bandwidth()
    info = engine.info
    a = diag.runner.model.args
    context = args.prompt_tokens + args.gen_tokens // 2
    kv_bytes = decode_bytes_per_token(0, 0, True, a.num_hidden_layers, a.num_key_value_heads, a.head_dim, context,
                                      4 if info.dtype == "float32" else 2).kv
    # what our decode step reads: on MLX's CPU backend the float32 weight copies instead of the packed ones
    per_token = DecodeBytes(weights=diag.runner.sequences().decode_bytes_per_token(context) - kv_bytes, kv=kv_bytes)
    # mlx-lm reads the packed weights (a tied embedding in full, as the head)
    embed = lm_model.model.embed_tokens
    lm_weights = sum(v.nbytes for _, v in tree_flatten(lm_model.parameters()))
    if not a.tie_word_embeddings:
        lm_weights -= sum(v.nbytes for v in (embed.weight, embed.get("scales"), embed.get("biases")) if v is not None)
    lm_per_token = lm_weights + kv_bytes
    dev = "Metal" if mx.metal.is_available() else "CPU"
    cpu = subprocess.run(["sh", "-c", "lscpu | grep 'Model name' | sed 's/.*: *//'"], capture_output=True,
                         text=True).stdout.strip() or platform.processor()
    print(f"## Engine vs mlx-lm stream_generate ({datetime.date.today()})\n")
    print(f"- command: `uv run python bench/engine_vs_mlx_lm.py --prompt-tokens {args.prompt_tokens} "
          f"--gen-tokens {args.gen_tokens} --repeats {args.repeats}`")
    print(f"- machine: {platform.system()} {platform.machine()}, {cpu}, {__import__('os').cpu_count()} cores, "
          f"MLX {mx.__version__} on {dev}; model: {info.name}, {info.quantization}, activations {info.dtype}")
    print(f"- medians of {args.repeats} runs, greedy, {len(ids)} prompt tokens, {args.gen_tokens} generated\n")
    print("| | prefill tok/s | decode tok/s | peak memory MiB during generation (own process) |")
    print("|---|---:|---:|---:|")
    print(f"| roofline | {med(ours, 0):.1f} | {med(ours, 1):.2f} | {memory['roofline'] / 2**20:.0f} |")
    print(f"| mlx-lm {__import__('mlx_lm').__version__} | {med(theirs, 0):.1f} | {med(theirs, 1):.2f} | "
          f"{memory['mlx-lm'] / 2**20:.0f} |")
    print(f"| ratio roofline / mlx-lm | {med(ours, 0) / med(theirs, 0):.2f}x | {med(ours, 1) / med(theirs, 1):.2f}x | "
          f"{memory['roofline'] / memory['mlx-lm']:.2f}x |")
    achieved = per_token.total * med(ours, 1)
    print(f"\nRoofline: a decode step reads {per_token.total / 2**20:.1f} MiB (weights {per_token.weights / 2**20:.1f}, "
          f"KV {per_token.kv / 2**20:.2f}); measured copy bandwidth {bw / 1e9:.1f} GB/s, so the bound is "
          f"{bw / per_token.total:.0f} tok/s; roofline decode reaches {achieved / 1e9:.2f} GB/s = "
          f"{100 * achieved / bw:.1f}% of it; mlx-lm reads {lm_per_token / 2**20:.1f} MiB a step (packed weights) "
          f"and reaches {100 * lm_per_token * med(theirs, 1) / bw:.1f}%.")
    engine.close()


def memory_side(args: argparse.Namespace) -> None:
    """In a fresh process: load, then print the peak memory during one generation (the weights, which
    stay resident, plus KV and activations, and for us the float32 host weights that MLX's CPU backend
    keeps outside MLX's allocator; load-time transients excluded for both sides)."""
    engine = Engine.load(args.model, backend="mlx", prefix_caching=False)
    ids = engine.tokenizer.encode("The roofline model bounds performance by memory bandwidth and compute. " * 40,
                                  add_special_tokens=False)[: args.prompt_tokens]
    thread_call = engine.diagnostics().call
    if args.memory_side == "roofline":
        thread_call(lambda: (mx.clear_cache(), mx.reset_peak_memory()))
        print(run_ours(engine, ids, args.gen_tokens)[2])  # MLX's peak plus resident host weights (CPU backend)
        return
    else:
        model = thread_call(lambda: mlx_lm_model(engine))
        tok = hf_tokenizer(engine)
        engine.close()  # frees our copy of the weights and our KV pool before mlx-lm runs
        del engine
        thread_call(lambda: (mx.clear_cache(), mx.reset_peak_memory()))
        thread_call(lambda: run_mlx_lm(model, tok, ids, args.gen_tokens))
    print(int(mx.get_peak_memory()))


def peak_in_subprocess(side: str, args: argparse.Namespace) -> int:
    cmd = [sys.executable, __file__, "--memory-side", side, "--prompt-tokens", str(args.prompt_tokens),
           "--gen-tokens", str(args.gen_tokens)] + (["--model", args.model] if args.model else [])
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.split()
    return int(out[-1])


if __name__ == "__main__":
    main()
