"""Agent frameworks against a live `roofline serve` on the embedded SmolLM2-135M (issue 51, "What it must show").

Each framework lives in a venv of its own, from PyPI, never in the project's dependencies:

    for n in openai-agents smolagents pydantic-ai anthropic; do uv venv /tmp/agents-venvs/$n --python 3.11; done
    uv pip install --python /tmp/agents-venvs/openai-agents/bin/python openai-agents
    uv pip install --python /tmp/agents-venvs/smolagents/bin/python "smolagents[openai]"
    uv pip install --python /tmp/agents-venvs/pydantic-ai/bin/python "pydantic-ai-slim[openai]"
    uv pip install --python /tmp/agents-venvs/anthropic/bin/python anthropic
    uv run python bench/agents_check.py [--venvs /tmp/agents-venvs] [--only openai-agents.chat] [--task weather]

It starts `uv run roofline serve --port P` from this checkout (the embedded model: nothing is downloaded), waits for
/health, then runs every framework's scenario on every task: a small script written to a temp file and run by that
framework's venv Python, one process each. Every scenario offers the same two tools, a plain one and one whose
argument is a nested pydantic model:

    get_weather(city: str) -> "18 C, sunny"
    book_table(booking: Booking), Booking(name, time, party: Party(size: int, notes: str))
                              -> "Booked ...; confirmation R-4821"

and asks a fixed question whose answer needs the tool's result ("What is the weather in Paris? Use the tool.",
"Book a table for Ada at 7pm. Use the tool."), at temperature 0 where the framework takes it, with at most
--max-steps model turns. A row records whether the run finished with an answer, the model requests it made (from
the server's /metrics, by route and status, so a 4xx/5xx shows), the tool calls, whether the answer carries the
tool's result ("18" and "sunny" for the weather, "R-4821" for the booking), the wall time, and where it did not finish, the
exact error. The server's own log goes to --server-log for the requests behind an error.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TASKS = {"weather": "What is the weather in Paris? Use the tool.",
         "booking": "Book a table for Ada at 7pm. Use the tool."}
# What of the tool's result an answer carries (none of it is in the question): all of it, part, or none
MARKS = {"weather": ("18", "sunny"), "booking": ("R-4821",)}


def uses_result(task: str, answer: str) -> str:
    found = [m for m in MARKS[task] if m.lower() in answer.lower()]
    return "yes" if found == list(MARKS[task]) else f"partly ({', '.join(found)})" if found else "no"
CLIENT_ENV = {"OPENAI_API_KEY": "unused", "ANTHROPIC_API_KEY": "unused", "DO_NOT_TRACK": "1",
              "OPENAI_AGENTS_DISABLE_TRACING": "1", "HF_HUB_OFFLINE": "1", "NO_PROXY": "*",
              "TOKENIZERS_PARALLELISM": "false"}

# ---- what every scenario script starts with: the tools, the task, the one result line --------------------------

PRELUDE = r'''
import json, sys, time, traceback
from pydantic import BaseModel

BASE, TASK, MAX_STEPS, MAX_TOKENS = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
PROMPT = TASKS[TASK]
CALLS = []
T0 = time.perf_counter()


class Party(BaseModel):
    size: int
    notes: str


class Booking(BaseModel):
    name: str
    time: str
    party: Party


class BookTableArgs(BaseModel):
    booking: Booking


def weather_result(city):
    CALLS.append({"name": "get_weather", "args": {"city": city}})
    return "18 C, sunny"


def booking_result(booking):
    CALLS.append({"name": "book_table", "args": booking})
    party = booking.get("party") or {}
    return (f"Booked a table for {booking.get('name')} at {booking.get('time')}, party of {party.get('size')}; "
            "confirmation R-4821")


def run_tool(name, args):
    """A call as a framework without its own tool objects hands it over: name and JSON arguments."""
    if name == "get_weather":
        return weather_result(args["city"])
    return booking_result(args["booking"])


def inline(schema):
    """A pydantic schema with its $defs written in place (for a framework that puts it under a property)."""
    defs = schema.pop("$defs", {})

    def walk(node):
        if isinstance(node, dict):
            if "$ref" in node:
                return walk(dict(defs[node["$ref"].split("/")[-1]]))
            return {k: walk(v) for k, v in node.items()}
        return [walk(v) for v in node] if isinstance(node, list) else node

    return walk(schema)


def emit(finished, answer=None, error=None, turns=None, note=None):
    print("@@RESULT " + json.dumps({"finished": bool(finished), "answer": answer, "error": error, "turns": turns,
                                    "calls": CALLS, "note": note, "seconds": time.perf_counter() - T0}), flush=True)


def failed(e):
    tb = traceback.extract_tb(e.__traceback__)
    where = f" ({tb[-1].filename.split('site-packages/')[-1]}:{tb[-1].lineno})" if tb else ""
    emit(False, error=f"{type(e).__name__}: {e}{where}")
'''

# ---- the frameworks: one scenario each (VARIANT picks among a framework's models) -----------------------------

OPENAI_AGENTS = r'''
from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner, function_tool,
                    set_tracing_disabled)
from openai import AsyncOpenAI

set_tracing_disabled(True)


@function_tool
def get_weather(city: str) -> str:
    """Current weather in a city."""
    return weather_result(city)


@function_tool
def book_table(booking: Booking) -> str:
    """Book a restaurant table."""
    return booking_result(booking.model_dump())


client = AsyncOpenAI(base_url=BASE, api_key="unused", max_retries=0, timeout=600)
Model = OpenAIChatCompletionsModel if VARIANT == "chat" else OpenAIResponsesModel
agent = Agent(name="assistant", instructions="You are a helpful assistant. Use the tools.",
              tools=[get_weather, book_table], model=Model(model="default", openai_client=client),
              model_settings=ModelSettings(temperature=0, max_tokens=MAX_TOKENS))
try:
    r = Runner.run_sync(agent, PROMPT, max_turns=MAX_STEPS)
    emit(isinstance(r.final_output, str) and bool(r.final_output.strip()), r.final_output, turns=len(r.raw_responses))
except Exception as e:
    failed(e)
'''

SMOLAGENTS = r'''
from smolagents import OpenAIServerModel, Tool, ToolCallingAgent, tool


@tool
def get_weather(city: str) -> str:
    """Current weather in a city.

    Args:
        city: the city's name
    """
    return weather_result(city)


class BookTable(Tool):
    name = "book_table"
    description = "Book a restaurant table."
    schema = inline(Booking.model_json_schema())
    inputs = {"booking": {"type": "object", "description": "The booking: name, time and party",
                          "properties": schema["properties"], "required": schema["required"]}}
    output_type = "string"

    def forward(self, booking):
        return booking_result(booking)


model = OpenAIServerModel(model_id="default", api_base=BASE, api_key="unused", temperature=0, max_tokens=MAX_TOKENS,
                          client_kwargs={"max_retries": 0, "timeout": 600})
agent = ToolCallingAgent(tools=[get_weather, BookTable()], model=model, max_steps=MAX_STEPS, verbosity_level=0)
try:
    r = agent.run(PROMPT, return_full_result=True)
    errors = [f"step {getattr(s, 'step_number', '?')}: {type(s.error).__name__}: {s.error}"
              for s in agent.memory.steps if getattr(s, "error", None) is not None]
    answer = r.output if isinstance(r.output, str) else json.dumps(r.output, default=str)
    emit(r.state == "success" and bool(str(r.output or "").strip()), answer,
         error=None if r.state == "success" else f"state {r.state}", turns=len(agent.memory.steps) - 1,
         note="; ".join(errors)[:600] or None)
except Exception as e:
    failed(e)
'''

PYDANTIC_AI = r'''
from pydantic_ai import Agent, UsageLimits
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider


def get_weather(city: str) -> str:
    """Current weather in a city."""
    return weather_result(city)


def book_table(booking: Booking) -> str:
    """Book a restaurant table."""
    return booking_result(booking.model_dump())


model = OpenAIChatModel("default", provider=OpenAIProvider(base_url=BASE, api_key="unused"))
agent = Agent(model, tools=[get_weather, book_table], instructions="You are a helpful assistant. Use the tools.",
              model_settings={"temperature": 0, "max_tokens": MAX_TOKENS})
try:
    r = agent.run_sync(PROMPT, usage_limits=UsageLimits(request_limit=MAX_STEPS))
    emit(isinstance(r.output, str) and bool(r.output.strip()), r.output, turns=r.usage().requests
         if callable(r.usage) else r.usage.requests)
except Exception as e:
    failed(e)
'''

ANTHROPIC = r'''
import anthropic

client = anthropic.Anthropic(base_url=BASE.removesuffix("/v1"), api_key="unused", max_retries=0, timeout=600)
TOOLS = [{"name": "get_weather", "description": "Current weather in a city.",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
         {"name": "book_table", "description": "Book a restaurant table.",
          "input_schema": BookTableArgs.model_json_schema()}]
SYSTEM = "You are a helpful assistant. Use the tools."


def text_of(message):
    return "".join(b.text for b in message.content if b.type == "text")


def manual():
    messages = [{"role": "user", "content": PROMPT}]
    for step in range(1, MAX_STEPS + 1):
        r = client.messages.create(model="default", max_tokens=MAX_TOKENS, system=SYSTEM, tools=TOOLS,
                                   messages=messages, extra_body={"temperature": 0})
        if r.stop_reason != "tool_use":
            return emit(r.stop_reason == "end_turn" and bool(text_of(r).strip()), text_of(r), turns=step,
                        error=None if r.stop_reason == "end_turn" else f"stop_reason {r.stop_reason}")
        messages.append({"role": "assistant", "content": r.content})
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": b.id, "content": run_tool(b.name, b.input)}
            for b in r.content if b.type == "tool_use"]})
    emit(False, error=f"still calling tools after {MAX_STEPS} turns", turns=MAX_STEPS)


def runner():
    from anthropic import beta_tool

    @beta_tool
    def get_weather(city: str) -> str:
        """Current weather in a city.

        Args:
            city: the city's name
        """
        return weather_result(city)

    @beta_tool
    def book_table(booking: Booking) -> str:
        """Book a restaurant table.

        Args:
            booking: the booking: name, time and party
        """
        return booking_result(booking.model_dump() if hasattr(booking, "model_dump") else booking)

    run = client.beta.messages.tool_runner(model="default", max_tokens=MAX_TOKENS, system=SYSTEM,
                                           tools=[get_weather, book_table],
                                           messages=[{"role": "user", "content": PROMPT}], max_iterations=MAX_STEPS,
                                           extra_body={"temperature": 0})
    last, turns = None, 0
    for message in run:
        last, turns = message, turns + 1
    done = last is not None and last.stop_reason == "end_turn"
    emit(done and bool(text_of(last).strip()), text_of(last) if last else None, turns=turns,
         error=None if done else f"last stop_reason {getattr(last, 'stop_reason', None)} after {turns} turns")


try:
    manual() if VARIANT == "manual" else runner()
except Exception as e:
    failed(e)
'''

# name -> (venv, variant, code, the package whose version the row shows, the server route it uses)
SCENARIOS = {
    "openai-agents.chat": ("openai-agents", "chat", OPENAI_AGENTS, "openai-agents", "/v1/chat/completions"),
    "openai-agents.responses": ("openai-agents", "responses", OPENAI_AGENTS, "openai-agents", "/v1/responses"),
    "smolagents": ("smolagents", "", SMOLAGENTS, "smolagents", "/v1/chat/completions"),
    "pydantic-ai": ("pydantic-ai", "", PYDANTIC_AI, "pydantic-ai-slim", "/v1/chat/completions"),
    "anthropic.manual": ("anthropic", "manual", ANTHROPIC, "anthropic", "/v1/messages"),
    "anthropic.tool_runner": ("anthropic", "tool_runner", ANTHROPIC, "anthropic", "/v1/messages"),
}
LABELS = {"openai-agents.chat": "OpenAI Agents SDK, `OpenAIChatCompletionsModel`",
          "openai-agents.responses": "OpenAI Agents SDK, `OpenAIResponsesModel`",
          "smolagents": "smolagents `ToolCallingAgent` + `OpenAIServerModel`",
          "pydantic-ai": "pydantic-ai `Agent` + `OpenAIChatModel`",
          "anthropic.manual": "anthropic SDK, manual `messages.create` loop",
          "anthropic.tool_runner": "anthropic SDK, `beta.messages.tool_runner`"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def start_server(log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    out = log.open("w")
    proc = subprocess.Popen(["uv", "run", "--frozen", "roofline", "serve", "--port", str(port)], cwd=ROOT,
                            stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    for _ in range(600):
        if proc.poll() is not None:
            sys.exit(f"roofline serve exited ({proc.returncode}): see {log}")
        try:
            if json.loads(get(base + "/health")).get("status") == "ok":
                return proc, base + "/v1"
        except OSError:
            pass
        time.sleep(0.5)
    proc.kill()
    sys.exit(f"roofline serve not healthy after 300 s: see {log}")


class Trace:
    """A loopback proxy in front of the server that appends every exchange (request and response bodies, headers of
    the request) to a JSON-lines file: the exact request behind an error. Responses are passed on whole, streams
    included (a client reads an SSE stream all at once)."""

    def __init__(self, upstream: str, path: Path):
        import http.server
        import threading
        import urllib.error

        path.write_text("")
        lock = threading.Lock()

        class Handler(http.server.BaseHTTPRequestHandler):
            def relay(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n) if n else None
                headers = {k: v for k, v in self.headers.items()
                           if k.lower() not in ("host", "content-length", "accept-encoding", "connection")}
                req = urllib.request.Request(upstream + self.path, data=body, method=self.command, headers=headers)
                try:
                    with urllib.request.urlopen(req, timeout=900) as r:
                        status, data, got = r.status, r.read(), r.headers
                except urllib.error.HTTPError as e:
                    status, data, got = e.code, e.read(), e.headers
                with lock, path.open("a") as f:
                    f.write(json.dumps({"method": self.command, "path": self.path, "headers": headers,
                                        "body": (body or b"").decode(errors="replace"), "status": status,
                                        "response": data.decode(errors="replace")}) + "\n")
                self.send_response(status)
                for k, v in got.items():
                    if k.lower() not in ("content-length", "transfer-encoding", "connection", "date", "server"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = relay

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def requests_by_route(base: str) -> dict[tuple[str, str], float]:
    """roofline_requests_total by (route, status), from /metrics."""
    out = {}
    for line in get(base.removesuffix("/v1") + "/metrics").splitlines():
        m = re.match(r'roofline_requests_total\{(.*)\} ([0-9.e+]+)$', line)
        if m:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
            out[(labels.get("endpoint", labels.get("route", "?")), labels.get("status", "?"))] = float(m.group(2))
    return out


def versions(python: str, packages: list[str]) -> dict[str, str]:
    code = ("import importlib.metadata as m, json\nout = {}\nfor p in %r:\n    try: out[p] = m.version(p)\n"
            "    except m.PackageNotFoundError: pass\nprint(json.dumps(out))" % packages)
    r = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120)
    return json.loads(r.stdout) if r.returncode == 0 else {}


def run_scenario(python: str, code: str, variant: str, base: str, task: str, max_steps: int, max_tokens: int,
                 timeout_s: float) -> dict:
    script = Path(tempfile.mkstemp(prefix="agents-", suffix=".py")[1])
    script.write_text(f"TASKS = {TASKS!r}\nVARIANT = {variant!r}\n" + PRELUDE + code)
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower() and not k.startswith(("ROOFLINE_", "UV_",
                                                                                                    "VIRTUAL_ENV"))}
    t0 = time.perf_counter()
    try:
        r = subprocess.run([python, str(script), base, task, str(max_steps), str(max_tokens)], capture_output=True,
                           text=True, timeout=timeout_s, env={**env, **CLIENT_ENV})
        lines = [line[9:] for line in r.stdout.splitlines() if line.startswith("@@RESULT ")]
        out = json.loads(lines[-1]) if lines else {
            "finished": False, "error": f"exit {r.returncode}: " + " | ".join(r.stderr.strip().splitlines()[-3:])}
    except subprocess.TimeoutExpired:
        out = {"finished": False, "error": f"no end after {timeout_s:g} s"}
    finally:
        script.unlink(missing_ok=True)
    out["wall_s"] = time.perf_counter() - t0
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--venvs", default="/tmp/agents-venvs", help="the folder of the frameworks' venvs")
    ap.add_argument("--only", action="append", choices=list(SCENARIOS), help="these scenarios (repeatable)")
    ap.add_argument("--task", action="append", choices=list(TASKS), help="these tasks (repeatable; default both)")
    ap.add_argument("--max-steps", type=int, default=6, help="model turns a run may take (default 6)")
    ap.add_argument("--max-tokens", type=int, default=256, help="max_tokens of each model turn (default 256)")
    ap.add_argument("--timeout", type=float, default=400.0, help="seconds a run may take (default 400)")
    ap.add_argument("--server-log", type=Path, default=Path(tempfile.gettempdir()) / "agents_check_server.log")
    ap.add_argument("--json", type=Path, help="write every run's record here")
    ap.add_argument("--trace", type=Path, help="put a proxy in front of the server that writes every request and "
                    "response here, as JSON lines")
    args = ap.parse_args()
    names = args.only or list(SCENARIOS)
    tasks = args.task or list(TASKS)
    vers: dict[str, dict[str, str]] = {}
    for name in names:
        venv = SCENARIOS[name][0]
        python = str(Path(args.venvs) / venv / "bin" / "python")
        if not Path(python).exists():
            sys.exit(f"{python}: not found; make the venvs as this script's docstring says")
        if venv not in vers:
            vers[venv] = versions(python, ["openai-agents", "smolagents", "pydantic-ai-slim", "anthropic", "openai",
                                           "pydantic"])
    proc, base = start_server(args.server_log)
    to = base if args.trace is None else Trace(base.removesuffix("/v1"), args.trace).url + "/v1"  # the frameworks'
    records = []
    try:
        for name in names:
            venv, variant, code, _, route = SCENARIOS[name]
            for task in tasks:
                before = requests_by_route(base)
                out = run_scenario(str(Path(args.venvs) / venv / "bin" / "python"), code, variant, to, task,
                                   args.max_steps, args.max_tokens, args.timeout)
                after = requests_by_route(base)
                diff = {f"{r} {s}": int(after[k] - before.get(k, 0)) for k in after
                        for r, s in [k] if after[k] != before.get(k, 0) and r.startswith("/v1/")}
                answer = out.get("answer") or ""
                if out["finished"] and re.match(r'\s*\{\s*"tool_calls"', answer):
                    out["finished"] = False  # not an answer: a call cut at max_tokens, its raw JSON given as text
                    out["error"] = ("the framework took as its final answer a tool call cut at max_tokens (the "
                                    "server's content for a call it could not finish, finish_reason length)")
                out.update(scenario=name, task=task, requests=diff, uses_result=uses_result(task, answer))
                records.append(out)
                calls = ", ".join(f"{c['name']}({json.dumps(c['args'])})" for c in out.get("calls") or [])
                print(f"{name:24} {task:8} finished={'yes' if out['finished'] else 'NO '} "
                      f"uses_result={out['uses_result']} {out['wall_s']:6.1f} s "
                      f"requests={diff} turns={out.get('turns')}\n    calls: {calls or '-'}\n"
                      f"    answer: {answer[:200]!r}"
                      + (f"\n    error: {out['error']}" if out.get("error") else "")
                      + (f"\n    note: {out['note']}" if out.get("note") else ""), flush=True)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    print("\nversions: " + json.dumps(vers))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    print(f"commit {commit}, load {os.getloadavg()[0]:.1f} at the end, {os.cpu_count()} cores")
    if args.json:
        args.json.write_text(json.dumps({"versions": vers, "commit": commit, "runs": records}, indent=1))


if __name__ == "__main__":
    main()
