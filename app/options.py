"""Options shared by the commands that run a model (chat, generate, serve, bench, parity): one definition, which
the CLI and the bench and parity commands import, so none of them imports another."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from mlx_engine.api import REASONING_EFFORTS, RooflineError

BACKENDS = ("auto", "mlx", "torch")
DEVICES = ("auto", "cpu", "cuda")


def runner_args(parser: argparse.ArgumentParser, backend: bool = True) -> None:
    """The model runner's options, one definition for every command that runs a model (chat, generate, serve,
    bench, parity: parity names its two sides with --backends instead of --backend)."""
    r = parser.add_argument_group("model runner")
    if backend:
        r.add_argument("--backend", choices=BACKENDS, default="auto",
                       help="auto (default: the faster one here: Metal on a Mac; torch on CUDA, or on an x86-64 Linux "
                       "CPU for a quantized model it runs, where torch is installed; else MLX's CPU backend), mlx "
                       "(Metal, or MLX's CPU backend) or torch (CUDA or the CPU, reading quantized weights packed; "
                       "the optional extra)")
    r.add_argument("--device", choices=DEVICES, default="auto",
                   help="auto (default), cpu or cuda (cuda means the torch backend)")
    r.add_argument("--threads", type=int, metavar="N",
                   help="CPU threads of the torch backend on the CPU (default: all the cores torch sees)")
    r.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="the torch backend on the CPU: run prefills (and decode steps, where they are not one "
                   "native call) as torch.compile graphs, compiled at load: a slower load and more memory, prefill "
                   "at most ~1.1x (default: on only where the layers are not one native call)")


def reasoning_effort_arg(group: argparse._ActionsContainer, applies_to: str = "") -> None:
    """--reasoning-effort, one definition for the commands that take it (generate, chat); `applies_to` ends its help
    with what it sets there."""
    group.add_argument("--reasoning-effort", choices=REASONING_EFFORTS,
                       help="how much a reasoning model thinks: none (or minimal) turns its thinking off; the rest "
                       "leave the template's default, or reach a template that reads them (a model without reasoning "
                       "ignores it)" + applies_to)


def runner_options(args: argparse.Namespace) -> dict[str, Any]:
    """Engine.load's runner options from `runner_args` (those left at their defaults omitted), checked before
    any model loads."""
    backend = getattr(args, "backend", None)  # None: parity, whose --backends names its sides
    # auto: a torch-only option picks the torch backend (backends.choice)
    torch_side = backend in ("torch", "auto") if backend is not None else "torch" in getattr(args, "backends", "")
    if args.device == "cuda" and not torch_side:
        raise RooflineError("--device cuda needs --backend torch or auto (the MLX backend runs on Metal or the CPU)")
    if args.threads is not None and args.threads < 1:
        raise RooflineError(f"--threads {args.threads}: expected an integer >= 1")
    compile_flag = "--compile" if args.compile else "--no-compile"
    for flag, value in (("--threads", args.threads), (compile_flag, args.compile)):
        if value is not None and not torch_side:
            raise RooflineError(f"{flag} needs --backend torch or auto (it sets the torch backend's CPU work)")
    chosen = (("backend", backend or "auto", "auto"), ("device", args.device, "auto"), ("threads", args.threads, None),
              ("compile", args.compile, None))
    return {k: v for k, v, default in chosen if v != default}


def load_engine(model: str | None, no_tokenizer: str = "fine", **options: Any) -> Any:
    """Engine.load, its warnings on stderr. A model without a tokenizer: "error" where the command reads or writes
    text, "warn" where text is what users mostly send (the server), "fine" where token ids are the input."""
    from mlx_engine import Engine

    engine = Engine.load(model, **options)
    for warning in engine.info.warnings:
        print(f"roofline: warning: {warning}", file=sys.stderr)
    if not engine.info.has_tokenizer and no_tokenizer != "fine":
        what = f"{engine.info.name} came without a tokenizer (no tokenizer.json or tokenizer.model beside its weights)"
        if no_tokenizer == "error":
            engine.close()
            raise RooflineError(f"{what}, so it cannot read a prompt or write a reply: use a model folder with its "
                                "tokenizer files (`roofline logits --token-ids` runs it on token ids)")
        print(f"roofline: warning: {what}: requests must send token ids (prompt_token_ids) and replies carry token "
              "ids, not text", file=sys.stderr)
    return engine
