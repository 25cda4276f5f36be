"""Decode and prefill on the CPU, in one run: Roofline's torch backend (packed int4/int8 weights), Roofline's
MLX CPU backend and llama.cpp (llama-cpp-python), on the same GGUF files at the same thread counts.

    uv run python bench/cpu_vs_llama_cpp.py [--threads 1,2] [--rounds 3] [-p 512] [-n 128] [--model 1b]

Files: the embedded SmolLM2-135M-Instruct Q4_1, and Q4_0, Q8_0 and Q4_K_M requantized from it by llama.cpp's own
quantizer (`llama_model_quantize`, allow_requantize) into --work-dir; a file a runner cannot load is a row
saying so. `--model 1b`: every file quantized by the same quantizer from an F16 GGUF of TinyLlama-1.1B's shape
with SmolLM2's tokenizer and random weights (`synthetic_f16`, 2.3 GB written once into --work-dir), where the
weights, not library code or per-call costs, decide memory and decode; `--runners torch,llama` there (MLX's CPU
rows would hold 4.7 GB of float32 copies). llama.cpp runs in its own venv (never our dependency), built with GGML_NATIVE:

    uv venv /work/venvs/llamacpp && CMAKE_ARGS="-DGGML_NATIVE=ON" \\
        uv pip install --python /work/venvs/llamacpp/bin/python llama-cpp-python gguf numpy

Each (file, runner, threads) is one worker process, loaded once; the rounds run every worker in turn, so that a
burst of load on the machine falls on all of them, and the table gives medians over rounds. llama.cpp is loaded
with use_extra_bufts=False for the main rows (its AMX path crashed on every evaluation of 2 or more tokens on a
Xeon); --extra-bufts adds rows with them (the repacked Q4_0/IQ4 layouts, AMX where the CPU has it). On a Xeon
where a GGML_NATIVE build crashes so even without them (SIGSEGV at any evaluation of 2 or more tokens, 0.3.36),
build the main rows' venv without AMX (GGML_NATIVE=OFF, the AVX-512 options on, GGML_AMX_*=OFF) and pass the
AMX build as --amx-python: its rows (extra buffer types on) evaluate the prompt a token at a time, so that they
give decode only.

Each row: prompt of -p tokens (prefill tok/s), then -n greedy tokens (decode tok/s); the decode's % of the
roofline = bytes a token reads (packed weights and the KV at the mean decode context, as each runner holds
them) x tok/s / the machine's copy bandwidth (`mlx_engine.roofline.measure_bandwidth`); memory = the worker's
peak RSS less its RSS after imports (torch's modules for the torch rows, and its compiler's for the compiled
ones: library code, as llama.cpp's), beside the target 1.3 x the file + the KV pool it allocated, and the code
pages that came in after the imports (resident executable file maps after the last request less the baseline's:
the libraries' code as it first runs; at most that much of the peak, which can come before some of them).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LLAMA_PYTHON = "/work/venvs/llamacpp/bin/python"
RUNNERS = ("torch", "torch-compile", "mlx", "llama")
FTYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q4_K_M": 15, "Q5_K_M": 17}  # llama_ftype: LLAMA_FTYPE_MOSTLY_*
# --model 1b: TinyLlama-1.1B's shape (llama, untied head) with SmolLM2's vocabulary and tokenizer, random weights.
# A model whose file dwarfs the libraries' code and the tokenizer, so that memory and decode read what scales.
SHAPES = {"1b": {"embedding_length": 2048, "block_count": 22, "feed_forward_length": 5632,
                 "attention.head_count": 32, "attention.head_count_kv": 4}}


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_bytes() -> int:
    """This process's peak RSS: VmHWM, its own address space's high-water mark. Not ru_maxrss, which a process
    started by fork + exec inherits from its parent at the fork (this controller's, after measure_bandwidth's
    buffers: every llama.cpp row read 493 MB). The torch runner resets VmHWM when a request starts, so the
    worker keeps the running maximum."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def _code_bytes() -> int:
    """Resident bytes of this process's executable file maps (libraries' and the interpreter's code): pages that
    come in as the code first runs, after the imports' baseline, and stay (clean, shared, dropped under pressure
    and read back from the file)."""
    total, code = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=6)
            if "-" in head[0] and not head[0].endswith(":"):
                code = len(head) > 5 and "x" in head[1] and head[5].startswith("/")
            elif code and head[0] == "Rss:":
                total += int(head[1]) * 1024
    return total


# --- workers: one process each, JSON lines on stdin/stdout ---------------------------------------------


def _serve(load, run) -> None:
    """The worker loop: load, say ready (or why not), then one `run` per request line."""
    out = sys.stdout
    sys.stdout = sys.stderr  # libraries' prints must not corrupt the protocol
    base, base_code = _rss_bytes(), _code_bytes()
    try:
        t = time.perf_counter()
        info = load()
        info.update(ok=True, load_s=time.perf_counter() - t)
    except Exception as e:  # noqa: BLE001 - reported as the row's result
        info = {"ok": False, "error": f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"}
    out.write(json.dumps(info) + "\n")
    out.flush()
    peak = _peak_bytes()  # the load's; the engine sets VmHWM back at each request's start (TorchRunner)
    for line in sys.stdin:
        req = json.loads(line)
        if req.get("cmd") == "exit":
            break
        result = run(req["prompt"], req["gen"])
        peak = max(peak, _peak_bytes())
        result.update(peak_bytes=peak - base, code_bytes=_code_bytes() - base_code)
        out.write(json.dumps(result) + "\n")
        out.flush()


def roofline_worker(path: str, kind: str, threads: int | None, context: int) -> None:
    """`kind`: mlx, torch, or torch-compile (the torch backend with compile=True)."""
    sys.path.insert(0, str(ROOT))
    from mlx_engine import Engine, GenerationRequest, SamplingParams

    state = {}

    def load() -> dict:
        options = {"threads": threads} if backend == "torch" else {}
        if kind == "torch-compile":
            options["compile"] = True
        e = state["engine"] = Engine.load(path, backend=backend, device="cpu", prefix_caching=False,
                                          max_context=context, **options)
        return {"name": e.info.name, "quantization": e.info.quantization, "weight_bytes": e.info.weight_bytes,
                "notes": list(e.info.notes), "warnings": list(e.info.warnings)}

    def run(prompt: list[int], gen: int) -> dict:
        e = state["engine"]
        params = SamplingParams(temperature=0.0, max_tokens=gen, ignore_eos=True)
        final = list(e.generate(GenerationRequest(prompt_token_ids=prompt, sampling=params)))[-1]
        return {"prefill_tps": final.stats.prefill_tps, "decode_tps": final.stats.decode_tps,
                "bytes_per_token": e.decode_bytes_per_token(len(prompt) + gen // 2),
                "kv_bytes": int(e.kv_stats().get("bytes_total") or 0)}

    backend = "mlx" if kind == "mlx" else "torch"
    if backend == "torch":  # torch's libraries (about 270 MB of RSS) before the baseline, as llama.cpp's are,
        import mlx_engine.backends.torch.runner  # noqa: F401
    if kind == "torch-compile":  # and its compiler's (~120 MB), the prefill's halves compiled at load
        import torch._dynamo  # noqa: F401
        import torch._inductor.compile_fx  # noqa: F401
    _serve(load, run)


def llama_worker(path: str, threads: int, context: int, extra_bufts: bool, weights: int, kv_per_token: int,
                 stepwise: bool = False) -> None:
    """`weights`, `kv_per_token`: the file's figures (`llama_figures`), read by the controller: gguf-py's
    GGUFReader here took 155 MB of RSS (the vocabulary as numpy arrays), counted in llama.cpp's peak.
    `stepwise`: the prompt evaluated a token at a time (a build whose evaluations of 2 or more tokens crash)."""
    import llama_cpp
    import numpy as np

    state = {"weights": weights, "kv_per_token": kv_per_token}
    defaults = llama_cpp.llama_model_default_params

    def params():  # Llama() takes its model params from here; use_extra_bufts is not one of its arguments
        p = defaults()
        p.use_extra_bufts = extra_bufts
        return p

    def load() -> dict:
        llama_cpp.llama_model_default_params = params
        # n_batch: the rows of llama-cpp-python's `scores`, which must hold the last position (512 rows failed
        # with an IndexError at -p 512); the physical batch stays 512
        state["llm"] = llama_cpp.Llama(path, n_ctx=context, n_batch=context, n_ubatch=min(512, context),
                                       n_threads=threads, n_threads_batch=threads, verbose=False)
        return {"name": Path(path).name, "quantization": "", "weight_bytes": weights, "notes": [], "warnings": [],
                "system": llama_cpp.llama_print_system_info().decode()}

    def run(prompt: list[int], gen: int) -> dict:
        llm = state["llm"]
        llm.reset()
        t = time.perf_counter()
        for part in ([[tok] for tok in prompt] if stepwise else [prompt]):
            llm.eval(part)
        prefill = time.perf_counter() - t
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        t = time.perf_counter()
        for _ in range(gen - 1):
            llm.eval([tok])
            tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        decode = time.perf_counter() - t
        return {"prefill_tps": len(prompt) / prefill, "decode_tps": (gen - 1) / decode,
                "bytes_per_token": state["weights"] + state["kv_per_token"] * (len(prompt) + gen // 2),
                "kv_bytes": state["kv_per_token"] * context}

    _serve(load, run)


class Worker:
    def __init__(self, label: dict, cmd: list[str]):
        self.label, self.proc = label, subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                                        stderr=subprocess.DEVNULL, text=True, cwd=ROOT)
        self.info: dict | None = None
        self.results: list[dict] = []

    def ready(self) -> dict:
        if self.info is None:
            line = self.proc.stdout.readline()
            self.info = json.loads(line) if line else {"ok": False, "error": "the worker died while loading"}
        return self.info

    def run(self, prompt: list[int], gen: int) -> None:
        if not self.ready().get("ok"):
            return
        self.proc.stdin.write(json.dumps({"cmd": "run", "prompt": prompt, "gen": gen}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            self.info = {"ok": False, "error": f"crashed while running (exit {self.proc.wait()})"}
            return
        self.results.append(json.loads(line))

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"cmd": "exit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()


# --- the controller -----------------------------------------------------------------------------------


def requantize(src: Path, ftype: str, work: Path, llama_python: str) -> Path:
    dst = work / f"{src.stem.rsplit('.', 1)[0]}.{ftype}.gguf"
    if dst.exists():
        return dst
    code = ("import ctypes, sys, llama_cpp\n"
            "p = llama_cpp.llama_model_quantize_default_params()\n"
            f"p.ftype, p.allow_requantize, p.nthread = {FTYPES[ftype]}, True, 2\n"
            "sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(p)))\n")
    r = subprocess.run([llama_python, "-c", code, str(src), str(dst)], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"cpu_vs_llama_cpp: llama.cpp's quantizer failed on {ftype}: {r.stderr[-500:]}")
    return dst


def synthetic_f16(shape: str, work: Path) -> Path:
    """An F16 GGUF of SHAPES[shape] with the embedded file's tokenizer and chat template, weights drawn from
    N(0, 0.02) (norms 1), written by gguf-py; llama.cpp's quantizer makes the bench's files from it."""
    import gguf
    import numpy as np

    from mlx_engine.loading import embedded_model_path

    dst = work / f"synthetic-{shape}.F16.gguf"
    if dst.exists():
        return dst
    dims = SHAPES[shape]
    src = gguf.GGUFReader(str(embedded_model_path()))
    w = gguf.GGUFWriter(str(dst) + ".part", "llama")
    w.add_name(f"synthetic {shape} (random weights)")
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    for key, value in dims.items():
        w.add_uint32(f"llama.{key}", value)
    w.add_uint32("llama.context_length", 8192)
    w.add_uint32("llama.vocab_size", 49152)
    w.add_uint32("llama.rope.dimension_count", dims["embedding_length"] // dims["attention.head_count"])
    w.add_float32("llama.rope.freq_base", 10000.0)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    for key, field in src.fields.items():
        if key.startswith("tokenizer."):
            kind = field.types[0]
            if kind == gguf.GGUFValueType.ARRAY:
                w.add_array(key, field.contents())
            else:
                w.add_key_value(key, field.contents(), kind)
    rng = np.random.default_rng(0)
    d, ff = dims["embedding_length"], dims["feed_forward_length"]
    kv = dims["attention.head_count_kv"] * d // dims["attention.head_count"]

    def normal(rows: int, cols: int) -> np.ndarray:  # (rows, cols) as torch holds a Linear: out x in
        return (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float16)

    w.add_tensor("token_embd.weight", normal(49152, d))
    for i in range(dims["block_count"]):
        for name, (rows, cols) in {"attn_q": (d, d), "attn_k": (kv, d), "attn_v": (kv, d), "attn_output": (d, d),
                                   "ffn_gate": (ff, d), "ffn_up": (ff, d), "ffn_down": (d, ff)}.items():
            w.add_tensor(f"blk.{i}.{name}.weight", normal(rows, cols))
        for name in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{name}.weight", np.ones(d, dtype=np.float32))
    w.add_tensor("output_norm.weight", np.ones(d, dtype=np.float32))
    w.add_tensor("output.weight", normal(49152, d))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    Path(str(dst) + ".part").rename(dst)
    return dst


def llama_figures(path: Path) -> tuple[int, int]:
    """(bytes of the weights llama.cpp reads a token, bytes of its f16 K and V a position) from the file's header."""
    from mlx_engine.loading.gguf_file import read_gguf

    g = read_gguf(path, strings=False)
    names = {t.name for t in g.tensors}
    weights = sum(t.nbytes for t in g.tensors
                  if not (t.name == "token_embd.weight" and "output.weight" in names))  # untied: a row lookup
    arch, m = g.architecture, g.metadata
    heads, kv_heads = int(m[f"{arch}.attention.head_count"]), int(m[f"{arch}.attention.head_count_kv"])
    return weights, 2 * int(m[f"{arch}.block_count"]) * kv_heads * (int(m[f"{arch}.embedding_length"]) // heads) * 2


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def prompt_ids(n: int, vocab: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, vocab) for _ in range(n)]  # no control tokens (the first ids of SmolLM2's vocab)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", default="1,2", help="thread counts, comma-separated (default 1,2)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3): the table's medians")
    ap.add_argument("-p", "--prompt-tokens", type=int, default=512)
    ap.add_argument("-n", "--gen-tokens", type=int, default=128)
    ap.add_argument("--files", default="Q4_1,Q4_0,Q8_0,Q4_K_M", help="which files (default Q4_1,Q4_0,Q8_0,Q4_K_M)")
    ap.add_argument("--model", default="smollm2", choices=("smollm2", *SHAPES),
                    help="smollm2: the embedded file and its requantizations (default); 1b: a TinyLlama-1.1B-shaped "
                         "model of random weights and SmolLM2's tokenizer, every file quantized from its F16")
    ap.add_argument("--runners", default="torch,mlx,llama",
                    help="which runners (default torch,mlx,llama; also torch-compile: the torch backend, compile=True)")
    ap.add_argument("--extra-bufts", action="store_true", help="also llama.cpp with its extra buffer types")
    ap.add_argument("--llama-python", default=LLAMA_PYTHON, help=f"llama-cpp-python's interpreter ({LLAMA_PYTHON})")
    ap.add_argument("--amx-python", help="also a llama.cpp built with AMX, decode only (prompt a token at a time)")
    ap.add_argument("--work-dir", default="/tmp/roofline-cpu-bench", help="where the requantized files go")
    ap.add_argument("--json", metavar="FILE", help="also write every measurement as JSON")
    ap.add_argument("--worker", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        kind, path, threads, context = args.worker[:4]
        if kind == "llama":
            return llama_worker(path, int(threads), int(context), args.worker[4] == "1", int(args.worker[5]),
                                int(args.worker[6]), args.worker[7] == "1")
        return roofline_worker(path, kind, None if threads == "-" else int(threads), int(context))

    sys.path.insert(0, str(ROOT))
    from mlx_engine.loading import embedded_model_path
    from mlx_engine.roofline import measure_bandwidth

    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    threads = [int(t) for t in args.threads.split(",")]
    runners = args.runners.split(",")
    if set(runners) - set(RUNNERS):
        ap.error(f"--runners: {', '.join(sorted(set(runners) - set(RUNNERS)))} is not one of {', '.join(RUNNERS)}")
    unknown = [name for name in args.files.split(",") if name not in FTYPES]
    if unknown:
        ap.error(f"--files: {', '.join(unknown)} is not one of {', '.join(FTYPES)} (Q4_1: the embedded file; the "
                 "others requantized from it)")
    if args.model == "smollm2":
        src = embedded_model_path()
        files = {name: src if name == "Q4_1" else requantize(src, name, work, args.llama_python)
                 for name in args.files.split(",")}
    else:
        f16 = synthetic_f16(args.model, work)
        files = {name: requantize(f16, name, work, args.llama_python) for name in args.files.split(",")}
    context = args.prompt_tokens + args.gen_tokens + 16
    prompts = [prompt_ids(args.prompt_tokens, 49152, seed) for seed in range(args.rounds)]
    started = {"date": time.strftime("%Y-%m-%d %H:%M"), "load_before": load_average(),
               "bandwidth": max(measure_bandwidth() for _ in range(3))}
    rows = []
    for fname, path in files.items():
        me = [sys.executable, str(Path(__file__).resolve()), "--worker"]
        workers = []
        for t in threads:
            for kind, name in (("torch", "roofline torch"), ("torch-compile", "roofline torch, compiled")):
                if kind in runners:
                    workers.append(Worker({"file": fname, "runner": name, "threads": t},
                                          me + [kind, str(path), str(t), str(context)]))
            if "llama" in runners:
                builds = [(args.llama_python, False, "", False)]  # (interpreter, extra bufts, name, stepwise)
                builds += [(args.llama_python, True, " +extra bufts", False)] if args.extra_bufts else []
                builds += [(args.amx_python, True, " AMX, decode only", True)] if args.amx_python else []
                for python, extra, name, stepwise in builds:
                    workers.append(Worker({"file": fname, "runner": "llama.cpp" + name, "threads": t,
                                           "stepwise": stepwise}, [python] + me[1:] + [
                                               "llama", str(path), str(t), str(context), "1" if extra else "0",
                                               *map(str, llama_figures(path)), "1" if stepwise else "0"]))
        if "mlx" in runners:
            workers.append(Worker({"file": fname, "runner": "roofline mlx", "threads": "-"},
                                  me + ["mlx", str(path), "-", str(context)]))
        for w in workers:  # one at a time: a load (torch's compile) must not fall on another's timing
            w.ready()
            print(f"{fname} {w.label['runner']} {w.label['threads']}: "
                  f"{'loaded in %.0f s' % w.info['load_s'] if w.info.get('ok') else w.info.get('error')}",
                  file=sys.stderr)
        for r in range(args.rounds):
            for w in workers[r % len(workers):] + workers[:r % len(workers)]:
                w.run(prompts[r], args.gen_tokens)
        for w in workers:
            w.close()
            rows.append(summarize(w, path, started["bandwidth"]))
    started["load_after"] = load_average()
    print(markdown(rows, started, args))
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": started, "rows": rows}, indent=1) + "\n")


def summarize(w: Worker, path: Path, bandwidth: float) -> dict:
    row = dict(w.label, ok=bool(w.info.get("ok")) and bool(w.results), error=w.info.get("error"),
               notes=w.info.get("notes", []), warnings=w.info.get("warnings", []), runs=w.results)
    if not row["ok"]:
        return row
    med = {k: statistics.median(x[k] for x in w.results) for k in ("prefill_tps", "decode_tps", "bytes_per_token")}
    row.update(med, peak_bytes=max(x["peak_bytes"] for x in w.results), kv_bytes=w.results[-1]["kv_bytes"],
               code_bytes=max(x["code_bytes"] for x in w.results),
               file_bytes=path.stat().st_size, roofline=med["bytes_per_token"] * med["decode_tps"] / bandwidth)
    return row


def markdown(rows: list[dict], machine: dict, args: argparse.Namespace) -> str:
    by = {(r["file"], r["runner"], r["threads"]): r for r in rows}
    out = [f"Machine: {os.uname().machine}, {os.cpu_count()} cores, copy bandwidth {machine['bandwidth'] / 1e9:.1f} GB/s; "
           f"{machine['date']}; load average (1/5/15 min) {machine['load_before']} before, {machine['load_after']} "
           f"after; prompt {args.prompt_tokens} tokens, {args.gen_tokens} decoded, medians of {args.rounds} "
           "interleaved rounds.", "",
           "| file | runner | threads | decode tok/s | x llama.cpp | prefill tok/s | x llama.cpp | decode % roofline "
           "| bytes/token | peak MB (target) | code MB after imports |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if not r["ok"]:
            out.append(f"| {r['file']} | {r['runner']} | {r['threads']} | {r.get('error') or 'no result'} "
                       "| | | | | | | |")
            continue
        peer = by.get((r["file"], "llama.cpp", r["threads"] if r["threads"] != "-" else 1))
        ratio = (lambda k: f"{r[k] / peer[k]:.2f}" if peer and peer["ok"] and peer is not r else "")  # noqa: E731
        target = 1.3 * r["file_bytes"] + r["kv_bytes"]
        prefill = "" if r.get("stepwise") else f"{r['prefill_tps']:.0f}"  # a token at a time: not a prefill
        out.append(f"| {r['file']} | {r['runner']} | {r['threads']} | {r['decode_tps']:.1f} | {ratio('decode_tps')} "
                   f"| {prefill} | {ratio('prefill_tps') if prefill else ''} | {100 * r['roofline']:.0f}% "
                   f"| {r['bytes_per_token'] / 1e6:.0f} MB | {r['peak_bytes'] / 2**20:.0f} ({target / 2**20:.0f}) "
                   f"| {r['code_bytes'] / 2**20:.0f} |")
    notes = sorted({n for r in rows for n in r.get("notes", []) + r.get("warnings", [])})
    if notes:
        out += ["", "Load notes:"] + [f"- {n}" for n in notes]
    return "\n".join(out)


if __name__ == "__main__":
    main()
