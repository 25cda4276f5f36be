"""Roofline's CPU matmul kernel (`roofline_cpu::qmatmul`) alone, one activation row (a decode step), on
SmolLM2-135M's matrices: per token the 30 layers' fused q/k/v (960 x 576), o (576 x 576), fused gate/up (3072 x
576) and down (576 x 1536), and the 49152-row output head, random codes and float16 scales: 4-bit and 5-bit
with offsets, 8-bit without, 6-bit as Q6_K's (int8 scales per 16; `--model 1b` only, its K being multiples of 256)
(a checkout whose kernel lacks a width prints "-" for it). Two regimes:
`hot`, each matrix called again and again (its codes in the caches: the kernel's arithmetic), and `cold`, a
token's 121 distinct matrices in turn (as a decode step reads them: the memory's speed). Each checkout given runs
in processes of its own, alternating, so that two builds of the kernel can be compared in one run:

    uv run python bench/cpu_qmatmul.py [CHECKOUT ...] [--threads 1] [--rounds 3] [--model 1b]

--model 1b: the matrices of `cpu_vs_llama_cpp.py --model 1b` instead (TinyLlama-1.1B's shape: 22 layers of
q/k/v 2560 x 2048, o 2048 x 2048, gate/up 11264 x 2048, down 2048 x 5632, a 49152 x 2048 head).

CHECKOUT: a tree of this repository (default: this one), e.g. a `git worktree` of main before a change. Prints,
per checkout, each regime's milliseconds a token (20th percentile of a process's repeats; median over rounds).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODELS = {  # (layers, (out, in) of one layer's matmuls, the head's)
    "smollm2": (30, [(960, 576), (576, 576), (3072, 576), (576, 1536)], (49152, 576)),
    "1b": (22, [(2560, 2048), (2048, 2048), (11264, 2048), (2048, 5632)], (49152, 2048)),
}
KINDS = (4, 5, 6, 8)  # code widths


def child(tree: str, threads: int, model: str) -> None:
    sys.path.insert(0, tree)
    import torch

    from mlx_engine.backends.torch import cpu_native

    torch.set_num_threads(threads)
    error = cpu_native.build_error()
    if error:
        raise SystemExit(f"cpu_qmatmul: {error}")
    op = torch.ops.roofline_cpu.qmatmul
    g = torch.Generator().manual_seed(0)

    def matrix(n: int, k: int, bits: int) -> tuple:
        row_bytes = {4: k // 2, 5: k // 2 + k // 8, 6: k // 2 + k // 4}
        if bits == 6:  # Q6_K's: an int8 scale per 16, a float16 one per 256
            sc = torch.randint(-128, 128, (n, k // 16), generator=g, dtype=torch.int8).numpy()
            d = cpu_native.halves(sc, torch.rand(n, k // 256, generator=g).numpy())
            codes = torch.randint(0, 256, (n, row_bytes[6]), generator=g, dtype=torch.uint8)
            return torch.randn(1, k, generator=g), codes, d, torch.empty(0, dtype=torch.int8), bits
        codes = (torch.randint(0, 256, (n, row_bytes[bits]), generator=g, dtype=torch.uint8) if bits in row_bytes
                 else torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8))
        d = torch.rand(n, k // 32, generator=g).half()
        m = torch.randn(n, k // 32, generator=g).half() if bits != 8 else torch.empty(0, dtype=torch.half)
        return torch.randn(1, k, generator=g), codes, d, m, bits

    def p20(fn, repeats: int) -> float:
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return sorted(times)[len(times) // 5]

    LAYERS, SHAPES, HEAD = MODELS[model]
    out = {}
    for bits in KINDS:
        if bits == 6 and any(k % 256 for _, k in SHAPES + [HEAD]):
            continue  # two-level scales need K a multiple of 256: not SmolLM2's
        try:
            op(*matrix(8, 256, bits))
        except RuntimeError:  # an older kernel's bits
            continue
        layers = [[matrix(n, k, bits) for n, k in SHAPES] for _ in range(LAYERS)]
        head = matrix(*HEAD, bits)
        hot = sum(p20(lambda a=a: [op(*a) for _ in range(10)], 15) / 10 * LAYERS for a in layers[0])
        hot += p20(lambda: op(*head), 15)
        cold = p20(lambda: [op(*a) for layer in layers for a in layer] + [op(*head)], 30)
        out[f"{bits}-bit"] = {"hot": hot * 1e3, "cold": cold * 1e3}
    print(json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trees", nargs="*", type=Path, help="checkouts to compare (default: this one)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model", default="smollm2", choices=list(MODELS), help="whose matrices (default smollm2)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.child, args.threads, args.model)
    trees = [t.resolve() for t in args.trees] or [ROOT]
    got: dict[Path, list[dict]] = {t: [] for t in trees}
    for r in range(args.rounds):
        for t in trees[r % len(trees):] + trees[:r % len(trees)]:
            done = subprocess.run([sys.executable, __file__, "--child", str(t), "--threads", str(args.threads),
                                   "--model", args.model],
                                  capture_output=True, text=True)
            if done.returncode != 0:
                raise SystemExit(f"cpu_qmatmul: {t}: {(done.stderr.strip().splitlines() or ['failed'])[-1]}")
            got[t].append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(f"ms a token, {args.threads} thread(s), median of {args.rounds} rounds (each a 20th percentile)")
    for t, runs in got.items():
        cells = [f"{kind} {regime} " + (f"{statistics.median(x[kind][regime] for x in runs):.2f}"
                                         if kind in runs[0] else "-")
                 for kind in (f"{b}-bit" for b in KINDS) for regime in ("hot", "cold")]
        print(f"{t}: " + ", ".join(cells))


if __name__ == "__main__":
    main()
