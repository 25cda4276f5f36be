"""`roofline bench` on the MLX backend and on the torch backend (CPU), and mlx-lm's own benchmark
(`mlx_lm.benchmark`'s method), on the same model in one run; prints a Markdown section for
docs/benchmarks/roofline-bench.md.

    uv run python bench/bench_vs_peers.py [--model M] [-p 512] [-n 128] [--batch 1] [--context 0] [--repeats 5]

mlx-lm cannot read GGUF, so (as in bench/engine_vs_mlx_lm.py) its llama class gets the weights our engine
loaded; then it is timed the way mlx_lm/benchmark.py times it: a random prompt, one warm-up, `num_trials` runs
of stream_generate (batch 1) or batch_generate (batch > 1) with EOS off, the mean of prompt_tps and
generation_tps. Each side's decode is put against this machine's roofline with the bytes per step and the
peak bandwidth `roofline bench` recorded.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def roofline_bench(args: argparse.Namespace, backend: str, device: str, out: Path) -> tuple[list[str], dict]:
    print(f"{backend}/{device}: {out}", file=sys.stderr)
    cmd = [sys.executable, "-m", "app.cli", "bench", "--backend", backend, "--device", device,
           "-p", str(args.p), "-n", str(args.n), "--batch", args.batch, "--context", args.context,
           "--repeats", str(args.repeats), "--json", str(out), "--markdown"]
    if args.model:
        cmd += ["--model", args.model]
    if args.reuse and out.exists():
        return ["roofline", *cmd[3:]], json.loads(out.read_text())
    print(f"running: {shlex.join(cmd[2:])}", file=sys.stderr)
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"bench_vs_peers: {backend}/{device} failed:\n{r.stderr}")
    return ["roofline", *cmd[3:]], json.loads(out.read_text())


def mlx_lm_benchmark(args: argparse.Namespace, batch: int) -> dict[str, float]:
    """mlx_lm/benchmark.py's measurement on our loaded weights (on the engine thread, which owns MLX work)."""
    import mlx.core as mx
    from engine_vs_mlx_lm import hf_tokenizer, mlx_lm_model
    from mlx_lm import batch_generate, stream_generate
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    from mlx_engine import Engine

    engine = Engine.load(args.model, backend="mlx")  # mlx-lm's model is built from the MLX runner's
    model = engine.diagnostics().call(lambda: mlx_lm_model(engine))
    tokenizer = TokenizerWrapper(hf_tokenizer(engine))  # what mlx_lm.load returns
    tokenizer.eos_token_ids = []  # as benchmark.py: no early stop
    vocab = engine.info.vocab_size

    def trials() -> list[tuple[float, float, float]]:
        mx.random.seed(0)
        prompts = mx.random.randint(0, vocab, (batch, args.p)).tolist()

        def once() -> tuple[float, float, float]:
            if batch == 1:
                for resp in stream_generate(model, tokenizer, prompts[0], max_tokens=args.n):
                    pass
                return resp.prompt_tps, resp.generation_tps, resp.peak_memory
            s = batch_generate(model, tokenizer, prompts, max_tokens=args.n).stats
            return s.prompt_tps, s.generation_tps, s.peak_memory

        once()  # warm-up
        return [once() for _ in range(args.repeats)]

    runs = engine.diagnostics().call(trials)
    # what mlx-lm's decode step reads: its packed weights (a tied embedding in full, as the head)
    from mlx.utils import tree_flatten

    weights_read = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    if not model.args.tie_word_embeddings:
        weights_read -= sum(v.nbytes for _, v in tree_flatten(model.model.embed_tokens.parameters()))
    engine.close()
    return {"pp": statistics.fmean(r[0] for r in runs), "tg": statistics.fmean(r[1] for r in runs),
            "pp_sd": statistics.stdev(r[0] for r in runs) if len(runs) > 1 else 0.0,
            "tg_sd": statistics.stdev(r[1] for r in runs) if len(runs) > 1 else 0.0,
            "peak_gb": max(r[2] for r in runs), "weights_read": weights_read}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2 GGUF")
    p.add_argument("-p", type=int, default=512)
    p.add_argument("-n", type=int, default=128)
    p.add_argument("--batch", default="1")
    p.add_argument("--context", default="0", help="depths for roofline bench (mlx-lm's benchmark has none: d0 only)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--no-torch", action="store_true", help="skip the torch backend")
    p.add_argument("--out", help="folder for each side's `roofline bench --json` (default: a new temp folder)")
    p.add_argument("--reuse", action="store_true", help="read the sides' JSON already in --out instead of rerunning")
    args = p.parse_args()

    tmp = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="bench_vs_peers_"))
    tmp.mkdir(parents=True, exist_ok=True)
    sides = [("mlx", "auto")]
    if not args.no_torch and importlib.util.find_spec("torch") is not None:
        sides.append(("torch", "cpu"))
    results = [(b, d, *roofline_bench(args, b, d, tmp / f"{b}_{d}.json")) for b, d in sides]
    batches = [int(x) for x in args.batch.split(",")]
    print("running: mlx-lm benchmark method", file=sys.stderr)
    peer = {b: mlx_lm_benchmark(args, b) for b in batches}

    first = results[0][3]
    m, model = first["machine"], first["model"]
    bw = m["peak_bandwidth"]
    print(f"## roofline bench vs mlx-lm's benchmark ({m['date'][:10]})\n")
    print(f"- command: `python bench/bench_vs_peers.py {shlex.join(sys.argv[1:])}`")
    print(f"- machine: {m['chip']}, {m['cpu_count']} cores, {m['platform']}; "
          f"{', '.join(f'{k} {v}' for k, v in m['versions'].items())}")
    print(f"- model: {model['name']} ({model['quantization']}, {model['num_parameters'] / 1e6:.0f}M parameters, "
          f"activations {model['dtype']})")
    print(f"- roofline: {bw['gbs']:.1f} GB/s ({bw['source']}: {bw['label']}); prefill peak "
          f"{m['peak_flops']['tflops']:.2f} TFLOP/s ({m['peak_flops']['source']})" if bw["gbs"] else "- roofline: unknown")
    print()
    for backend, device, cmd, data in results:
        print(f"### `{shlex.join(cmd)}`\n")
        from app.bench.run import markdown

        print(markdown(data) + "\n")
    print("### Side by side at depth 0 (tokens/s, mean ± stddev; decode as % of the roofline)\n")
    print("| runner | batch | pp t/s | tg t/s | tg % roofline |")
    print("|---|---:|---:|---:|---:|")
    for backend, device, _, data in results:
        for r in data["rows"]:
            if r["context"] == 0:
                pct = "-" if r["tg_roofline_pct"] is None else f"{r['tg_roofline_pct']:.1f}%"
                print(f"| roofline {backend} ({data['machine']['device']}) | {r['batch']} | {r['pp']['mean']:.1f} ± "
                      f"{r['pp']['stddev']:.1f} | {r['tg']['mean']:.2f} ± {r['tg']['stddev']:.2f} | {pct} |")
    rows = {r["batch"]: r for r in first["rows"] if r["context"] == 0}
    import mlx_lm

    for b, s in peer.items():
        pct = "-"
        if bw["gbs"] and b in rows:
            # bytes per step at mlx-lm's mean depth (prompt + half the new tokens): its own packed weights
            # (ours may read float32 copies on MLX's CPU backend) plus each sequence's KV, counted as ours
            w, r = model["decode_bytes_per_token"], rows[b]
            kv_per_token = (r["decode_bytes_per_step"] - w) / (b * (1 + (args.n - 1) / 2))
            step = s["weights_read"] + b * kv_per_token * (args.p + args.n / 2)
            pct = f"{100 * step * s['tg'] / b / (bw['gbs'] * 1e9):.1f}%"
        print(f"| mlx-lm {mlx_lm.__version__} benchmark method | {b} | {s['pp']:.1f} ± {s['pp_sd']:.1f} | "
              f"{s['tg']:.2f} ± {s['tg_sd']:.2f} | {pct} |")


if __name__ == "__main__":
    main()
