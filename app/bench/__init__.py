"""`roofline bench` and `roofline bench compare`: the front end over the engine's public API (app.bench.sweep)."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    from app.bench import compare, run

    b = sub.add_parser("bench", help="prefill and decode tokens/s against this machine's roofline (llama-bench style)",
                       description="Prefill (pp) and decode (tg) tokens/s per batch size and context depth, mean ± "
                       "stddev over repeats, each as a share of this machine's roofline. "
                       "'roofline bench compare A.json B.json' puts two saved runs side by side.")
    run.add_arguments(b)
    bsub = b.add_subparsers(dest="bench_command", metavar="compare")
    compare.add_arguments(bsub.add_parser("compare", help="two saved runs (--json) side by side, with B/A ratios"))


def cmd_bench(args: argparse.Namespace) -> int:
    from app.bench import compare, run

    if getattr(args, "bench_command", None) == "compare":
        return compare.cmd_compare(args)
    return run.cmd_bench(args)
