"""`roofline parity`: the same prompts through two backends (or two checkpoints), compared position by
position: max |Δlogit|, top-1 agreement, KL divergence, greedy tokens; when they diverge, the first layer
whose hidden states differ beyond a relative tolerance."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from mlx_engine.api import GenerationRequest, RequestError, RooflineError, SamplingParams

SCHEMA = "roofline-parity-1"
DEFAULT_PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "In 1969, the first humans to walk on the Moon were",
    "Memory bandwidth bounds the speed of decoding because",
)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("parity", help="the same prompts through two backends: logits, KL, greedy tokens, first diverging layer")
    p.add_argument("--model", "-m", help="GGUF file, model folder or HF repo id (default: the embedded SmolLM2)")
    p.add_argument("--model-b", help="a different checkpoint for the second side (default: --model); same tokenizer")
    p.add_argument("--backends", default="mlx,torch", help="the two sides, A,B (default mlx,torch)")
    from app.options import runner_args

    runner_args(p, backend=False)  # --device, --threads, --[no-]compile: of the non-MLX side(s); MLX runs where MLX runs
    p.add_argument("--dtype", choices=("float32", "float16", "bfloat16"),
                   help="activation dtype of the non-MLX side(s) (default: the backend's; float16 on CUDA)")
    p.add_argument("--prompts", metavar="FILE",
                   help='one prompt per line, or JSONL lines {"prompt": text} / {"ids": [token ids]} '
                   "(default: a few built-in prompts)")
    p.add_argument("--steps", type=int, default=64, help="greedy tokens to compare per prompt (default 64)")
    p.add_argument("--kl-tol", type=float, default=1e-3, help="mean KL per position above which a prompt diverges (default 1e-3)")
    p.add_argument("--logit-tol", type=float, help="also diverge when max |Δlogit| exceeds this (default: off)")
    p.add_argument("--hidden-tol", type=float, default=1e-2,
                   help="relative difference ||hA - hB|| / ||hA|| that marks a layer as diverging (default 1e-2)")
    p.add_argument("--json", metavar="FILE", help="also write the report as JSON (schema roofline-parity-1)")


# --- inputs ---------------------------------------------------------------------------------------------

def read_prompts(path: str | None) -> list[str | list[int]]:
    """Texts or token-id lists: from FILE (plain lines or JSONL) or the built-in prompts."""
    if path is None:
        return list(DEFAULT_PROMPTS)
    try:
        lines = Path(path).read_text().splitlines()
    except FileNotFoundError:
        raise RooflineError(f"--prompts {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise RooflineError(f"--prompts {path}: cannot read it ({e})") from None
    out: list[str | list[int]] = []
    for n, line in enumerate(lines, start=1):
        s = line.strip()
        if not s:
            continue
        if s[0] in '{"[':
            try:
                item = json.loads(s)
            except json.JSONDecodeError as e:
                raise RooflineError(f"--prompts {path} line {n}: not JSON ({e.msg})") from None
            if isinstance(item, dict):
                key = "ids" if "ids" in item else "prompt"
                item = item.get(key)
                if key == "ids" and not isinstance(item, list):
                    item = None
            ok_ids = isinstance(item, list) and item and all(isinstance(t, int) and not isinstance(t, bool) for t in item)
            if not (ok_ids or (isinstance(item, str) and item)):
                raise RooflineError(f'--prompts {path} line {n}: expected a string, {{"prompt": text}} or '
                                    '{"ids": [token ids]}')
            out.append(item)
        else:
            out.append(line)
    if not out:
        raise RooflineError(f"--prompts {path}: no prompts in it")
    return out


def load_side(model: str | None, backend: str, device: str, dtype: str | None = None, **options: Any) -> Any:
    """One side: MLX where MLX runs; torch on `device` with `dtype` and the runner `options` (threads,
    compile)."""
    from mlx_engine import Engine

    if backend == "mlx":
        return Engine.load(model, backend=backend, device="auto")
    return Engine.load(model, backend=backend, device=device, **({"dtype": dtype} if dtype else {}), **options)


def prompt_ids(a: Any, b: Any, prompts: list[str | list[int]]) -> list[list[int]]:
    """Token ids of each prompt, the same on both sides, or a RooflineError saying where they differ."""
    if a.info.vocab_size != b.info.vocab_size:
        raise RooflineError(f"the two sides have different vocabularies ({a.info.vocab_size} vs {b.info.vocab_size} "
                            "tokens): parity needs one tokenizer")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, list):
            out.append(p)
            continue
        try:
            ia, ib = a.encode(p), b.encode(p)
        except RequestError as e:
            raise RooflineError(f'{e} (for parity: --prompts FILE with JSONL lines {{"ids": [...]}})') from None
        if ia != ib:
            k = next((j for j, (x, y) in enumerate(zip(ia, ib)) if x != y), min(len(ia), len(ib)))
            raise RooflineError(f"mismatched tokenizers: prompt {i + 1} ({p[:40]!r}) is {len(ia)} tokens on A and "
                                f"{len(ib)} on B, first different at token {k} "
                                f"({ia[k] if k < len(ia) else 'end'} vs {ib[k] if k < len(ib) else 'end'}); "
                                "parity needs the same tokenizer on both sides")
        out.append(ia)
    return out


# --- measures -------------------------------------------------------------------------------------------

def log_softmax(x: Any) -> Any:
    import numpy as np

    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def compare_logits(la: Any, lb: Any) -> dict[str, Any]:
    """la, lb (T, V) -> max |Δlogit|, top-1 agreement, KL(A || B) per position (mean, max, all)."""
    import numpy as np

    if la.shape != lb.shape:
        raise RooflineError(f"the two sides' logits differ in shape ({la.shape} vs {lb.shape})")
    pa, pb = log_softmax(la), log_softmax(lb)  # (T, V) log-probabilities
    kl = (np.exp(pa) * (pa - pb)).sum(axis=-1)  # (T,)
    return {"max_abs_logit_diff": float(np.abs(la.astype(np.float64) - lb).max()),
            "top1_agreement": float((la.argmax(-1) == lb.argmax(-1)).mean()),
            "kl_mean": float(kl.mean()), "kl_max": float(kl.max()), "kl_per_position": [float(x) for x in kl]}


def greedy(engine: Any, ids: list[int], steps: int) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    out: list[int] = []
    for event in engine.generate(GenerationRequest(prompt_token_ids=ids, sampling=params)):
        out.extend(event.token_ids)
        if event.finish_reason == "error":
            raise RooflineError(f"greedy decoding failed: {event.error}")
    return out


def layer_name(i: int) -> str:
    return "embedding" if i == 0 else f"layer {i - 1}"


def first_diverging_layer(ha: list[Any], hb: list[Any], tol: float) -> tuple[int | None, list[float]]:
    """Index into [embedding, layer 0, ...] of the first hidden state with ||a - b|| / ||a|| > tol."""
    import numpy as np

    if len(ha) != len(hb):
        raise RooflineError(f"the two sides have different layer counts ({len(ha) - 1} vs {len(hb) - 1})")
    rel = [float(np.linalg.norm(a.astype(np.float64) - b) / max(np.linalg.norm(a.astype(np.float64)), 1e-30))
           for a, b in zip(ha, hb)]
    return next((i for i, r in enumerate(rel) if r > tol), None), rel


def divergence_margins(a: Any, b: Any, ids: list[int], token_a: int, token_b: int) -> dict[str, float]:
    """Where greedy decoding parts (after `ids`, A picks token_a and B token_b): by how many logits each side
    prefers its own token, from a fresh forward of each. Both within the logits' noise (max |Δlogit|) is a
    tie that the two sides' rounding breaks differently, not a wrong layer."""
    la, lb = a.forward_logits(ids)[-1], b.forward_logits(ids)[-1]
    return {"a": float(la[token_a]) - float(la[token_b]), "b": float(lb[token_b]) - float(lb[token_a]),
            "logit": float(la[token_a])}


def compare_prompt(a: Any, b: Any, ids: list[int], args: argparse.Namespace) -> dict[str, Any]:
    r = compare_logits(a.forward_logits(ids), b.forward_logits(ids))
    ta, tb = greedy(a, ids, args.steps), greedy(b, ids, args.steps)
    first = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), None)
    if first is None and len(ta) != len(tb):
        first = min(len(ta), len(tb))
    reasons = []
    if first is not None:
        reasons.append(f"greedy tokens differ from step {first}")
    if r["top1_agreement"] < 1:
        reasons.append(f"top-1 agreement {r['top1_agreement']:.3f}")
    if r["kl_mean"] > args.kl_tol:
        reasons.append(f"mean KL {r['kl_mean']:.2e} > {args.kl_tol:g}")
    if args.logit_tol is not None and r["max_abs_logit_diff"] > args.logit_tol:
        reasons.append(f"max |Δlogit| {r['max_abs_logit_diff']:.2e} > {args.logit_tol:g}")
    r.update(num_tokens=len(ids), tokens_a=ta, tokens_b=tb, tokens_identical=first is None,
             first_divergence_step=first, diverged=bool(reasons), reasons=reasons,
             first_diverging_layer=None, layer_rel_diffs=None, divergence_margins=None)
    if first is not None and first < min(len(ta), len(tb)):
        r["divergence_margins"] = divergence_margins(a, b, ids + ta[:first], ta[first], tb[first])
    if reasons:
        try:
            index, rel = first_diverging_layer(a.hidden_states(ids), b.hidden_states(ids), args.hidden_tol)
        except RooflineError as e:
            r["layer_note"] = f"hidden states not compared: {e}"
        else:
            r["layer_rel_diffs"] = rel
            if index is not None:
                r["first_diverging_layer"] = {"index": index, "name": layer_name(index), "rel_diff": rel[index]}
            else:
                r["layer_note"] = (f"no hidden state differs by more than {args.hidden_tol:g}: "
                                   "the difference arises in the final norm or the head")
    return r


# --- the command ----------------------------------------------------------------------------------------

def cmd_parity(args: argparse.Namespace) -> int:
    backends = [x.strip() for x in args.backends.split(",") if x.strip()]
    if len(backends) != 2 or any(x not in ("mlx", "torch") for x in backends):
        raise RooflineError(f"--backends {args.backends!r}: expected two of mlx, torch, e.g. mlx,torch")
    if args.steps < 1:
        raise RooflineError(f"--steps {args.steps}: expected >= 1")
    if "torch" not in backends and args.device == "cuda":
        raise RooflineError("--device cuda needs a torch side (--backends mlx,torch)")
    if "torch" not in backends and args.dtype is not None:
        raise RooflineError(f"--dtype {args.dtype} sets the torch side's activations: it needs --backends mlx,torch")
    from app.options import runner_options

    options = runner_options(args)
    options.pop("device", None)
    out = Path(args.json) if args.json else None
    if out is not None and not out.parent.exists():
        raise RooflineError(f"--json {out}: folder {out.parent} does not exist")
    prompts = read_prompts(args.prompts)
    model_b = args.model_b if args.model_b is not None else args.model
    a = load_side(args.model, backends[0], args.device, args.dtype, **options)
    try:
        b = load_side(model_b, backends[1], args.device, args.dtype, **options)
        try:
            report = run(a, b, prompts, backends, args)
        finally:
            b.close()
    finally:
        a.close()
    if out is not None:
        out.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {out}", file=sys.stderr)
    print(render(report))
    return 1 if report["summary"]["diverged"] else 0


def run(a: Any, b: Any, prompts: list[str | list[int]], backends: list[str], args: argparse.Namespace) -> dict[str, Any]:
    ids = prompt_ids(a, b, prompts)
    sides = [{"backend": be, "device": e.info.device or (args.device if be != "mlx" else "auto"), "model": e.info.name,
              "path": e.info.path, "dtype": e.info.dtype} for be, e in zip(backends, (a, b))]
    rows = []
    for p, i in zip(prompts, ids):
        r = compare_prompt(a, b, i, args)
        r["prompt"] = p if isinstance(p, str) else None
        if a.tokenizer is not None and hasattr(a.tokenizer, "decode"):
            try:
                r["text_a"], r["text_b"] = a.tokenizer.decode(r["tokens_a"]), a.tokenizer.decode(r["tokens_b"])
            except Exception:  # noqa: BLE001 - a model without a tokenizer has no text
                pass
        rows.append(r)
    import numpy as np

    summary = {"diverged": any(r["diverged"] for r in rows),
               "max_abs_logit_diff": max(r["max_abs_logit_diff"] for r in rows),
               "min_top1_agreement": min(r["top1_agreement"] for r in rows),
               "kl_mean": float(np.mean([r["kl_mean"] for r in rows])), "kl_max": max(r["kl_max"] for r in rows),
               "tokens_identical": all(r["tokens_identical"] for r in rows)}
    return {"schema": SCHEMA, "command": " ".join(["roofline", *sys.argv[1:]]), "sides": sides,
            "settings": {"steps": args.steps, "kl_tol": args.kl_tol, "logit_tol": args.logit_tol,
                         "hidden_tol": args.hidden_tol},
            "prompts": rows, "summary": summary}


def render(report: dict[str, Any]) -> str:
    sa, sb = report["sides"]
    lines = [f"A: {sa['backend']} on {sa['device']} ({sa['model']}, {sa['dtype']})",
             f"B: {sb['backend']} on {sb['device']} ({sb['model']}, {sb['dtype']})", ""]
    head = ("#", "tokens", "max|Δlogit|", "top-1", "KL mean", "KL max", f"greedy {report['settings']['steps']}",
            "first diverging layer")
    body = []
    for n, r in enumerate(report["prompts"], start=1):
        greedy_text = "identical" if r["tokens_identical"] else f"differ @ {r['first_divergence_step']}"
        layer = r["first_diverging_layer"]["name"] if r["first_diverging_layer"] else ("-" if not r["diverged"] else "none")
        body.append((str(n), str(r["num_tokens"]), f"{r['max_abs_logit_diff']:.2e}", f"{r['top1_agreement']:.3f}",
                     f"{r['kl_mean']:.2e}", f"{r['kl_max']:.2e}", greedy_text, layer))
    widths = [max(len(x[i]) for x in [head, *body]) for i in range(len(head))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(x, widths)) for x in [head, *body]]
    lines.insert(4, "  ".join("-" * w for w in widths))
    for n, r in enumerate(report["prompts"], start=1):
        if r["diverged"]:
            lines.append(f"prompt {n}: diverged ({'; '.join(r['reasons'])})")
            if r.get("layer_note"):
                lines.append(f"  {r['layer_note']}")
            if r["first_diverging_layer"]:
                d = r["first_diverging_layer"]
                lines.append(f"  first diverging hidden state: {d['name']} (relative difference {d['rel_diff']:.2e})")
            if not r["tokens_identical"]:
                k = r["first_divergence_step"]
                lines.append(f"  A tokens from step {k}: {r['tokens_a'][k:k + 8]}")
                lines.append(f"  B tokens from step {k}: {r['tokens_b'][k:k + 8]}")
                m = r.get("divergence_margins")
                if m is not None:
                    tie = max(m["a"], m["b"]) <= r["max_abs_logit_diff"]
                    lines.append(f"  at step {k}, A prefers its token by {m['a']:.4f} logits and B its own by "
                                 f"{m['b']:.4f} (logits near {m['logit']:.1f})"
                                 + (f": a tie within the logits' noise ({r['max_abs_logit_diff']:.2e})" if tie else ""))
    s = report["summary"]
    lines.append(f"{'DIVERGED' if s['diverged'] else 'OK'}: max |Δlogit| {s['max_abs_logit_diff']:.2e}, "
                 f"min top-1 agreement {s['min_top1_agreement']:.3f}, mean KL {s['kl_mean']:.2e}, "
                 f"greedy tokens {'identical' if s['tokens_identical'] else 'differ'}")
    return "\n".join(lines)
