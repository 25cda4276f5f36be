"""Time the custom kernels against MLX built-ins, as bandwidth against the machine's.

    uv run python bench/kernels.py [--quick] [--bandwidth-gbs 400]

On a Mac (Metal): the paged decode attention kernel vs `mx.fast.scaled_dot_product_attention` on
KV gathered through the block tables, and the k-quant matmul vs dequantize-then-matmul, each as
GB/s of the bytes the op must read, and as a fraction of the chip's memory bandwidth.
Elsewhere: the MLX-ops reference (the engine's CPU path) against a measured copy bandwidth, and
the interpreter on small shapes against the reference on the same shapes; no Metal figure.
Decode is bandwidth-bound, so bytes read / time is the figure that matters.
"""

from __future__ import annotations

import argparse
import math
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernels_metal import (
    KVPool,
    _backend,
    dequant_matmul_kquant,
    paged_decode_attention,
    reference,
)
from quant.formats import KQUANT_TYPES, block_format, row_bytes

# Unified-memory bandwidth by chip (GB/s, Apple's figures; the binned Max parts are lower).
CHIP_BANDWIDTH_GBS = {
    "M1": 68,
    "M1 Pro": 200,
    "M1 Max": 400,
    "M1 Ultra": 800,
    "M2": 100,
    "M2 Pro": 200,
    "M2 Max": 400,
    "M2 Ultra": 800,
    "M3": 100,
    "M3 Pro": 150,
    "M3 Max": 400,
    "M3 Ultra": 819,
    "M4": 120,
    "M4 Pro": 273,
    "M4 Max": 546,
}


def chip_name() -> str:
    try:
        return subprocess.run(
            ["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or platform.machine()


def chip_bandwidth(name: str) -> float | None:
    """ "Apple M2 Pro" -> 200; the longest chip name that matches wins."""
    chips = [c for c in CHIP_BANDWIDTH_GBS if name == f"Apple {c}" or name.startswith(f"Apple {c} ")]
    return float(CHIP_BANDWIDTH_GBS[max(chips, key=len)]) if chips else None


def timeit(fn: Callable[[], mx.array], repeats: int, warmup: int = 2) -> float:
    """Median seconds per call, evaluating the result each time."""
    for _ in range(warmup):
        mx.eval(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth_gbs() -> float:
    """A measured stand-in for the memory bandwidth: numpy's b = a + 1 over 256 MiB (read + write)."""
    a = np.random.default_rng(0).random(64 * 1024 * 1024, dtype=np.float32)
    b = np.empty_like(a)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        np.add(a, 1.0, out=b)
        times.append(time.perf_counter() - t0)
    return 2 * a.nbytes / min(times) / 1e9


# ---------------------------------------------------------------- cases


def attention_case(
    B: int,
    seq_len: int,
    Hq: int,
    Hkv: int,
    D: int,
    block_size: int,
    dtype: mx.Dtype,
    bits: int | None,
    group_size: int = 64,
) -> tuple[dict, int]:
    """Inputs with each sequence's blocks shuffled over the pool, and the bytes a decode step
    must read (K and V of every token, scales and biases, q, out)."""
    rng = np.random.default_rng(0)
    blocks_per_seq = -(-seq_len // block_size)
    num_blocks = B * blocks_per_seq
    tables = rng.permutation(num_blocks).reshape(B, blocks_per_seq).astype(np.int32)
    shape = (num_blocks, block_size, Hkv, D)
    k = mx.random.normal(shape).astype(dtype)
    v = mx.random.normal(shape).astype(dtype)
    case = dict(
        q=mx.random.normal((B, Hq, D)).astype(dtype),
        block_tables=mx.array(tables),
        seq_lens=mx.full((B,), seq_len, dtype=mx.int32),
        scale=1.0 / math.sqrt(D),
    )
    if bits is None:
        case.update(k_pool=k, v_pool=v)
    else:
        kq, ks, kb = mx.quantize(k, group_size=group_size, bits=bits)
        vq, vs, vb = mx.quantize(v, group_size=group_size, bits=bits)
        case.update(
            k_pool=kq,
            v_pool=vq,
            k_scales=ks,
            k_biases=kb,
            v_scales=vs,
            v_biases=vb,
            bits=bits,
            group_size=group_size,
        )
    mx.eval(case)
    per_token = sum(
        case[n].nbytes
        for n in ("k_pool", "v_pool", "k_scales", "k_biases", "v_scales", "v_biases")
        if n in case
    ) / (num_blocks * block_size)
    nbytes = int(B * seq_len * per_token + 2 * case["q"].nbytes)
    return case, nbytes


POOL_FIELDS = {"k_pool": "k", "v_pool": "v", "k_scales": "k_scales", "k_biases": "k_biases", "v_scales": "v_scales",
               "v_biases": "v_biases", "bits": "bits", "group_size": "group_size"}


def pooled(case: dict) -> dict:
    """An attention case as `paged_decode_attention`'s arguments: its pool fields as one `KVPool`."""
    pool = KVPool(**{POOL_FIELDS[k]: v for k, v in case.items() if k in POOL_FIELDS})
    return {"pool": pool, **{k: v for k, v in case.items() if k not in POOL_FIELDS}}


def sdpa_on_gathered(case: dict) -> Callable[[], mx.array]:
    """The built-in baseline: gather KV through the tables (dequantize if packed), then SDPA."""
    B, _, D = case["q"].shape
    tables = case["block_tables"]
    _, block_size, Hkv, _ = case["k_pool"].shape
    T = tables.shape[1] * block_size

    def gather(pool, scales, biases):
        x = pool[tables]
        if case.get("bits"):
            x = mx.dequantize(
                x, scales[tables], biases[tables], group_size=case["group_size"], bits=case["bits"]
            )
        return x.reshape(B, T, Hkv, D).transpose(0, 2, 1, 3)

    def run() -> mx.array:
        k = gather(case["k_pool"], case.get("k_scales"), case.get("k_biases"))
        v = gather(case["v_pool"], case.get("v_scales"), case.get("v_biases"))
        return mx.fast.scaled_dot_product_attention(case["q"][:, :, None], k, v, scale=case["scale"])

    return run


def kquant_case(ggml_type: str, M: int, N: int, K: int, dtype: mx.Dtype) -> tuple[tuple, int]:
    rng = np.random.default_rng(0)
    f = block_format(ggml_type)
    w = rng.integers(0, 256, (N, row_bytes(ggml_type, K)), dtype=np.uint8)
    blocks = w.reshape(-1, f.block_bytes)
    for off in f.fp16_offsets():
        blocks[:, off : off + 2] = (
            (rng.standard_normal(blocks.shape[0]) * 0.01).astype(np.float16).view(np.uint8).reshape(-1, 2)
        )
    x = mx.random.normal((M, K)).astype(dtype)
    wa = mx.array(w)
    mx.eval(x, wa)
    return (x, wa, ggml_type, N, K), w.nbytes + x.nbytes + M * N * 4


# ---------------------------------------------------------------- reports


def row(label: str, seconds: float, nbytes: int, peak: float | None, extra: str = "") -> str:
    gbs = nbytes / seconds / 1e9
    frac = f"{gbs / peak:6.1%}" if peak else "   n/a"
    return f"  {label:<44} {seconds * 1e3:9.2f} ms {gbs:8.2f} GB/s {frac} of peak  {extra}"


def bench_metal(quick: bool, peak: float | None) -> None:
    print("\npaged_decode_attention (Metal kernel) vs SDPA on gathered KV, float16, Hq 32, Hkv 8, D 128")
    lens = [512, 4096] if quick else [512, 2048, 8192, 32768]
    for B in (1, 8):
        for seq_len in lens:
            for bits in (None, 8, 4):
                case, nbytes = attention_case(B, seq_len, 32, 8, 128, 32, mx.float16, bits)
                t_k = timeit(lambda: paged_decode_attention(**pooled(case), backend="metal"), 20)
                t_b = timeit(sdpa_on_gathered(case), 20)
                label = f"B {B} len {seq_len} {'fp16' if bits is None else f'{bits}-bit'} KV"
                print(row(label + " kernel", t_k, nbytes, peak, f"{t_b / t_k:5.2f}x vs gather+SDPA"))
                print(row(label + " gather+SDPA", t_b, nbytes, peak))

    print("\ndequant_matmul_kquant (Metal kernel) vs dequantize-then-matmul, float16 x")
    shapes = (
        [(4096, 4096), (14336, 4096)]
        if quick
        else [(4096, 4096), (14336, 4096), (4096, 14336), (128256, 4096)]
    )
    for ggml_type in ("Q4_K", "Q6_K") if quick else KQUANT_TYPES:
        for N, K in shapes:
            for M in (1, 8):
                args, nbytes = kquant_case(ggml_type, M, N, K, mx.float16)
                w16 = reference.dequantize_kquant(*args[1:]).astype(mx.float16)
                mx.eval(w16)
                t_k = timeit(lambda: dequant_matmul_kquant(*args, backend="metal"), 20)
                t_b = timeit(lambda: reference.dequant_matmul_kquant(*args), 5)
                t_h = timeit(lambda: args[0] @ w16.T, 20)
                label = f"{ggml_type} {N}x{K} M {M}"
                print(row(label + " kernel", t_k, nbytes, peak, f"{t_b / t_k:5.2f}x vs dequant+matmul"))
                print(row(label + " fp16 matmul, W pre-dequantized", t_h, w16.nbytes + args[0].nbytes, peak))


def bench_cpu(quick: bool, with_interpreter: bool) -> None:
    print(
        "\nNo Metal figure: mx.metal.is_available() is False here (Metal needs an Apple GPU). Timing"
        "\nthe MLX-ops reference (the engine's CPU path) against a measured copy bandwidth, and the"
        "\ninterpreter (the Metal source run as C++ fibers on the CPU) against the reference."
    )
    copy = copy_bandwidth_gbs()
    print(
        f"\nmeasured copy bandwidth (numpy a + 1 on 256 MiB, read + write), the peak below: {copy:.1f} GB/s"
    )

    print(
        "\nreference paged_decode_attention (gather + masked softmax attention, float32 math), Hq 32, Hkv 8, D 128"
    )
    for B, seq_len in [(1, 2048), (8, 1024)] if quick else [(1, 512), (1, 4096), (8, 1024), (8, 4096)]:
        for dtype, bits in ((mx.float16, None), (mx.float16, 8), (mx.float16, 4)):
            case, nbytes = attention_case(B, seq_len, 32, 8, 128, 32, dtype, bits)
            t = timeit(lambda: paged_decode_attention(**pooled(case), backend="reference"), 3, warmup=1)
            label = f"B {B} len {seq_len} {'fp16' if bits is None else f'{bits}-bit'} KV"
            print(row(label, t, nbytes, copy))

    print("\nreference dequant_matmul_kquant (MLX-ops dequantize, then float32 matmul), float32 x")
    for ggml_type in ("Q4_K", "Q6_K"):
        for N, K in [(2048, 2048)] if quick else [(2048, 2048), (4096, 4096)]:
            for M in (1, 8):
                args, nbytes = kquant_case(ggml_type, M, N, K, mx.float32)
                t = timeit(lambda: dequant_matmul_kquant(*args, backend="reference"), 5)
                print(row(f"{ggml_type} {N}x{K} M {M}", t, nbytes, copy))

    if not with_interpreter:
        return
    if not _backend.interpret_available():
        print("\ninterpreter: kernels_metal.interpret is not importable; skipped")
        return
    print("\ninterpreter vs reference on small shapes (first call compiles; timed after warm-up)")
    cases = [
        (
            "attention B 1 len 256 Hq 4 Hkv 1 D 64 fp32",
            attention_case(1, 256, 4, 1, 64, 16, mx.float32, None)[0],
            {},
        ),
        (
            "attention B 1 len 2048 Hq 4 Hkv 1 D 128 4-bit",
            attention_case(1, 2048, 4, 1, 128, 32, mx.float16, 4)[0],
            {},
        ),
    ]
    for label, case, kw in cases:
        t_i = timeit(lambda: paged_decode_attention(**pooled(case), backend="interpret", **kw), 3, warmup=1)
        t_r = timeit(lambda: paged_decode_attention(**pooled(case), backend="reference", **kw), 5)
        print(
            f"  {label:<48} interpreter {t_i * 1e3:9.1f} ms  reference {t_r * 1e3:7.2f} ms  ({t_i / t_r:7.0f}x)"
        )
    for ggml_type in ("Q4_K", "Q6_K"):
        args, _ = kquant_case(ggml_type, 4, 256, 1024, mx.float32)
        t_i = timeit(lambda: dequant_matmul_kquant(*args, backend="interpret"), 3, warmup=1)
        t_r = timeit(lambda: dequant_matmul_kquant(*args, backend="reference"), 5)
        label = f"kquant {ggml_type} 256x1024 M 4"
        print(
            f"  {label:<48} interpreter {t_i * 1e3:9.1f} ms  reference {t_r * 1e3:7.2f} ms  ({t_i / t_r:7.0f}x)"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer shapes")
    p.add_argument("--bandwidth-gbs", type=float, help="the chip's memory bandwidth, if not in the table")
    p.add_argument("--no-interpret", action="store_true", help="skip the interpreter timings")
    args = p.parse_args()

    name = chip_name()
    print(f"machine: {platform.platform()} | {name} | mlx {mx.__version__} | metal {mx.metal.is_available()}")
    if mx.metal.is_available():
        peak = args.bandwidth_gbs or chip_bandwidth(name)
        print(f"chip bandwidth: {f'{peak:.0f} GB/s' if peak else 'unknown (pass --bandwidth-gbs)'}")
        bench_metal(args.quick, peak)
    else:
        bench_cpu(args.quick, not args.no_interpret)


if __name__ == "__main__":
    main()
