"""The always-on server: switching models, memory after an unload, and CPU while idle, `roofline serve` against
`mlx_lm.server` (which also loads the model a request names, one at a time, and never unloads), in one run.

Both serve two models: the embedded SmolLM2 written as an MLX-quantized folder by `roofline convert` (4-bit, groups
of 64: what mlx-lm and Roofline both read), and a copy of it under another name, so that each switch is a real load.
Each server runs as a subprocess on loopback, one after the other. Measured, per server:

- time to first token (streaming /v1/completions, greedy, 8 tokens) of a request for the model already loaded, and
  of one for the other model (a switch: the loaded one goes, the other loads), alternating, `--rounds` of each;
- memory: the process's RSS (from /proc) with nothing loaded, with one model loaded, and after it is unloaded
  (roofline: a request's keep_alive 0; its /metrics adds MLX's active and cache memory); mlx-lm keeps its model;
- CPU while idle: the process's user + system time over `--idle-seconds` after the last request, two models loaded
  on roofline (`--max-models 2`), mlx-lm's one.

    uv run python bench/server_models.py --rounds 3 --idle-seconds 60
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.server import free_port  # noqa: E402

PROMPT = "The quick brown fox jumps over the lazy dog. Tell me a story about it"
TICKS = os.sysconf("SC_CLK_TCK")


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime


def start(cmd: list[str], port: int) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        if proc.poll() is not None:
            raise SystemExit(f"{cmd[:4]} exited with {proc.returncode}")
        time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"{cmd[:4]} did not come up")


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


def ttft(port: int, model: str, **extra: object) -> float:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "stream": True, **extra}
    t0 = time.perf_counter()
    first = None
    with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=600) as r:
        if r.status_code != 200:
            raise SystemExit(f"{model}: {r.status_code} {r.read()[:300]!r}")
        for line in r.iter_lines():
            if first is None and line.startswith("data: {") and json.loads(line[6:])["choices"][0].get("text"):
                first = time.perf_counter() - t0
    assert first is not None, f"{model}: no token came"
    return first


def roofline_metrics(port: int) -> dict[str, int]:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    out = {}
    for line in text.splitlines():
        if line.startswith("roofline_memory_bytes{"):
            kind = line.split('"')[1]
            out[kind] = int(float(line.rsplit(" ", 1)[1]))
        elif line.startswith("roofline_models_loaded "):
            out["models"] = int(line.split()[1])
    return out


def switching(port: int, names: tuple[str, str], rounds: int) -> tuple[list[float], list[float]]:
    """TTFTs of resident requests and of switches, alternating: a (load), a, then b (switch), b, a (switch), a..."""
    a, b = names
    ttft(port, a)  # the first load (nothing to unload) and any warm-up
    resident, switched = [ttft(port, a)], []
    for _ in range(rounds):
        for name in (b, a):
            switched.append(ttft(port, name))
            resident.append(ttft(port, name))
    return resident, switched


def idle_cpu(pid: int, seconds: float) -> float:
    c0, t0 = cpu_seconds(pid), time.monotonic()
    time.sleep(seconds)
    return (cpu_seconds(pid) - c0) / (time.monotonic() - t0) * 100


def mib(n: float) -> str:
    return f"{n / 2**20:.0f} MiB"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="switches each way (default 3)")
    p.add_argument("--idle-seconds", type=float, default=60.0)
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="roofline-switch-"))
    try:
        a, b = tmp / "smol-a", tmp / "smol-b"
        subprocess.run([sys.executable, "-m", "app.cli", "convert", "embedded", "-o", str(a)], cwd=ROOT, check=True,
                       stdout=subprocess.DEVNULL)
        shutil.copytree(a, b)
        results = {}

        port = free_port()
        serve = [sys.executable, "-m", "app.cli", "serve", "--backend", "mlx", "-m", str(a), "-m", str(b),
                 "--port", str(port), "--log-level", "warning"]
        proc = start([*serve, "--max-models", "1", "--keep-alive", "forever"], port)
        try:
            empty = {**roofline_metrics(port), "rss": rss(proc.pid)}
            resident, switched = switching(port, (a.name, b.name), args.rounds)
            loaded = {**roofline_metrics(port), "rss": rss(proc.pid)}
            ttft(port, a.name, keep_alive=0)  # unloaded as it ends
            deadline = time.monotonic() + 60
            while roofline_metrics(port)["models"] and time.monotonic() < deadline:
                time.sleep(0.2)
            after = {**roofline_metrics(port), "rss": rss(proc.pid)}
        finally:
            stop(proc)
        port = free_port()
        proc = start([*serve[:-4], "--port", str(port), "--max-models", "2", "--keep-alive", "forever"], port)
        try:
            ttft(port, a.name)
            ttft(port, b.name)
            assert roofline_metrics(port)["models"] == 2
            time.sleep(2)  # the last request's threads wind down
            cpu = idle_cpu(proc.pid, args.idle_seconds)
        finally:
            stop(proc)
        results["roofline"] = dict(resident=resident, switched=switched, empty=empty, loaded=loaded, after=after,
                                   cpu=cpu)

        port = free_port()
        proc = start([sys.executable, "-m", "mlx_lm.server", "--model", str(a), "--port", str(port),
                      "--log-level", "WARNING"], port)
        try:
            empty = {"rss": rss(proc.pid)}
            resident, switched = switching(port, (str(a), str(b)), args.rounds)
            loaded = {"rss": rss(proc.pid)}
            time.sleep(2)
            cpu = idle_cpu(proc.pid, args.idle_seconds)
            after = {"rss": rss(proc.pid)}  # it never unloads: its model still held after the idle minute
        finally:
            stop(proc)
        results["mlx-lm"] = dict(resident=resident, switched=switched, empty=empty, loaded=loaded, after=after,
                                 cpu=cpu)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    import mlx_lm

    cpu_name = subprocess.run(["sh", "-c", "lscpu | grep 'Model name' | sed 's/.*: *//'"], capture_output=True,
                              text=True).stdout.strip()
    print(f"## Switching models, memory after unload, idle CPU ({datetime.date.today()})\n")
    print(f"- command: `uv run python bench/server_models.py --rounds {args.rounds} --idle-seconds "
          f"{args.idle_seconds:g}`")
    print(f"- machine: {cpu_name}, {os.cpu_count()} cores; mlx-lm {mlx_lm.__version__}; load average "
          f"{os.getloadavg()[0]:.2f} at the end")
    print("- models: the embedded SmolLM2-135M through `roofline convert` (4-bit g64), and a copy of it under another "
          "name\n")
    print("| measure | roofline | mlx-lm | roofline / mlx-lm |")
    print("|---|---:|---:|---:|")
    r, m = results["roofline"], results["mlx-lm"]

    def row(what: str, x: float, y: float, fmt: str = "{:.3f} s") -> None:
        print(f"| {what} | {fmt.format(x)} | {fmt.format(y)} | {x / y:.2f}x |" if y else
              f"| {what} | {fmt.format(x)} | {fmt.format(y)} | - |")

    row("TTFT, model loaded (median)", statistics.median(r["resident"]), statistics.median(m["resident"]))
    row("TTFT, switching model (median)", statistics.median(r["switched"]), statistics.median(m["switched"]))
    print(f"| RSS: nothing loaded / one loaded / after unload | {mib(r['empty']['rss'])} / {mib(r['loaded']['rss'])}"
          f" / {mib(r['after']['rss'])} | {mib(m['empty']['rss'])} / {mib(m['loaded']['rss'])} / "
          f"{mib(m['after']['rss'])} (kept) | {r['after']['rss'] / m['after']['rss']:.2f}x after |")
    print(f"| MLX active / cache after unload | {mib(r['after']['mlx_active'])} / {mib(r['after']['mlx_cache'])} "
          f"(loaded: {mib(r['loaded']['mlx_active'])} / {mib(r['loaded']['mlx_cache'])}) | not exposed | - |")
    row(f"CPU while idle, {args.idle_seconds:g} s (roofline: 2 models loaded)", r["cpu"], m["cpu"], "{:.2f}%")
    print("\nAll TTFTs (s): " + json.dumps({k: {"resident": [round(x, 3) for x in v["resident"]],
                                               "switched": [round(x, 3) for x in v["switched"]]}
                                           for k, v in results.items()}))


if __name__ == "__main__":
    main()
