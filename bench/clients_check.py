"""Third-party clients against a live `roofline serve`: which clients and modes work, agent loops included.

The clients are not the project's dependencies: they live in a venv of their own, from PyPI:

    uv venv /work/venvs/clients --python 3.11
    uv pip install --python /work/venvs/clients/bin/python openai llm litellm langchain-openai \\
        "pydantic-ai-slim[openai]" instructor
    uv run python bench/clients_check.py [--clients-python /work/venvs/clients/bin/python] [--write]

It starts `roofline serve` on 127.0.0.1 (a free port, the embedded SmolLM2 unless --model), runs each case of
bench/clients_cases.py in that venv's Python (one process per case: plain chat, streaming, tool calling as agent
loops, structured output), prints a table, and with --write puts it in docs/benchmarks/clients.md (in place of the
section of the same heading, or at the end); docs/benchmarks.md's summary is updated by hand. A row says
whether the protocol worked and the loop ended; a 135M model's answers are often wrong, and the table says so
rather than hiding it. Clients' phone-home is switched off (litellm's cost map); all traffic is loopback.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CASES = ROOT / "bench" / "clients_cases.py"
BENCHMARKS = ROOT / "docs" / "benchmarks" / "clients.md"  # the history; the summary is by hand
HEADING = "## Third-party clients against `roofline serve` (issue 26)"
PACKAGES = {"openai": "openai", "llm": "llm", "litellm": "litellm", "langchain": "langchain-openai",
            "pydantic_ai": "pydantic-ai-slim", "instructor": "instructor"}
MODES = {
    "chat": "chat", "stream": "chat, streamed", "tools_loop": "agent loop: tool call, result, answer",
    "parse": "`chat.completions.parse` (pydantic)", "responses_loop": "Responses API agent loop",
    "functions": "`--functions` agent loop", "structured": "structured output (json_schema)",
    "tool_agent": "Agent with a tool (loop)", "output_type": "Agent with a pydantic output_type", "json_schema": "Mode.JSON_SCHEMA", "tools": "Mode.TOOLS",
}
# What a client may read from its environment: no keys of ours, no proxies, and no calls home.
CLIENT_ENV = {"OPENAI_API_KEY": "unused", "LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_TELEMETRY": "False",
              "DO_NOT_TRACK": "1", "LANGCHAIN_TRACING_V2": "false", "HF_HUB_OFFLINE": "1", "NO_PROXY": "*"}


def start_server(model: str | None, root: Path = ROOT) -> tuple[subprocess.Popen, str]:
    """`roofline serve` from the checkout at `root` (its own app/ and mlx_engine/, this venv's packages)."""
    cmd = [sys.executable, "-m", "app.cli", "serve", "--port", "0", "--log-level", "warning"]
    if model:
        cmd += ["--model", model]
    proc = subprocess.Popen(cmd, cwd=root, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(root)})
    assert proc.stderr is not None
    line = proc.stderr.readline()
    while line.startswith("roofline: warning:"):  # backend="auto" may say first how to get the torch backend
        line = proc.stderr.readline()
    m = re.search(r"on (http://127\.0\.0\.1:\d+)/v1", line)
    if not m:
        proc.kill()
        sys.exit(f"roofline serve did not start: {line.strip() or proc.stderr.read()}")
    threading.Thread(target=proc.stderr.read, daemon=True).start()  # keep its pipe from filling
    return proc, m.group(1) + "/v1"


def client_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower() and not k.startswith("ROOFLINE_")}
    return {**env, **CLIENT_ENV}


def versions(python: str) -> dict[str, str]:
    code = ("import importlib.metadata as m, json, sys; "
            f"print(json.dumps({{p: m.version(p) for p in {sorted(set(PACKAGES.values()))!r}}}))")
    r = subprocess.run([python, "-c", code], capture_output=True, text=True, env=client_env(), timeout=120)
    if r.returncode != 0:
        sys.exit(f"{python}: cannot read the clients' versions ({r.stderr.strip().splitlines()[-1:]}); install "
                 "them as this script's docstring says")
    return json.loads(r.stdout)


def case_names(python: str) -> list[str]:
    r = subprocess.run([python, str(CASES), "--list"], capture_output=True, text=True, env=client_env(), timeout=120)
    if r.returncode != 0:
        sys.exit(f"{CASES}: cannot list its cases ({r.stderr.strip()[-200:]})")
    return r.stdout.split()


def run_case(python: str, base: str, case: str, timeout_s: float) -> dict:
    t0 = time.perf_counter()
    try:
        r = subprocess.run([python, str(CASES), "--base-url", base, "--case", case], capture_output=True, text=True,
                           env=client_env(), timeout=timeout_s)
        lines = [line for line in r.stdout.splitlines() if line.startswith("{")]
        out = json.loads(lines[-1]) if lines else {"ok": False, "requests": None, "detail":
                                                   (r.stderr.strip().splitlines() or ["no output"])[-1][:160]}
    except subprocess.TimeoutExpired:
        out = {"ok": False, "requests": None, "detail": f"no end after {timeout_s:g} s"}
    out["seconds"] = time.perf_counter() - t0
    return out


def table(rows: list[tuple[str, dict]], vers: dict[str, str], before: dict[str, dict] | None) -> str:
    head = "| client | mode | works |" + (" before |" if before else "") + " model requests | what came back | s |"
    lines = [head, "|---|---|---|" + ("---|" if before else "") + "---:|---|---:|"]
    for case, out in rows:
        client, mode = case.split(".", 1)
        package = PACKAGES[client]
        detail = out["detail"].replace("|", "\\|")
        was = ""
        if before:
            old = before.get(case)
            why = "" if old is None or old["ok"] else old["detail"].replace("|", "/")
            why = why if len(why) <= 70 else why[:67] + "..."
            was = " |" if old is None else f" {'yes' if old['ok'] else 'no: ' + why} |"
        lines.append(f"| {package} {vers.get(package, '?')} | {MODES.get(mode, mode)} | "
                     f"{'yes' if out['ok'] else '**no**'} |{was} {out['requests'] if out['requests'] is not None else ''}"
                     f" | {detail} | {out['seconds']:.1f} |")
    return "\n".join(lines)


def run_all(python: str, model: str | None, root: Path, cases: list[str], timeout_s: float) -> list[tuple[str, dict]]:
    proc, base = start_server(model, root)
    rows = []
    try:
        for case in cases:
            out = run_case(python, base, case, timeout_s)
            rows.append((case, out))
            print(f"{case:24} {'ok ' if out['ok'] else 'FAIL'} {out['seconds']:6.1f} s  {out['detail']}", flush=True)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    return rows


def commit_of(root: Path) -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                          text=True).stdout.strip()


def write_section(text: str) -> None:
    doc = BENCHMARKS.read_text()
    at = doc.find(HEADING)
    if at >= 0:
        nxt = doc.find("\n## ", at + len(HEADING))
        doc = doc[:at].rstrip("\n") + "\n\n" + text + ("\n" + doc[nxt:] if nxt >= 0 else "\n")
    else:
        doc = doc.rstrip("\n") + "\n\n" + text + "\n"
    BENCHMARKS.write_text(doc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients-python", default="/work/venvs/clients/bin/python",
                    help="the Python of the venv holding the clients (default /work/venvs/clients/bin/python)")
    ap.add_argument("--model", help="the model to serve (default: the embedded SmolLM2)")
    ap.add_argument("--case", action="append", help="run only these cases (repeatable; default: all)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds a case may take (default 300)")
    ap.add_argument("--baseline", type=Path, help="also run every case against the server of this checkout (an "
                    "older commit's worktree), for a 'before' column")
    ap.add_argument("--write", action="store_true", help=f"put the table in {BENCHMARKS.relative_to(ROOT)}")
    args = ap.parse_args()
    python = args.clients_python
    if not Path(python).exists():
        sys.exit(f"--clients-python {python}: not found; make the clients' venv as this script's docstring says")
    vers = versions(python)
    cases = args.case or case_names(python)
    before = None
    if args.baseline is not None:
        print(f"-- the server of {args.baseline} ({commit_of(args.baseline)})")
        before = dict(run_all(python, args.model, args.baseline, cases, args.timeout))
        print(f"-- the server of {ROOT} ({commit_of(ROOT)})")
    rows = run_all(python, args.model, ROOT, cases, args.timeout)
    commit = commit_of(ROOT)
    load = os.getloadavg()[0]
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    command = " ".join(["uv run python bench/clients_check.py", *(a for a in sys.argv[1:])])
    works = sum(out["ok"] for _, out in rows)
    section = "\n".join([
        HEADING, "",
        f"{works} of {len(rows)} client modes work against `roofline serve` on the embedded SmolLM2-135M "
        f"({datetime.date.today().isoformat()}, commit {commit}, {cpu or platform.machine()}, {os.cpu_count()} "
        f"cores, load {load:.1f} at the end: the seconds are noisy). Command: `{command}`, with the clients in their "
        "own venv (the script's docstring). "
        "Every request at temperature 0; an agent loop gets at most 5 model requests. \"works\" means the client "
        "parsed what came back, streams ended, and a loop ended with an answer: the 135M model's answers themselves "
        "are often wrong, and the last column shows them as they came."
        + (f" \"before\": the same cases against the server of commit {commit_of(args.baseline)}, run just before."
           if args.baseline is not None else ""), "",
        table(rows, vers, before),
    ])
    print("\n" + section)
    if args.write:
        write_section(section)
        print(f"\nwritten to {BENCHMARKS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
