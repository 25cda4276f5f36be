"""The scheduler's seam (`mlx_engine.step`): the scheduler, a request's state and the block bookkeeping know no
tensors (they import neither MLX nor torch, at module or function level), and a runner is anything that turns a
`StepPlan` into a `StepResult`: here a scripted pure-Python one, whose plans and tokens are checked exactly."""

from __future__ import annotations

import ast
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
HOST_ONLY = ["mlx_engine/scheduler.py", "mlx_engine/scheduler_speculation.py", "mlx_engine/sequence.py",
             "mlx_engine/step.py", "mlx_engine/kv/block_pool.py", "mlx_engine/kv/manager.py",
             "mlx_engine/kv/tables.py", "mlx_engine/kv/config.py"]


def imported_names(path: Path) -> set[str]:
    """Every module an import statement in the file names, at any depth (function-level imports included)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize("module", HOST_ONLY)
def test_the_host_side_imports_no_tensor_library(module: str) -> None:
    banned = {n for n in imported_names(ROOT / module) if n.split(".")[0] in ("mlx", "mlx_lm", "torch")}
    assert banned == set(), f"{module} imports {sorted(banned)}"


def test_importing_the_host_side_loads_no_tensor_library() -> None:
    """Nor do the modules they import at load time: the scheduler runs in a process without MLX or torch."""
    mods = ", ".join(m.removesuffix(".py").replace("/", ".") for m in HOST_ONLY)
    probe = f"import {mods}, sys; print(sorted({{m.split('.')[0] for m in sys.modules}} & {{'mlx', 'torch'}}))"
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


# --- a scripted runner ----------------------------------------------------------------------------


def next_token(tokens: list[int]) -> int:
    """The scripted model: a token from every token before it (never 0 or 1, the EOS)."""
    return (7 * sum(tokens) + len(tokens)) % 98 + 2


class FakeCache:
    """The scheduler's side of a cache without paging (admission reserves nothing)."""

    def __init__(self) -> None:
        from mlx_engine.kv.protocol import KVCapabilities

        self.capabilities = KVCapabilities(paged=False, batching=True, packed=True, rollback=False, kv_files=False,
                                           prefix_caching=False, quantized=False)
        self.recorded: dict[str, list[int]] = {}

    def start(self, req_id: str, prompt_ids: list[int], reuse: bool = True) -> int:
        return 0

    def record(self, req_id: str, known_ids: list[int]) -> None:
        self.recorded[req_id] = list(known_ids)

    def finish(self, req_id: str, fed_ids: list[int]) -> None:
        self.recorded.pop(req_id, None)

    def drop_request(self, req_id: str) -> None:
        self.recorded.pop(req_id, None)

    def drop(self) -> None:
        self.recorded.clear()


class ScriptedRunner:
    """`execute` by the script: it keeps each sequence's tokens (prompt, then what it drew) as a runner keeps its
    last token, checks every row against them, and hands tokens back as `step.Known`."""

    vocab_size, context_length, prefill_chunk_size = 100, 256, 4
    eos_ids = frozenset({1})
    draft = None
    self_draft_layers = 0

    def __init__(self) -> None:
        from mlx_engine.backends.base import RunnerCapabilities
        from mlx_engine.backends.common import NoTokenizer

        self.capabilities = RunnerCapabilities(rollback=False, kv_files=False, self_draft=False, hidden_states=False,
                                               max_batch=None)
        self.tokenizer = NoTokenizer("scripted", {"eos_token_id": 1})
        self.cache = FakeCache()
        self.plans: list[Any] = []
        self.tokens: dict[str, list[int]] = {}

    def execute(self, plan: Any) -> Any:
        from mlx_engine.step import Known, StepResult

        self.plans.append(plan)
        for seq_id in plan.finished:
            del self.tokens[seq_id]
        for new in plan.new:
            self.tokens[new.seq_id] = list(new.prompt)
        sampled = []
        for row in plan.decode:
            toks = self.tokens[row.seq_id]
            assert list(row.known) == toks[:len(row.known)] and len(row.known) < len(toks)  # the input: toks[-1]
            toks.append(next_token(toks))
            sampled.append((row.seq_id, Known(toks[-1])))
        for c in plan.prefill:
            assert list(c.token_ids) == self.tokens[c.seq_id][c.start:c.end]
            if c.samples:
                toks = self.tokens[c.seq_id]
                toks.append(next_token(toks))
                sampled.append((c.seq_id, Known(toks[-1])))
        return StepResult(sampled=tuple(sampled))

    def reset_peak_memory(self) -> None:
        pass

    def peak_memory_bytes(self) -> int:
        return 0


class Stream:
    def __init__(self) -> None:
        self.events: queue.Queue = queue.Queue()
        self.cancelled = threading.Event()
        self.submitted_at = time.perf_counter()

    def tokens(self) -> tuple[list[int], str]:
        out, reason = [], ""
        while not self.events.empty():
            e = self.events.get()
            out += e.token_ids
            reason = e.finish_reason or reason
        return out, reason


def expected(prompt: list[int], n: int) -> list[int]:
    toks = list(prompt)
    for _ in range(n):
        toks.append(next_token(toks))
    return toks[len(prompt):]


def test_the_scheduler_plans_chunks_and_decode_rows_and_reads_tokens_a_step_behind() -> None:
    from mlx_engine.api import SamplingParams
    from mlx_engine.scheduler import Scheduler

    runner = ScriptedRunner()
    sched = Scheduler(runner, token_budget=6)  # type: ignore[arg-type]
    a, b = list(range(10, 17)), [40, 41, 42]
    sa, sb = Stream(), Stream()
    sched.add(a, SamplingParams(max_tokens=3, ignore_eos=True), sa)
    sched.add(b, SamplingParams(max_tokens=3, ignore_eos=True), sb)
    steps = 0
    while sched.has_work():
        sched.step()
        steps += 1
        assert steps < 20
    work = [p for p in runner.plans if p.decode or p.prefill]

    def spans(p: Any) -> list[tuple]:
        return ([("decode", r.seq_id, len(r.known)) for r in p.decode]
                + [("prefill", c.seq_id, c.start, c.end, c.samples) for c in p.prefill])

    assert [spans(p) for p in work] == [
        [("prefill", "req-1", 0, 4, False), ("prefill", "req-2", 0, 2, False)],  # 6 tokens: the budget
        [("prefill", "req-1", 4, 7, True), ("prefill", "req-2", 2, 3, True)],  # last chunks draw the first tokens
        [("decode", "req-1", 7), ("decode", "req-2", 3)],  # fed: the prompts (first tokens not read yet)
        [("decode", "req-1", 8), ("decode", "req-2", 4)],
    ]
    assert [n.seq_id for p in runner.plans for n in p.new] == ["req-1", "req-2"]
    assert all(r.token is None for p in work for r in p.decode)  # each input: the runner's last token
    assert sa.tokens() == (expected(a, 3), "length")
    assert sb.tokens() == (expected(b, 3), "length")
    assert runner.cache.recorded == {}


def test_a_finished_sequence_is_dropped_in_the_next_plan() -> None:
    from mlx_engine.api import SamplingParams
    from mlx_engine.scheduler import Scheduler

    runner = ScriptedRunner()
    sched = Scheduler(runner)  # type: ignore[arg-type]
    s1, s2 = Stream(), Stream()
    sched.add([5, 6, 7], SamplingParams(max_tokens=1, ignore_eos=True), s1)
    sched.step()
    sched.step()  # req-1 read and retired
    assert s1.tokens() == (expected([5, 6, 7], 1), "length")
    sched.add([8, 9], SamplingParams(max_tokens=2, ignore_eos=True), s2)
    while sched.has_work():
        sched.step()
    assert [f for p in runner.plans for f in p.finished][:1] == ["req-1"]
    assert set(runner.tokens) <= {"req-2"}
    assert s2.tokens() == (expected([8, 9], 2), "length")
