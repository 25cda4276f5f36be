"""Load time and load memory of the torch backend on the CPU: each load in a fresh process, so that the second
shows what inductor's cache (under ROOFLINE_CACHE_DIR) saves.

    uv run python bench/torch_cpu_load.py [MODEL] [--loads 2] [--no-compile] [--cache-dir DIR] [--fresh-cache]

MODEL: a GGUF file or folder (default: the embedded SmolLM2 Q4_1). Each load prints its seconds, the RSS over the
RSS after importing torch's backend (after the load and after generating -p + -n tokens), the peak (VmHWM)
over the same baseline, and the bytes the packed weights and the KV pool hold. With compile on, the baseline also
has the compiler's modules imported (torch._dynamo, torch._inductor: library code, ~120 MB of RSS, printed apart),
so that the figures are what the model and its compiled graphs hold.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def child(model: str | None, compile: bool, prompt: int, gen: int) -> None:
    sys.path.insert(0, str(ROOT))
    from mlx_engine.backends.torch.runner import peak_rss  # torch's libraries before the baseline; VmHWM

    from mlx_engine import Engine, GenerationRequest, SamplingParams

    def _peak_mb() -> float:
        return peak_rss() / 2**20

    before = _rss_mb()
    if compile:  # the compiler's modules are library code too (llama.cpp's are in its baseline): said apart
        import torch._dynamo  # noqa: F401
        import torch._inductor.compile_fx  # noqa: F401
    base = _rss_mb()
    t = time.perf_counter()
    e = Engine.load(model, backend="torch", device="cpu", compile=compile, prefix_caching=False,
                    max_context=prompt + gen + 16)
    out = {"load_s": time.perf_counter() - t, "rss_loaded_mb": _rss_mb() - base, "peak_loaded_mb": _peak_mb() - base,
           "compiler_imports_mb": base - before,
           "weight_mb": e.info.weight_bytes / 2**20, "notes": list(e.info.notes)}
    params = SamplingParams(temperature=0.0, max_tokens=gen, ignore_eos=True)
    list(e.generate(GenerationRequest(prompt_token_ids=list(range(200, 200 + prompt)), sampling=params)))
    out.update(rss_generated_mb=_rss_mb() - base,  # the engine set VmHWM back when the request started
               peak_mb=max(out["peak_loaded_mb"], _peak_mb() - base),
               kv_mb=int(e.kv_stats().get("bytes_total") or 0) / 2**20)
    print(json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?")
    ap.add_argument("--loads", type=int, default=2)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--cache-dir", help="ROOFLINE_CACHE_DIR for the loads (default: as set, else the user cache dir)")
    ap.add_argument("--fresh-cache", action="store_true", help="start from an empty cache dir (a temporary one)")
    ap.add_argument("-p", type=int, default=64)
    ap.add_argument("-n", type=int, default=16)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.model, not args.no_compile, args.p, args.n)
    env = dict(os.environ)
    if args.fresh_cache:
        env["ROOFLINE_CACHE_DIR"] = tempfile.mkdtemp(prefix="roofline-load-")
    elif args.cache_dir:
        env["ROOFLINE_CACHE_DIR"] = args.cache_dir
    cmd = [sys.executable, __file__, "--child", "-p", str(args.p), "-n", str(args.n)]
    cmd += ([args.model] if args.model else []) + (["--no-compile"] if args.no_compile else [])
    for i in range(args.loads):
        load = " ".join(f"{x:.2f}" for x in os.getloadavg())
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
        if r.returncode != 0:
            raise SystemExit(f"torch_cpu_load: load {i + 1} failed: {r.stderr.strip().splitlines()[-1:]}")
        m = json.loads(r.stdout.strip().splitlines()[-1])
        print(f"load {i + 1} (load average {load}): {m['load_s']:.1f} s; RSS over imports {m['rss_loaded_mb']:.0f} MB "
              f"loaded (peak {m['peak_loaded_mb']:.0f}), {m['rss_generated_mb']:.0f} MB after {args.p}+{args.n} "
              f"tokens (peak {m['peak_mb']:.0f}); weights {m['weight_mb']:.0f} MB, KV pool {m['kv_mb']:.0f} MB; "
              f"compiler's modules {m['compiler_imports_mb']:.0f} MB (in the baseline); "
              f"{'; '.join(n for n in m['notes'] if 'compile' in n)}")


if __name__ == "__main__":
    main()
