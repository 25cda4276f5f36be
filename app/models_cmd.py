"""`roofline models`, `pull`, `rm` and `convert`: the models on this machine, and getting and removing them."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from mlx_engine.api import RooflineError

REF_HELP = ("ORG/NAME[:QUANT] (Hugging Face), ollama:NAME[:TAG], lmstudio:PUBLISHER/REPO[/FILE], a GGUF file or a "
            "model folder")


def add_parsers(sub: argparse._SubParsersAction) -> None:
    m = sub.add_parser("models", help="every model on this machine: the embedded one, the Hugging Face cache, "
                       "Ollama, LM Studio and folders added in the app (read from headers only)")
    m.add_argument("--json", action="store_true", help="print a JSON list of objects (ref, source, name, format, "
                   "quantization, num_parameters, size_bytes, context_length, fits, ...)")

    p = sub.add_parser("pull", help="download a model from the Hugging Face Hub into its cache (resumable)")
    p.add_argument("repo", metavar="ORG/NAME[:QUANT]", help="a Hub model repo; a GGUF repo's quantization after ':'")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--quant", metavar="Q", help="in a GGUF repo, the quantization to fetch, e.g. Q4_K_M")
    which.add_argument("--file", metavar="F.gguf", help="in a GGUF repo, the file to fetch")
    p.add_argument("--revision", metavar="R", help="a branch, tag or commit (default: main)")

    r = sub.add_parser("rm", help="remove a model from the Hugging Face cache, Ollama or LM Studio (asks first)")
    r.add_argument("ref", metavar="REF", help="as `roofline models` lists it")
    r.add_argument("--yes", "-y", action="store_true", help="remove without asking")

    c = sub.add_parser("convert", help="write a model as an MLX-quantized folder in mlx-lm's format")
    c.add_argument("src", metavar="SRC", help=REF_HELP)
    c.add_argument("--output", "-o", required=True, metavar="OUT", help="the new folder (must not exist)")
    c.add_argument("--bits", type=int, choices=(4, 8), default=4, help="bits per weight (default 4)")
    c.add_argument("--group-size", type=int, choices=(32, 64, 128), default=64,
                   help="weights per scale and bias (default 64)")
    c.add_argument("--dtype", choices=("float16", "bfloat16", "float32"),
                   help="float tensors and scales (default: the source's; float16 for a GGUF)")


def human_size(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def human_params(n: int) -> str:
    if not n:
        return "?"
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}" if n < 10 * scale else f"{n / scale:.0f}{unit}"
    return str(n)


def app_model_paths() -> list[str]:
    """The paths added in the app's picker (its preferences; nothing when it never ran)."""
    from app.tui.store import ChatStore, data_dir

    db = data_dir() / "chats.db"
    if not db.exists():
        return []
    try:
        value = json.loads(ChatStore(db).get_pref("model_paths", "[]") or "[]")
    except Exception:  # noqa: BLE001 - an unreadable store lists nothing extra
        return []
    return [p for p in value if isinstance(p, str)] if isinstance(value, list) else []


def cmd_models(args: argparse.Namespace) -> int:
    from mlx_engine.catalog import scan_local_models
    from mlx_engine.loading.sources import EMBEDDED_REF

    models, notes = scan_local_models(app_model_paths())
    if args.json:
        rows = [{**m.to_json(), "ref": m.ref or EMBEDDED_REF} for m in models]
        print(json.dumps(rows, indent=2, ensure_ascii=False))
    else:
        header = ("REF", "SOURCE", "FORMAT", "QUANT", "PARAMS", "SIZE", "CONTEXT", "FITS")
        table = [header]
        for m in models:
            if m.error:
                table.append((m.ref, m.source, "unreadable", "", "", "", "", m.error[:60]))
                continue
            table.append((m.ref or EMBEDDED_REF, m.source, m.format, m.quantization, human_params(m.num_parameters),
                          human_size(m.size_bytes), f"{m.context_length:,}" if m.context_length else "?",
                          "yes" if m.fits else f"no ({human_size(m.need_bytes)})"))
        widths = [max(len(row[i]) for row in table) for i in range(len(header))]
        for row in table:
            print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    for note in notes:
        print(f"roofline: note: {note}", file=sys.stderr)
    return 0


def _choose_quant(options: list[tuple[str, int]]) -> str | None:
    """Asks on the terminal which quantization to pull (None: none chosen)."""
    print("this repo holds several quantizations:", file=sys.stderr)
    for i, (label, size) in enumerate(options, 1):
        print(f"  {i:>2}. {label:<12} {human_size(size)}", file=sys.stderr)
    answer = input(f"which one? [1-{len(options)} or a name, Enter to stop] ").strip()
    if answer.isdigit() and 1 <= int(answer) <= len(options):
        return options[int(answer) - 1][0]
    return next((label for label, _ in options if label.lower() == answer.lower()), None)


def cmd_pull(args: argparse.Namespace) -> int:
    from mlx_engine.loading.sources import parse_hf_ref
    from mlx_engine.loading.sources_hub import StderrProgress, bytes_on_disk, check_disk, plan_pull, pull
    from mlx_engine.memory import available_memory

    parsed = parse_hf_ref(args.repo)
    if parsed is None:
        raise RooflineError(f"{args.repo!r}: expected a Hugging Face repo id ORG/NAME (optionally :QUANT), e.g. "
                            "HuggingFaceTB/SmolLM2-360M-Instruct or bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M")
    repo_id, tag = parsed
    quant, file = args.quant, args.file
    if tag is not None:
        if quant or file:
            raise RooflineError(f"{args.repo}: the quantization is named twice (after ':' and by --quant/--file)")
        quant, file = (None, tag) if tag.lower().endswith(".gguf") else (tag, None)
    interactive = sys.stdin.isatty() and sys.stderr.isatty()  # else a GGUF repo's quantizations are listed
    plan = plan_pull(repo_id, args.revision, quant, file, choose=_choose_quant if interactive else None)
    check_disk(plan, bytes_on_disk(plan))  # before the memory warning: a refusal is the one line
    limit = available_memory()
    weights = sum(f.size for f in plan.files if f.name.endswith((".safetensors", ".gguf")))
    if weights > limit.bytes:
        print(f"roofline: warning: {plan.ref} has {human_size(weights)} of weights and this machine can give "
              f"{human_size(limit.bytes)} ({limit.source}): it will not load here", file=sys.stderr)
    try:
        path, _, plan = pull(repo_id, revision=args.revision, progress=StderrProgress(), plan=plan)
    except KeyboardInterrupt:
        print(f"\nroofline: interrupted; {human_size(bytes_on_disk(plan))} of {human_size(plan.total_bytes)} kept: "
              f"`roofline pull {plan.ref}` resumes", file=sys.stderr)
        return 130
    print(plan.ref)
    print(f"ready: roofline chat -m {plan.ref}  ({path})", file=sys.stderr)
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    from mlx_engine.loading.sources_rm import remove, removal

    r = removal(args.ref)
    question = f"remove {r.ref} ({human_size(r.size_bytes)}) from {r.where}? [y/N] "
    if not args.yes:
        if not sys.stdin.isatty():
            raise RooflineError(f"rm asks before it deletes {r.ref} ({human_size(r.size_bytes)}); not on a terminal, "
                                "pass --yes to remove it without asking")
        if input(question).strip().lower() not in ("y", "yes"):
            print("kept", file=sys.stderr)
            return 1
    freed = remove(r)
    print(f"removed {r.ref}: {human_size(freed)} freed", file=sys.stderr)
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from mlx_engine.loading.convert import convert

    done = convert(args.src, args.output, bits=args.bits, group_size=args.group_size, dtype=args.dtype,
                   progress=lambda line: print(f"convert: {line}", file=sys.stderr))
    print(f"wrote {done.path}: {human_size(done.size_bytes)}, {done.bits_per_weight:.2f} bits per weight, "
          f"{done.num_quantized} layers quantized; load it with -m {done.path} (mlx-lm and LM Studio read it too)",
          file=sys.stderr)
    return 0


COMMANDS: dict[str, Any] = {"models": cmd_models, "pull": cmd_pull, "rm": cmd_rm, "convert": cmd_convert}
