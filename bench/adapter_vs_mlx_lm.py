"""An mlx-lm family on the engine's paged KV (mlx_engine.models.adapter) against mlx-lm's own generate_step on
the same weights, in one run.

    uv run python bench/adapter_vs_mlx_lm.py [--family phi3|qwen3_moe] [--prompt-tokens 128] [--gen-tokens 32]

A random checkpoint of the golden family's config scaled up (--hidden, --layers) is written to a temporary folder;
the engine loads it (paged KV, our scheduler), mlx-lm's class gets the same tensors and decodes with its own
KVCache. Runs alternate (ours, theirs, ...), greedy, the same prompt ids, float32 activations on MLX's CPU backend
(or the checkpoint's dtype on Metal). Prints a markdown table of medians and ratios; for a mixture of experts
also the bytes a decode step reads (shared weights + routed experts) against the dense count.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

from mlx_engine import Engine, GenerationRequest, SamplingParams  # noqa: E402
from mlx_engine.models import instantiate  # noqa: E402

GOLDEN = Path(__file__).resolve().parents[1] / "tests" / "data" / "golden"


def write_checkpoint(family: str, hidden: int, layers: int, folder: Path, vocab_size: int = 8192) -> dict:
    """A random checkpoint of the golden `family` scaled to `hidden` x `layers` (config.json, model.safetensors) in
    `folder`; `vocab_size` to match a real tokenizer (bench/server.py gives it SmolLM2's). Returns the config."""
    config = json.loads((GOLDEN / family / "config.json").read_text())
    heads = hidden // 64
    config.update(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=max(1, heads // 4), head_dim=64, intermediate_size=hidden * 3,
                  vocab_size=vocab_size, max_position_embeddings=4096)
    if "moe_intermediate_size" in config:
        config.update(moe_intermediate_size=hidden // 2, num_local_experts=16, num_experts_per_tok=2)
    config.pop("layer_types", None)
    model, *_ = instantiate(config, str(folder))
    params = dict(tree_flatten(model.parameters()))
    mx.eval(params)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(folder / "model.safetensors"), params)
    return config


def run_ours(engine: Engine, ids: list[int], n: int) -> tuple[float, float]:
    final = None
    for final in engine.generate(GenerationRequest(
            prompt_token_ids=ids, sampling=SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))):
        pass
    assert final.usage.completion_tokens == n, final
    return final.stats.prefill_tps, final.stats.decode_tps


def run_mlx_lm(model, ids: list[int], n: int) -> tuple[float, float, list[int]]:
    from mlx_lm.generate import generate_step

    t0 = time.perf_counter()
    tokens, t_first = [], None
    for tok, _ in generate_step(mx.array(ids), model, max_tokens=n, sampler=lambda x: mx.argmax(x, axis=-1)):
        tokens.append(int(tok))
        if t_first is None:
            t_first = time.perf_counter()
    t_end = time.perf_counter()
    return len(ids) / (t_first - t0), (n - 1) / (t_end - t_first), tokens


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--family", default="phi3")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--gen-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / args.family
        config = write_checkpoint(args.family, args.hidden, args.layers, folder)
        engine = Engine.load(str(folder), backend="mlx", prefix_caching=False)  # every repeat prefills the whole prompt
        theirs_model, *_ = instantiate(config, str(folder))
        theirs_model.load_weights(str(folder / "model.safetensors"))
        mx.eval(theirs_model.parameters())
        ids = [(7 * i + 3) % 8000 + 10 for i in range(args.prompt_tokens)]
        run_ours(engine, ids, 4)
        ref = run_mlx_lm(theirs_model, ids, args.gen_tokens)[2]
        ours_tokens = [t for ev in engine.generate(GenerationRequest(prompt_token_ids=ids, sampling=SamplingParams(
            temperature=0.0, max_tokens=args.gen_tokens, ignore_eos=True))) for t in ev.token_ids]
        ours, theirs = [], []
        for _ in range(args.repeats):
            ours.append(run_ours(engine, ids, args.gen_tokens))
            theirs.append(run_mlx_lm(theirs_model, ids, args.gen_tokens)[:2])
        kv = engine.kv_stats()["kind"]
        routing = engine.moe_routing()
        weights = engine.decode_bytes_per_token(0)
        info = engine.info
        engine.close()

    def med(rows, i):
        return statistics.median(r[i] for r in rows)

    dev = "Metal" if mx.metal.is_available() else "CPU"
    print(f"## {args.family} through the adapter vs mlx-lm generate_step ({datetime.date.today()})\n")
    print(f"- command: `uv run python bench/adapter_vs_mlx_lm.py --family {args.family} --hidden {args.hidden} "
          f"--layers {args.layers} --prompt-tokens {args.prompt_tokens} --gen-tokens {args.gen_tokens} "
          f"--repeats {args.repeats}`")
    print(f"- machine: {platform.system()} {platform.machine()}, MLX {mx.__version__} on {dev}; random "
          f"{args.family} checkpoint, {info.num_parameters / 1e6:.1f} M parameters, activations {info.dtype}; "
          f"our KV: {kv}; greedy tokens identical to mlx-lm's: {ours_tokens == ref}")
    print(f"- medians of {args.repeats} runs, greedy, {len(ids)} prompt tokens, {args.gen_tokens} generated\n")
    print("| | prefill tok/s | decode tok/s |")
    print("|---|---:|---:|")
    print(f"| roofline (adapter, paged) | {med(ours, 0):.1f} | {med(ours, 1):.2f} |")
    print(f"| mlx-lm {__import__('mlx_lm').__version__} | {med(theirs, 0):.1f} | {med(theirs, 1):.2f} |")
    print(f"| ratio | {med(ours, 0) / med(theirs, 0):.2f}x | {med(ours, 1) / med(theirs, 1):.2f}x |")
    if routing is not None:
        dense = weights - routing["shared_bytes"]
        every = sum(b * n for b, n in zip(routing["expert_bytes"], routing["num_experts"]))
        print(f"\nMoE: a decode step reads {weights / 2**20:.1f} MiB of weights (shared "
              f"{routing['shared_bytes'] / 2**20:.1f} + {routing['experts_per_token']} routed experts per layer "
              f"{dense / 2**20:.1f}); all experts are {every / 2**20:.1f} MiB, so a dense count would say "
              f"{(routing['shared_bytes'] + every) / 2**20:.1f} MiB.")


if __name__ == "__main__":
    main()
