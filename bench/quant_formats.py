"""quant/'s numpy unpacking of each GGUF format, on one CPU thread, against the peers it replaces or stands beside:
gguf-py's `dequantize` (llama.cpp's own numpy twin: `quant.dequantize`) and the MLX-op k-quant reference the loader
dequantizes with (`kernels_metal.reference.dequantize_kquant`, on MLX's CPU backend). Random blocks with finite
scales (`tests.tiny_models.random_blocks`) for the formats gguf-py cannot quantize, gguf-py's quantizer for the rest.

    uv run python bench/quant_formats.py [--rows 4096] [--cols 4096] [--repeats 5]

Prints, per format, the best of `--repeats` runs of each, and the ratio quant / peer.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

import quant  # noqa: E402
from kernels_metal.reference import dequantize_kquant  # noqa: E402
from quant.affine import affine_from_gguf  # noqa: E402
from quant.codebook import dequantize_iq4  # noqa: E402
from quant.kquant import kquant_affine  # noqa: E402


def best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    shape = (args.rows, args.cols)
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import quantize

    from tests.tiny_models import random_blocks

    cpu = subprocess.run(["sh", "-c", "lscpu | grep 'Model name' | sed 's/.*: *//'"], capture_output=True,
                         text=True).stdout.strip()
    print(f"{cpu}; {shape[0]} x {shape[1]} weights, min of {args.repeats}; seconds")
    print(f"{'format':8} {'what':34} {'quant':>8} {'peer':>8} {'peer is':28} {'ratio':>6}")
    rng = np.random.default_rng(0)
    dense = (rng.standard_normal(shape) * 0.02).astype(np.float32)
    for name in quant.FORMATS:
        if name in quant.KQUANT_TYPES or name.startswith("IQ4"):
            raw = random_blocks(rng, name, *shape, std=0.02)
        else:
            raw = quantize(dense, GGMLQuantizationType[name])
        peer_name, peer = "gguf-py dequantize", lambda: quant.dequantize(raw, name, shape)
        if name in quant.KQUANT_TYPES:
            what, ours = "codes, scales (kquant_affine)", lambda: kquant_affine(raw, name, *shape)
            blocks = mx.array(raw)
            rows = [("MLX dequantize_kquant (CPU)", lambda: mx.eval(dequantize_kquant(blocks, name, *shape)))]
        elif name in quant.MLX_AFFINE_BITS:
            what, ours, rows = "MLX words (affine_from_gguf)", lambda: affine_from_gguf(raw, name, shape), []
        elif name.startswith("IQ4"):
            what, ours, rows = "float32 (dequantize_iq4)", lambda: dequantize_iq4(raw, name, shape), []
        else:
            continue  # MXFP4: its unpacking is a split of nibbles, and gguf-py has no twin of it
        for label, other in [(peer_name, peer), *rows]:
            t_ours, t_peer = best(ours, args.repeats), best(other, args.repeats)
            print(f"{name:8} {what:34} {t_ours:8.4f} {t_peer:8.4f} {label:28} {t_ours / t_peer:6.2f}")


if __name__ == "__main__":
    main()
