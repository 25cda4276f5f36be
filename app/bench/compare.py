"""`roofline bench compare A.json B.json`: two machines side by side, B/A per matching (batch, depth, test),
a bar plot as PNG (matplotlib) and in the terminal (plotext)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from app.bench.schema import load
from mlx_engine.api import RooflineError


def add_arguments(c: argparse.ArgumentParser) -> None:
    c.add_argument("a", metavar="A.json", help="the baseline (roofline bench --json)")
    c.add_argument("b", metavar="B.json", help="the other machine; ratios are B/A")
    c.add_argument("--png", metavar="FILE", help="write a bar plot of pp and tg tokens/s")
    c.add_argument("--no-plot", action="store_true", help="skip the terminal plot")
    c.add_argument("--markdown", action="store_true", help="print a Markdown table")


def label(result: dict[str, Any]) -> str:
    m = result["machine"]
    return f"{m['chip']} ({m['backend']}/{m['device']})"


def matched(a: dict[str, Any], b: dict[str, Any]) -> list[dict[str, Any]]:
    """One entry per (test, batch, depth) both files measured, in A's order."""
    rows_b = {(r["batch"], r["context"]): r for r in b["rows"]}
    out = []
    for ra in a["rows"]:
        rb = rows_b.get((ra["batch"], ra["context"]))
        if rb is None:
            continue
        for test in ("pp", "tg"):
            va, vb = ra[test]["mean"], rb[test]["mean"]
            out.append({"test": test, "batch": ra["batch"], "context": ra["context"], "a": va, "b": vb,
                        "ratio": vb / va if va > 0 else None,
                        "a_pct": ra.get(f"{test}_roofline_pct"), "b_pct": rb.get(f"{test}_roofline_pct")})
    return out


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}%"


def table(a: dict[str, Any], b: dict[str, Any], rows: list[dict[str, Any]], md: bool) -> str:
    head = ("test", "batch", "depth", "A t/s", "B t/s", "B/A", "A % roofline", "B % roofline")
    body = [(r["test"], str(r["batch"]), str(r["context"]), f"{r['a']:.2f}", f"{r['b']:.2f}",
             "-" if r["ratio"] is None else f"{r['ratio']:.2f}x", _pct(r["a_pct"]), _pct(r["b_pct"])) for r in rows]
    intro = [f"A: {label(a)}, {a['model']['name']}, {a['machine']['date']}",
             f"B: {label(b)}, {b['model']['name']}, {b['machine']['date']}"]
    if a["model"]["name"] != b["model"]["name"]:
        intro.append("note: the two files measured different models")
    if md:
        lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * 3 + ["---:"] * 5) + "|"]
        lines += ["| " + " | ".join(r) + " |" for r in body]
        return "\n".join([f"{x}  " for x in intro] + [""] + lines)
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in [head, *body]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(intro + [""] + lines)


def png(path: Path, a: dict[str, Any], b: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, test in zip(axes, ("pp", "tg")):
        sel = [r for r in rows if r["test"] == test]
        x = np.arange(len(sel))
        ax.bar(x - 0.2, [r["a"] for r in sel], 0.4, label=f"A: {label(a)}")
        ax.bar(x + 0.2, [r["b"] for r in sel], 0.4, label=f"B: {label(b)}")
        ax.set_xticks(x, [f"b{r['batch']} d{r['context']}" for r in sel])
        ax.set_title(f"{'prefill' if test == 'pp' else 'decode'} ({test}) tokens/s")
        ax.set_ylabel("tokens/s")
        for i, r in enumerate(sel):
            if r["ratio"] is not None:
                ax.annotate(f"{r['ratio']:.2f}x", (i, max(r["a"], r["b"])), ha="center", va="bottom", fontsize=8)
    axes[0].legend(fontsize=8, loc="lower left")
    fig.suptitle(f"roofline bench: {a['model']['name']}")
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=100)
    plt.close(fig)


def terminal_plot(a: dict[str, Any], b: dict[str, Any], rows: list[dict[str, Any]], width: int = 50) -> str:
    """Grouped bars of pp and tg tokens/s: plotext's where its 5.x API is installed, else unicode bars
    (plotext 6.1's figure API renders empty canvases here)."""
    try:
        import plotext as plt

        if hasattr(plt, "multiple_bar") and hasattr(plt, "build"):
            plt.clear_figure()
            plt.subplots(1, 2)
            for i, test in enumerate(("pp", "tg"), start=1):
                sel = [r for r in rows if r["test"] == test]
                plt.subplot(1, i)
                plt.multiple_bar([f"b{r['batch']} d{r['context']}" for r in sel],
                                 [[r["a"] for r in sel], [r["b"] for r in sel]], labels=["A", "B"])
                plt.title(f"{test} tokens/s")
            plt.plotsize(100, 20)
            return plt.build()
    except Exception:  # noqa: BLE001 - a plotting library problem must not lose the table
        pass
    lines = []
    for test in ("pp", "tg"):
        sel = [r for r in rows if r["test"] == test]
        top = max(max(r["a"], r["b"]) for r in sel) or 1.0
        lines.append(f"{'prefill' if test == 'pp' else 'decode'} ({test}) tokens/s")
        for r in sel:
            for side in ("a", "b"):
                n = r[side] / top * width
                bar = "\u2588" * int(n) + (" \u258f\u258e\u258d\u258c\u258b\u258a\u2589"[int((n % 1) * 8)]
                                          if n % 1 >= 0.125 else "")
                tag = f"b{r['batch']} d{r['context']}" if side == "a" else ""
                lines.append(f"  {tag:>12} {side.upper()} {bar.ljust(width + 1)} {r[side]:.1f}")
    return "\n".join(lines)


def cmd_compare(args: argparse.Namespace) -> int:
    a, b = load(args.a), load(args.b)
    rows = matched(a, b)
    if not rows:
        raise RooflineError(f"{args.a} and {args.b} share no (batch, context) row to compare")
    out = Path(args.png) if args.png else None
    if out is not None and not out.parent.exists():
        raise RooflineError(f"--png {out}: folder {out.parent} does not exist")
    print(table(a, b, rows, args.markdown))
    if not args.no_plot:
        print(terminal_plot(a, b, rows))
    if out is not None:
        png(out, a, b, rows)
        print(f"wrote {out}", file=sys.stderr)
    return 0
