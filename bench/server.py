"""Load test: N concurrent streaming clients against `roofline serve` and `mlx_lm.server`, same weights, one run.

    uv run python bench/server.py [--model M] [--clients 1,4,8,16] [--requests-per-client 2] [--max-tokens 16]
                                  [--cost-curve 1,2,4,8,16] [--only roofline|roofline-torch|mlx-lm] [--quick]
                                  [--torch [--torch-device cpu|cuda]]
                                  [--random-family phi3|qwen3_moe [--hidden 512] [--layers 8]]

Both servers run as subprocesses on loopback, one after the other, on the weights Roofline loads (the embedded
SmolLM2 Q4_1 GGUF by default): mlx-lm cannot read GGUF, so the bench writes our loaded, renamed tensors
(4-bit affine, group 32, as MLX quantized them; per-layer bits inferred by mlx-lm) with config.json and the
tokenizer into a temporary mlx-lm folder. Every client sends `requests-per-client` streaming chat requests one
after the other (greedy, max_tokens, a prompt of its own); a level's aggregate tokens/s is all completion tokens
over the level's wall time; TTFT is request sent -> first content chunk, as the client sees it.

`--cost-curve` also times one batched decode forward of mlx-lm's llama class on these weights at widths B
(context 64 per row), and our engine's forward of B tokens as `roofline serve` runs it (on MLX's CPU backend
with float32 host weights, `mlx_engine/backends/mlx/host_blas.py`): T(B)/T(1) bounds what batching can give on each
(aggregate speedup <= B / (T(B)/T(1))).

`--random-family` serves a random checkpoint of an mlx-lm family that the engine runs through its adapter
(`mlx_engine.models.adapter`) instead of --model, with SmolLM2's tokenizer; mlx_lm.server reads the same folder
(phi3 only).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TOPICS = ["a dragon", "the sea", "a lighthouse keeper", "a robot", "the moon", "a small village", "a lost key",
          "a storm", "an old library", "a mountain pass", "a clockmaker", "a desert", "a garden", "a train",
          "a violin", "a fox"]


# ---- the mlx-lm folder ------------------------------------------------------------------------------------


def export_mlx_lm_folder(model: str | None, out: Path) -> dict:
    """Writes config.json, model.safetensors, tokenizer.json and tokenizer_config.json for mlx_lm.server from the
    weights our engine loaded. Returns facts for the report."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from mlx_engine import Engine

    engine = Engine.load(model)
    runner = engine.diagnostics().runner
    tok = engine.tokenizer
    a = runner.model.args

    def write() -> dict:
        params = dict(tree_flatten(runner.model.parameters()))
        mx.save_safetensors(str(out / "model.safetensors"), params, metadata={"format": "mlx"})
        bits = sorted({m.bits for _, m in runner.model.named_modules() if hasattr(m, "bits")})
        return {"bits": bits, "dtype": str(next(iter(params.values())).dtype)}

    facts = engine.diagnostics().call(write)
    config = {
        "model_type": "llama", "hidden_size": a.hidden_size, "num_hidden_layers": a.num_hidden_layers,
        "intermediate_size": a.intermediate_size, "num_attention_heads": a.num_attention_heads,
        "rms_norm_eps": a.rms_norm_eps, "vocab_size": a.vocab_size, "head_dim": a.head_dim,
        "max_position_embeddings": a.max_position_embeddings, "num_key_value_heads": a.num_key_value_heads,
        "rope_theta": a.rope_theta, "rope_scaling": a.rope_scaling, "tie_word_embeddings": a.tie_word_embeddings,
        "quantization": {"group_size": 32, "bits": 4},  # the default; mlx-lm infers each layer's own from its tensors
        "eos_token_id": list(tok.eos_token_ids), "bos_token_id": tok.bos_token_id,
    }
    (out / "config.json").write_text(json.dumps(config, indent=1))
    write_tokenizer(tok, out, engine.info.context_length)
    facts.update(name=engine.info.name, quantization=engine.info.quantization, act_dtype=engine.info.dtype)
    engine.close()
    return facts


def write_tokenizer(tok, out: Path, context_length: int) -> None:
    """tokenizer.json and tokenizer_config.json (chat template, special tokens) of our `Tokenizer` in `out`."""
    tok.backend.save(str(out / "tokenizer.json"))
    piece = tok.backend.id_to_token
    bos = piece(tok.bos_token_id) if tok.bos_token_id is not None else None
    tcfg = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": tok.chat_template,
            "eos_token": piece(tok.eos_token_ids[0]), "bos_token": bos,
            "model_max_length": context_length, "clean_up_tokenization_spaces": False}
    (out / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=1))


def write_random_folder(family: str, hidden: int, layers: int, out: Path) -> dict:
    """A random checkpoint of an mlx-lm family the engine runs through its adapter (bench/adapter_vs_mlx_lm.py's
    builder) with the embedded SmolLM2's tokenizer and a vocabulary of its size, so the servers get text prompts.
    Returns facts for the report."""
    import mlx.core as mx

    from bench.adapter_vs_mlx_lm import write_checkpoint
    from mlx_engine.loading import load_tokenizer

    tok = load_tokenizer(None)
    config = write_checkpoint(family, hidden, layers, out, vocab_size=tok.vocab_size)
    write_tokenizer(tok, out, config["max_position_embeddings"])
    params = sum(v.size for v in mx.load(str(out / "model.safetensors")).values())
    experts = (f", {config['num_local_experts']} experts, top {config['num_experts_per_tok']}"
               if "num_local_experts" in config else "")
    return {"name": f"random {family} checkpoint (hidden {hidden}, {layers} layers{experts}, "
                    f"{params / 1e6:.1f} M parameters, SmolLM2's tokenizer, vocabulary {tok.vocab_size})",
            "quantization": "float32", "act_dtype": "float32", "bits": []}


def cost_curve(folder: Path, widths: list[int], context: int = 64, repeats: int = 10) -> dict[int, float]:
    """Seconds per batched decode forward (B, 1) over a context of `context` tokens, mlx-lm's llama class."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load

    model, _ = load(str(folder))
    out = {}
    for b in widths:
        cache = make_prompt_cache(model)
        mx.eval(model(mx.zeros((b, context), dtype=mx.int32), cache=cache))
        x = mx.ones((b, 1), dtype=mx.int32)
        times = []
        for _ in range(repeats + 2):
            t = time.perf_counter()
            mx.eval(model(x, cache=cache))
            times.append(time.perf_counter() - t)
            for c in cache:  # stay at the same context length
                c.trim(1)
        out[b] = statistics.median(times[2:])
    return out


# ---- servers --------------------------------------------------------------------------------------------


def engine_cost_curve(model: str | None, widths: list[int], backend: str = "mlx",
                      device: str = "cpu", decode_widths: list[int] = ()) -> tuple[dict[int, float], dict[int, float]]:
    """Our engine on `backend` (MLX: as `roofline serve` runs it, e.g. float32 host weights on the CPU backend;
    torch: on `device`), 64 tokens cached:
    - for `widths`, a forward over B new tokens of one sequence with logits at each: a batched decode step's
      matmul shapes with one sequence's attention (also what a packed prefill of B prompt rows costs);
    - for `decode_widths`, a decode step of B sequences, each reading its own K/V, with greedy sampling
      (`mlx_engine.speculative.timing.time_decode_step`): what B requests decoding together cost the backend."""
    from mlx_engine import Engine
    from mlx_engine.speculative.timing import time_decode_step, time_forward

    engine = Engine.load(model, backend=backend, **({"device": device} if backend == "torch" else {}))
    try:
        diag = engine.diagnostics()
        rows = {b: diag.call(lambda b=b: time_forward(diag.runner, b, context=64, repeats=5)) for b in widths}
        steps = {b: diag.call(lambda b=b: time_decode_step(diag.runner, b, context=64, repeats=5))
                 for b in decode_widths}
        return rows, steps
    finally:
        engine.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Target:
    name: str
    cmd: list[str]
    model: str
    ready_path: str
    extra: dict = field(default_factory=dict)  # request fields beyond the OpenAI ones (ours: ignore_eos)


def start(target: Target, port: int) -> subprocess.Popen:
    proc = subprocess.Popen(target.cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{target.name} exited with {proc.returncode}: {' '.join(target.cmd)}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}{target.ready_path}", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    proc.kill()
    raise SystemExit(f"{target.name} did not come up in 180 s")


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# ---- clients --------------------------------------------------------------------------------------------


@dataclass
class Result:
    ttft_s: float
    tokens: int
    seconds: float
    uncached: int | None = None  # prompt tokens the server computed (prompt - cached), when it reports them


async def one_request(http: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int,
                      extra: dict | None = None) -> Result:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}, **(extra or {})}
    t0 = time.perf_counter()
    ttft, tokens, chunks, uncached = None, None, 0, None
    async with http.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if "error" in obj:
                raise RuntimeError(obj["error"])
            if obj.get("usage"):
                usage = obj["usage"]
                tokens = usage["completion_tokens"]
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
                uncached = usage["prompt_tokens"] - cached if cached is not None else None
            for c in obj.get("choices") or []:
                if (c.get("delta") or {}).get("content"):
                    chunks += 1
                    if ttft is None:
                        ttft = time.perf_counter() - t0
    return Result(ttft if ttft is not None else float("nan"), tokens if tokens is not None else chunks,
                  time.perf_counter() - t0, uncached)


async def level(url: str, model: str, clients: int, per_client: int, max_tokens: int,
                extra: dict | None = None) -> tuple[list[Result], float]:
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:

        async def client(c: int) -> list[Result]:
            out = []
            for i in range(per_client):
                prompt = f"Write a long story about {TOPICS[c % len(TOPICS)]} (part {i + 1}, client {c})."
                out.append(await one_request(http, url, model, prompt, max_tokens, extra))
            return out

        t0 = time.perf_counter()
        results = await asyncio.gather(*(client(c) for c in range(clients)))
        wall = time.perf_counter() - t0
    return [r for rs in results for r in rs], wall


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def run_target(target: Target, port: int, widths: list[int], per_client: int, max_tokens: int) -> dict[int, dict]:
    proc = start(target, port)
    url = f"http://127.0.0.1:{port}"
    try:
        asyncio.run(level(url, target.model, 2, 1, 4, target.extra))  # warm-up: first forward passes, both batch paths
        rows = {}
        for n in widths:
            try:
                results, wall = asyncio.run(level(url, target.model, n, per_client, max_tokens, target.extra))
            except (httpx.HTTPError, RuntimeError) as e:  # a server that fails a level is a result too
                rows[n] = {"error": f"{type(e).__name__}: {e}"[:200], "alive": proc.poll() is None}
                print(f"  {target.name:9s} {n:2d} clients: FAILED {rows[n]['error']} (server "
                      f"{'still up' if rows[n]['alive'] else 'exited'})", file=sys.stderr, flush=True)
                continue
            tokens = sum(r.tokens for r in results)
            ttfts = [r.ttft_s for r in results]
            rows[n] = {"requests": len(results), "tokens": tokens, "wall_s": wall, "tok_s": tokens / wall,
                       "ttft_p50": pct(ttfts, 0.5), "ttft_p99": pct(ttfts, 0.99)}
            if all(r.uncached is not None for r in results):
                rows[n]["uncached_prompt_mean"] = statistics.mean(r.uncached for r in results)
            print(f"  {target.name:9s} {n:2d} clients: {tokens} tok in {wall:.1f} s = {tokens / wall:.1f} tok/s, "
                  f"TTFT p50 {rows[n]['ttft_p50']:.2f} s p99 {rows[n]['ttft_p99']:.2f} s", file=sys.stderr, flush=True)
        return rows
    finally:
        stop(proc)


def print_curve(title: str, curve: dict[int, float], t1: float) -> None:
    print(f"\n{title}:\n")
    print("| B | T(B) ms | T(B)/T(1) | bound on aggregate speedup B/(T(B)/T(1)) |")
    print("|---:|---:|---:|---:|")
    for b, t in curve.items():
        print(f"| {b} | {t * 1000:.1f} | {t / t1:.2f} | {b * t1 / t:.2f}x |")


def prefill_widths(rows: dict[int, dict]) -> dict[int, int]:
    """Per level n: the rows of one packed prefill of all n clients' uncached prompt tokens."""
    return {n: max(1, round(n * r["uncached_prompt_mean"])) for n, r in rows.items() if "uncached_prompt_mean" in r}


def print_bounds(name: str, rows: dict[int, dict], curve: dict[int, float], per_client: int, max_tokens: int,
                 prefill_curve: dict[int, float] | None = None) -> None:
    """Measured aggregate tok/s against bounds from the cost curve:
    - decode only: a single client's tok/s times B / (T(B)/T(1)). It scales the single client's prefill
      by the decode batching factor too, so it overstates what prefill can give on a compute-bound backend;
    - ideal schedule (with the prefill curve): every wave of n requests starts together, one forward over
      all n prompts' uncached tokens (n * P rows), then max_tokens - 1 decode steps of n rows:
      wall >= per_client * (T(n * P) + (max_tokens - 1) * T(n)), both T measured on the engine."""
    one = rows.get(1)
    if not one or "tok_s" not in one or 1 not in curve:
        return
    widths = prefill_widths(rows) if prefill_curve else {}
    print(f"\n{name} against its cost curve:\n")
    print("| clients | measured tok/s | decode-only bound | of it | uncached prompt tokens | ideal schedule "
          "| of it |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for n, r in rows.items():
        if n not in curve or "tok_s" not in r:
            continue
        decode_only = one["tok_s"] * n * curve[1] / curve[n]
        ideal = "- | - | -"
        if n in widths and widths[n] in prefill_curve:
            wall = per_client * (prefill_curve[widths[n]] + (max_tokens - 1) * curve[n])
            bound = r["tokens"] / wall
            ideal = f"{r['uncached_prompt_mean']:.1f} | {bound:.1f} | {100 * r['tok_s'] / bound:.0f}%"
        print(f"| {n} | {r['tok_s']:.1f} | {decode_only:.1f} | {100 * r['tok_s'] / decode_only:.0f}% | {ideal} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="model for both servers (default: the embedded SmolLM2)")
    p.add_argument("--random-family", choices=("phi3", "qwen3_moe"),
                   help="instead of --model: a random checkpoint of this mlx-lm family (the engine's adapter), "
                        "SmolLM2's tokenizer; our servers' replies run to max_tokens (ignore_eos)")
    p.add_argument("--hidden", type=int, default=512, help="--random-family's hidden size (default 512)")
    p.add_argument("--layers", type=int, default=8, help="--random-family's layers (default 8)")
    p.add_argument("--clients", default="1,4,8,16")
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--cost-curve", default="1,2,4,8,16", help="batch widths to time ('' to skip)")
    p.add_argument("--only", choices=("roofline", "roofline-torch", "mlx-lm"))
    p.add_argument("--quick", action="store_true", help="1 and 4 clients, 1 request each, 8 tokens")
    p.add_argument("--torch", action="store_true",
                   help="also `roofline serve --backend torch` (a third server, its own cost curve)")
    p.add_argument("--torch-device", choices=("cpu", "cuda"), default="cpu",
                   help="the torch server's device (default cpu; cuda on a GPU machine, bench/device_check.sh server)")
    args = p.parse_args()
    if args.quick:
        args.clients, args.requests_per_client, args.max_tokens, args.cost_curve = "1,4", 1, 8, "1,4"
    widths = [int(x) for x in args.clients.split(",")]
    curve_widths = [int(x) for x in args.cost_curve.split(",") if x]

    if args.random_family and args.model:
        p.error("--random-family builds its own checkpoint: drop --model")
    if args.random_family == "qwen3_moe" and args.only not in ("roofline", "roofline-torch"):
        # its config is in transformers 5's form (rope_parameters, num_local_experts), which mlx-lm 0.32's loader
        # rejects; our loader normalizes it
        p.error("--random-family qwen3_moe: mlx-lm cannot load this folder; add --only roofline")
    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="roofline-mlx-lm-") as tmp:
        folder = Path(tmp)
        if args.random_family:  # both servers read the same folder
            facts = write_random_folder(args.random_family, args.hidden, args.layers, folder)
            args.model = str(folder)
        else:
            facts = export_mlx_lm_folder(args.model, folder)
        def runs(name: str) -> bool:
            return args.only in (None, name) and (name != "roofline-torch" or args.torch)

        curve = cost_curve(folder, curve_widths) if curve_widths and runs("mlx-lm") else {}
        ours_curve, ours_steps = (engine_cost_curve(args.model, curve_widths, decode_widths=curve_widths)
                                  if curve_widths and runs("roofline") else ({}, {}))
        torch_curve, torch_steps = (engine_cost_curve(args.model, curve_widths, "torch", args.torch_device,
                                                      decode_widths=curve_widths)
                                    if curve_widths and runs("roofline-torch") else ({}, {}))
        port = free_port()
        ours = {"ignore_eos": True} if args.random_family else {}  # random weights: EOS at random
        targets = [
            Target("roofline", [sys.executable, "-m", "app.cli", "serve", "--port", str(port), "--log-level",
                                "warning", "--max-concurrency", str(max(widths)), "--backend", "mlx"]
                   + (["--model", args.model] if args.model else []), "default", "/health", ours),
            *([Target("roofline-torch", [sys.executable, "-m", "app.cli", "serve", "--port", str(port), "--log-level",
                                         "warning", "--max-concurrency", str(max(widths)), "--backend", "torch",
                                         "--device", args.torch_device]
                      + (["--model", args.model] if args.model else []),
                      "default", "/health", ours)] if args.torch else []),
            Target("mlx-lm", [sys.executable, "-m", "mlx_lm.server", "--model", str(folder), "--port", str(port),
                              "--log-level", "WARNING"], "default_model", "/v1/models"),
        ]
        results = {}
        for t in targets:
            if not runs(t.name):
                continue
            results[t.name] = run_target(t, port, widths, args.requests_per_client, args.max_tokens)
        # each engine's forward over one packed prefill of every client's uncached prompt tokens
        prefill_curves = {name: engine_cost_curve(args.model, sorted(set(prefill_widths(results[name]).values())),
                                                  backend, args.torch_device)[0]
                          for name, backend in (("roofline", "mlx"), ("roofline-torch", "torch"))
                          if curve_widths and name in results}

    import mlx.core as mx
    import mlx_lm

    cpu = subprocess.run(["sh", "-c", "lscpu | grep 'Model name' | sed 's/.*: *//'"], capture_output=True,
                         text=True).stdout.strip() or platform.processor()
    dev = "Metal" if mx.metal.is_available() else "CPU"
    cmd = "uv run python bench/server.py " + " ".join(sys.argv[1:])
    print(f"## Server under load: roofline serve vs mlx_lm.server ({datetime.date.today()})\n")
    print(f"- command: `{cmd.strip()}`")
    print(f"- machine: {platform.system()} {platform.machine()}, {cpu}, {os.cpu_count()} cores, MLX {mx.__version__} "
          f"on {dev}; mlx-lm {mlx_lm.__version__}; load average {load0[0]:.2f} at the start, "
          f"{os.getloadavg()[0]:.2f} at the end (1 minute)")
    if args.random_family:
        print(f"- model: {facts['name']}, through the engine's adapter (mlx-lm's class on our paged KV); "
              f"mlx_lm.server, when run, reads the same folder (phi3 only); activations {facts['act_dtype']}")
    else:
        print(f"- model: {facts['name']} ({facts['quantization']}); mlx-lm gets the same tensors as an MLX-quantized "
              f"folder (affine, group 32, bits {facts['bits']}), activations {facts['act_dtype']} on both")
    print(f"- workload: each client sends {args.requests_per_client} streaming chat requests in turn (its own prompt, "
          f"greedy, max_tokens {args.max_tokens}); loopback; servers run one after the other\n")
    names = list(results)
    head = "| clients | " + " | ".join(f"{n} tok/s | {n} TTFT p50 / p99 (s)" for n in names)
    both = "roofline" in results and "mlx-lm" in results
    if both:
        head += " | roofline / mlx-lm tok/s"
    print(head + " |")
    print("|---:|" + "---:|---:|" * len(names) + ("---:|" if both else ""))
    def cell(r: dict) -> str:
        if "error" in r:
            return f"failed ({r['error'].split(':')[0]}) | -"
        return f"{r['tok_s']:.1f} | {r['ttft_p50']:.2f} / {r['ttft_p99']:.2f}"

    for n in widths:
        cells = [cell(results[t][n]) for t in names]
        ok = both and all("tok_s" in results[t][n] for t in ("roofline", "mlx-lm"))
        ratio = f" | {results['roofline'][n]['tok_s'] / results['mlx-lm'][n]['tok_s']:.2f}x" if ok else (
            " | -" if both else "")
        print(f"| {n} | " + " | ".join(cells) + ratio + " |")
    for title, c in (("Batched decode forward cost on this backend (mlx-lm llama class, these weights, context 64)",
                      curve),
                     ("Roofline's MLX engine forward cost, as `roofline serve` runs it (B tokens with logits at "
                      "each, 64 cached)", ours_curve),
                     (f"The torch backend's batched forward cost (B tokens with logits at each, 64 cached; "
                      f"{args.torch_device})", torch_curve),
                     ("Roofline's MLX engine, a decode step of B sequences (64 tokens cached each, greedy sampling)",
                      ours_steps),
                     (f"The torch backend, a decode step of B sequences (64 tokens cached each, greedy sampling; "
                      f"{args.torch_device})", torch_steps)):
        if c:
            print_curve(title, c, c[curve_widths[0]])
    # the decode term of each bound: our engines' decode step of B sequences; mlx-lm's: its class's forward
    for name, c in (("roofline", ours_steps), ("roofline-torch", torch_steps), ("mlx-lm", curve)):
        if c and name in results:
            print_bounds(name, results[name], c, args.requests_per_client, args.max_tokens, prefill_curves.get(name))
    print("\n<!-- " + json.dumps({"results": results, "cost_curve": curve, "roofline_cost_curve": ours_curve,
                                  "torch_cost_curve": torch_curve, "roofline_decode_steps": ours_steps,
                                  "torch_decode_steps": torch_steps, "prefill_curves": prefill_curves}) + " -->")


if __name__ == "__main__":
    main()
