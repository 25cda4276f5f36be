"""`roofline bench`: a llama-bench-style table of prefill and decode tokens/s, each against this machine's
roofline, as text, Markdown or JSON."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from app.bench.schema import SCHEMA, validate
from mlx_engine.api import RooflineError


def int_list(flag: str, text: str, minimum: int) -> tuple[int, ...]:
    """"1,4,8" -> (1, 4, 8); a clear RooflineError for anything else."""
    try:
        values = tuple(int(x) for x in text.replace(" ", "").split(",") if x)
    except ValueError:
        raise RooflineError(f"{flag} {text!r}: expected comma-separated integers, e.g. 1,4,8") from None
    if not values:
        raise RooflineError(f"{flag} is empty: expected comma-separated integers, e.g. 1,4,8")
    bad = [v for v in values if v < minimum]
    if bad:
        raise RooflineError(f"{flag} {text!r}: {bad[0]} is below {minimum}")
    return tuple(dict.fromkeys(values))


def add_arguments(b: argparse.ArgumentParser) -> None:
    b.add_argument("--model", "-m", help="GGUF file, model folder or HF repo id (default: the embedded SmolLM2)")
    from app.options import runner_args

    runner_args(b)
    b.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_const", const=False, default=None,
                   help="torch on CUDA: launch each decode step's kernels one by one (default: replay a CUDA graph)")
    # The defaults: a sweep of a few minutes on a small CPU (SmolLM2 on 2 x86 cores: ~4 min from the quiet
    # machine's rates, 10 under load 10-12; the old 512/128, batches 1,4,8, depths 0,4096, 5 repeats ran past 8).
    # llama-bench's own are -p 512 -n 128 -r 5.
    b.add_argument("-p", "--prompt-tokens", type=int, default=256, help="prompt tokens per prefill test (default 256)")
    b.add_argument("-n", "--gen-tokens", type=int, default=64, help="new tokens per decode test (default 64)")
    b.add_argument("--batch", "-b", help="concurrent sequences, comma-separated (default 1,4; an embedding model: "
                   "inputs per embed call, default 1,16,64)")
    b.add_argument("--context", "-d", default="0,1024",
                   help="tokens already in the KV cache before each test, comma-separated (default 0,1024; depths "
                   "beyond the model's context are skipped, and said)")
    b.add_argument("--repeats", "-r", type=int, default=3, help="runs per test (default 3)")
    b.add_argument("--json", metavar="FILE", help="also write the results as JSON (schema roofline-bench-1)")
    b.add_argument("--markdown", action="store_true", help="print a Markdown table instead of the text table")
    b.add_argument("--distributed", metavar="MODE",
                   help="pipeline or tensor, under mlx.launch: also each rank's weights and KV, the link's measured "
                   "bandwidth and its roof (bytes exchanged per token over that bandwidth)")


def cmd_bench(args: argparse.Namespace) -> int:
    from app.bench.embed import DEFAULT_BATCHES, cmd_bench_embeddings, is_embedding_model
    from app.bench.sweep import BenchSpec

    if is_embedding_model(args.model):  # no prefill or decode to time: embeddings throughput rows instead
        return cmd_bench_embeddings(args, int_list("--batch", args.batch or DEFAULT_BATCHES, 1))
    args.batch = args.batch or "1,4"

    spec = BenchSpec(prompt_tokens=args.prompt_tokens, gen_tokens=args.gen_tokens,
                     batches=int_list("--batch", args.batch, 1), contexts=int_list("--context", args.context, 0),
                     repeats=args.repeats)
    spec.validate()
    from app.options import runner_options

    options = runner_options(args)
    out = Path(args.json) if args.json else None
    if out is not None and not out.parent.exists():
        raise RooflineError(f"--json {out}: folder {out.parent} does not exist")
    if args.cuda_graphs is not None and args.backend == "mlx":
        raise RooflineError("--no-cuda-graphs needs --backend torch or auto (CUDA graphs are the torch backend's)")
    spec, skipped = fit_contexts(args.model, spec)
    fmt = markdown_lines if args.markdown else text_lines
    printed = 0

    def show(partial: dict[str, Any]) -> None:
        """Prints what is new since the last call: the header once, then each finished point's rows."""
        nonlocal printed
        lines = fmt(partial)
        for line in lines[printed:]:
            print(line, flush=True)
        printed = len(lines)

    options.update({} if args.cuda_graphs is None else {"cuda_graphs": args.cuda_graphs})
    if args.distributed is not None:
        options["distributed"] = args.distributed
    result = run(args.model, spec, options.pop("backend", "auto"), options.pop("device", "auto"),
                 command=" ".join(["roofline", *sys.argv[1:]]), on_point=show, skipped_contexts=skipped, **options)
    for line in distributed_lines(result):
        print(line, flush=True)
    if result.get("interrupted"):
        print(f"roofline: interrupted: kept the {len(result['rows'])} finished point(s) above", file=sys.stderr)
    if out is not None and result["rows"]:
        out.write_text(json.dumps(validate(result, "the bench result"), indent=1) + "\n")
        print(f"wrote {out}", file=sys.stderr)
    return 130 if result.get("interrupted") else 0


def fit_contexts(model: str | None, spec: Any) -> tuple[Any, tuple[int, ...]]:
    """(`spec` without the depths the model's context cannot hold, those depths), each said on stderr; the spec
    itself when the context is unknown before loading, or when no depth fits (the load then says why in one line)."""
    import dataclasses

    from mlx_engine.catalog import kv_shape

    try:
        context = kv_shape(model).context_length
    except RooflineError:
        return spec, ()
    need = max(spec.prompt_tokens + 1, spec.gen_tokens + 1)
    fits = tuple(d for d in spec.contexts if d + need <= context) if context else spec.contexts
    if not fits or fits == spec.contexts:
        return spec, ()
    for d in spec.contexts:
        if d not in fits:
            print(f"roofline: note: skipping --context {d}: with -p {spec.prompt_tokens} -n {spec.gen_tokens} it needs "
                  f"{d + need} tokens and the model's context is {context}", file=sys.stderr)
    return dataclasses.replace(spec, contexts=fits), tuple(d for d in spec.contexts if d not in fits)


def run(model: str | None, spec: Any, backend: str, device: str, command: str = "roofline bench",
        on_point: Any = None, skipped_contexts: tuple[int, ...] = (), **options: Any) -> dict[str, Any]:
    """Loads the model (`options`: more of Engine.load's: cuda_graphs, threads, compile) and measures `spec` one
    (batch, depth) point at a time, a progress bar on stderr when it is a terminal; `on_point(result)` after the
    header is known and after each point (the rows so far). Ctrl+C stops at once: the result holds the finished
    points and "interrupted": true."""
    import dataclasses

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from app.bench.machine import machine_info, peak_bandwidth, peak_flops
    from app.bench import sweep as bench
    from app.tui.store import data_dir

    distributed = options.get("distributed")
    engine = bench.load_engine(model, spec, backend, device, **options)
    try:
        dev = bench.engine_device(engine, device)
        home = data_dir()
        bw = peak_bandwidth(dev, home)
        flops = peak_flops(dev, home, lambda: engine.diagnostics().matmul_flops(dev))
        info = engine.info
        machine = machine_info(engine.info.backend, dev, bench.versions())  # what "auto" chose
        machine.update(peak_bandwidth=bw, peak_flops=flops)
        result = {
            "schema": SCHEMA,
            "command": command,
            "machine": machine,
            "model": {"name": info.name, "path": info.path, "model_type": info.model_type,
                      "source_format": info.source_format, "quantization": info.quantization, "dtype": info.dtype,
                      "num_parameters": info.num_parameters, "weight_bytes": info.weight_bytes,
                      "context_length": info.context_length,
                      "decode_bytes_per_token": engine.decode_bytes_per_token(0)},
            "settings": {"prompt_tokens": spec.prompt_tokens, "gen_tokens": spec.gen_tokens, "repeats": spec.repeats,
                         "batches": list(spec.batches), "contexts": list(spec.contexts),
                         "skipped_contexts": list(skipped_contexts)},
            "rows": [],
        }
        if on_point is not None:
            on_point(result)
        console = Console(stderr=True)
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=console, transient=True) as progress:
            task = progress.add_task(f"bench {info.name}", total=bench.num_runs(spec))
            try:
                # one point per call, so that each is shown (and kept) as soon as it is measured; a seed of its own,
                # so that no point's prompts are another's (prefix caching would fake their prefill)
                points = [(b, d) for b in spec.batches for d in spec.contexts]
                for i, (b, d) in enumerate(points):
                    one = dataclasses.replace(spec, batches=(b,), contexts=(d,), seed=spec.seed + i)
                    (p,) = bench.run_bench(engine, one, lambda label: progress.update(
                        task, advance=1, description=f"bench {info.name} {label}"))
                    result["rows"].append(_row(engine, p, bw, flops))
                    if on_point is not None:
                        on_point(result)
            except KeyboardInterrupt:
                result["interrupted"] = True
        if distributed is not None and not result.get("interrupted"):
            result["distributed"] = _distributed(engine, spec)
    finally:
        engine.close()
    return result


def _distributed(engine: Any, spec: Any) -> dict[str, Any]:
    """Each rank's figures, the measured link and its roof at each batch (`mlx_engine.distributed.link_roof`)."""
    from mlx_engine.distributed import link_roof

    stats = engine.kv_stats()
    ranks, link = stats["ranks"], stats["link"]
    r0 = ranks[0]
    plan_per_step = r0["plan_bytes"] / max(1, r0["forwards"])
    roofs = [{"batch": b, **link_roof(link, stats["mode"], len(ranks), r0["model_layers"], r0["hidden"],
                                      r0["itemsize"], b, plan_per_step)} for b in spec.batches]
    return {"mode": stats["mode"], "ranks": ranks, "link": link, "link_roof": roofs}


def _stat(values: list[float]) -> dict[str, Any]:
    return {"mean": statistics.fmean(values) if values else 0.0,
            "stddev": statistics.stdev(values) if len(values) > 1 else 0.0, "values": values}


def _row(engine: Any, p: Any, bw: dict[str, Any], flops: dict[str, Any]) -> dict[str, Any]:
    from app.bench.sweep import decode_bytes_per_step

    tg, pp = _stat(p.tg_tps), _stat(p.pp_tps)
    step_bytes = decode_bytes_per_step(engine, p.batch, p.tg_mean_context)
    # decode: bytes per step x steps/s (each step gives one token to each of the B sequences)
    tg_pct = 100 * step_bytes * (tg["mean"] / p.batch) / (bw["gbs"] * 1e9) if bw["gbs"] else None
    # prefill: a matmul-bound pass does 2 FLOPs per parameter per token
    pp_pct = 100 * 2 * engine.info.num_parameters * pp["mean"] / (flops["tflops"] * 1e12) if flops["tflops"] else None
    return {"batch": p.batch, "context": p.context, "pp": pp, "tg": tg,
            "pp_tokens": round(statistics.fmean(p.pp_tokens)) if p.pp_tokens else 0,
            "peak_memory_bytes": int(p.peak_memory_bytes), "decode_bytes_per_step": step_bytes,
            "tg_roofline_pct": tg_pct, "pp_roofline_pct": pp_pct}


# --- output ---------------------------------------------------------------------------------------------

HEADER = ("model", "backend", "device", "batch", "test", "t/s", "% roofline", "peak mem")


def table_rows(result: dict[str, Any]) -> list[tuple[str, ...]]:
    m, s = result["machine"], result["settings"]
    name, quant = result["model"]["name"], result["model"].get("quantization") or ""
    name = name if quant in name else f"{name} {quant}".strip()
    out = []
    for r in result["rows"]:
        depth = f" @ d{r['context']}" if r["context"] else ""
        for test, n, pct in (("pp", s["prompt_tokens"], r.get("pp_roofline_pct")),
                             ("tg", s["gen_tokens"], r.get("tg_roofline_pct"))):
            st = r[test]
            out.append((name, m["backend"], m["device"], str(r["batch"]), f"{test}{n}{depth}",
                        f"{st['mean']:.2f} ± {st['stddev']:.2f}", "-" if pct is None else f"{pct:.1f}%",
                        f"{r['peak_memory_bytes'] / 2**20:.0f} MiB" if r["peak_memory_bytes"] else "-"))
    return out


def roofline_lines(result: dict[str, Any]) -> list[str]:
    m, settings = result["machine"], result["settings"]
    bw, fl = m["peak_bandwidth"], m["peak_flops"]
    bw_text = (f"{bw['gbs']:.0f} GB/s {bw['label']} ({bw['source']}{': ' + bw['note'] if bw.get('note') else ''})"
               if bw["gbs"] else f"unknown ({bw.get('note', '')})")
    fl_text = (f"{fl['tflops']:.2f} TFLOP/s {fl['label']} ({fl['source']}: {fl.get('note', '')})" if fl["tflops"]
               else f"unknown ({fl.get('note', '')})")
    lines = [f"machine: {m['chip']} | {m['platform']} | {m['backend']} on {m['device']} | {m['date']}",
             f"decode roofline: {bw_text}", f"prefill roofline: {fl_text}",
             "% roofline: tg = bytes per decode step (weights once + each sequence's KV) x steps/s / peak bandwidth; "
             "pp = 2 x parameters x tokens/s / peak FLOP/s"]
    skipped = settings.get("skipped_contexts") or []
    if skipped:
        lines.append(f"skipped: --context {','.join(map(str, skipped))} (beyond the model's "
                     f"{result['model'].get('context_length', '?')}-token context)")
    return lines


RIGHT = {3, 5, 6, 7}


def _widths(result: dict[str, Any]) -> list[int]:
    """Column widths from the settings alone (every point's label is known before the first is measured), so
    that rows printed as they finish line up."""
    s = result["settings"]
    first = table_rows({**result, "rows": [{"batch": 1, "context": 0, "pp": {"mean": 0, "stddev": 0},
                                             "tg": {"mean": 0, "stddev": 0}, "peak_memory_bytes": 0}]})[0]
    tests = [f"{t}{n}{f' @ d{d}' if d else ''}" for t, n in (("pp", s["prompt_tokens"]), ("tg", s["gen_tokens"]))
             for d in s["contexts"]]
    cells = [len(first[0]), len(first[1]), len(first[2]), max(len(str(b)) for b in s["batches"]),
             max(map(len, tests)), len("1234.56 ± 123.45"), len("100.0%"), len("1234 MiB")]
    return [max(c, len(h)) for c, h in zip(cells, HEADER)]


def text_lines(result: dict[str, Any]) -> list[str]:
    """The text table as lines: the rooflines and header first, then two rows per finished point."""
    widths = _widths(result)

    def line(r: tuple[str, ...]) -> str:
        return "  ".join(c.rjust(w) if i in RIGHT else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))

    return [*roofline_lines(result), "", line(HEADER), "  ".join("-" * w for w in widths),
            *map(line, table_rows(result))]


def markdown_lines(result: dict[str, Any]) -> list[str]:
    return [*(f"{x}  " for x in roofline_lines(result)), "", "| " + " | ".join(HEADER) + " |",
            "| " + " | ".join("---:" if i in RIGHT else "---" for i in range(len(HEADER))) + " |",
            *("| " + " | ".join(r) + " |" for r in table_rows(result))]


def distributed_lines(result: dict[str, Any]) -> list[str]:
    d = result.get("distributed")
    if not d:
        return []
    link = d["link"]
    lines = [f"{d['mode']} parallel over {len(d['ranks'])} ranks; link to rank 1: "
             f"{link['bandwidth_bytes_s'] * 8 / 1e9:.2f} Gbit/s, {link['latency_s'] * 1e6:.0f} us one way (measured)"]
    lines += [f"rank {r['rank']}: layers {r['layers'][0]}-{r['layers'][1] - 1}, {r['kv_heads']} KV heads: weights "
              f"{r['weight_bytes'] / 2**20:.0f} MiB, KV {r['kv_budget_bytes'] / 2**20:.0f} MiB budget"
              for r in d["ranks"]]
    lines += [f"link roof at batch {x['batch']}: {x['bytes_per_token']:,.0f} bytes/token -> "
              f"{x['bandwidth_roof_tps']:,.0f} tok/s by bandwidth, {x['latency_roof_tps']:,.0f} with latency"
              for x in d["link_roof"]]
    return lines


def text(result: dict[str, Any]) -> str:
    return "\n".join(text_lines(result))


def markdown(result: dict[str, Any]) -> str:
    return "\n".join(markdown_lines(result))
