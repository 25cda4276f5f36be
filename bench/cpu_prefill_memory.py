"""The torch backend's prefill on the CPU against its peak memory, by prefill chunk: each chunk size in a process
of its own, which loads the GGUF file (`Engine.load(backend="torch", device="cpu")`), prefills the same random
prompt `--requests` times (one token decoded each, prefix caching off) and prints the best prefill tok/s and the
process's peak RSS (`runner.peak_rss`, over the load and every request) less its RSS after importing the
torch runner, as `cpu_vs_llama_cpp.py` counts it:

    uv run python bench/cpu_prefill_memory.py FILE.gguf [--chunks 512,256,128] [--prompt-tokens 512]
        [--context 640] [--threads 2] [--requests 4]

Linux only (VmHWM). Give the chunks twice (512,256,512,256) to see the run-to-run spread.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def worker(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(ROOT))
    from mlx_engine import Engine, GenerationRequest, SamplingParams
    from mlx_engine.backends.torch.runner import peak_rss, reset_peak_rss  # the baseline: torch and the runner

    reset_peak_rss()
    base = peak_rss()  # VmHWM just reset: the RSS now
    engine = Engine.load(args.file, backend="torch", device="cpu", prefix_caching=False, max_context=args.context,
                         threads=args.threads, prefill_chunk_size=args.worker)
    rng = random.Random(0)
    prompt = [rng.randrange(1000, 40000) for _ in range(args.prompt_tokens)]
    times, peak = [], peak_rss()  # the load's; the runner sets VmHWM back at each request's start
    for _ in range(args.requests):
        t = time.perf_counter()
        list(engine.generate(GenerationRequest(prompt_token_ids=prompt, sampling=SamplingParams(
            temperature=0.0, max_tokens=1, ignore_eos=True))))
        times.append(time.perf_counter() - t)
        peak = max(peak, peak_rss())
    print(json.dumps({"chunk": args.worker, "prefill_tok_s": len(prompt) / min(times),
                      "peak_mib": (peak - base) / 2**20}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("file")
    ap.add_argument("--chunks", default="512,256,128")
    ap.add_argument("-p", "--prompt-tokens", type=int, default=512)
    ap.add_argument("--context", type=int, default=640)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    if not Path(args.file).is_file():
        sys.exit(f"{args.file}: no such file (a GGUF file to prefill)")
    print("| chunk | prefill tok/s | peak MiB over imports |\n|---:|---:|---:|")
    for chunk in (int(c) for c in args.chunks.split(",")):
        out = subprocess.run([sys.executable, __file__, args.file, "--worker", str(chunk), "-p",
                              str(args.prompt_tokens), "--context", str(args.context), "--threads",
                              str(args.threads), "--requests", str(args.requests)],
                             capture_output=True, text=True, env=os.environ)
        if out.returncode:
            sys.exit(f"chunk {chunk}: the worker failed:\n{out.stderr[-2000:]}")
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"| {r['chunk']} | {r['prefill_tok_s']:.0f} | {r['peak_mib']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
