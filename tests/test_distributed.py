"""Two ranks on loopback with MLX's ring backend, started by mlx.launch: the engine's outputs against one process.

Each launch starts two Python processes (about 3 s on the 2-core box before any model loads), so every test puts
its models and requests into one or two launches (tests/support/distributed_ranks.py runs them on each rank). Ports:
each launch picks free ports (`free_port_base`), so runs of the suite side by side do not collide.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from mlx_engine.distributed.stage import MIN_DECODE_ROWS_PER_MICRO_BATCH
from tests.support.distributed_ranks import read_events
from tests.support.tiny_models import parity_goldens, random_llama_folder

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "data" / "golden"
NATIVE = ("llama", "mistral", "qwen2", "qwen3")  # mlx_engine.models.NATIVE_MODEL_TYPES: what --distributed shards
TINY = sorted(p.name for p in parity_goldens()
              if json.loads((p / "config.json").read_text())["model_type"] in NATIVE)
MLX_LAUNCH = Path(sys.executable).parent / "mlx.launch"
RANKS = ROOT / "tests" / "support" / "distributed_ranks.py"
LAUNCH_TIMEOUT_S = 240

pytestmark = pytest.mark.skipif(not MLX_LAUNCH.exists(), reason="mlx.launch is not installed beside python")


def free_port_base(ranks: int = 2) -> int:
    """A port p with p ... p + ranks - 1 free on 127.0.0.1 (mlx.launch's ring takes one per rank from -p)."""
    rng = np.random.default_rng()
    for _ in range(200):
        base = int(rng.integers(20000, 60000))
        socks = []
        try:
            for p in range(base, base + ranks):
                s = socket.socket()
                s.bind(("127.0.0.1", p))
                socks.append(s)
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {ranks} consecutive free ports")


def launch_cmd(*args: str, ranks: int = 2) -> list[str]:
    return [str(MLX_LAUNCH), "--backend", "ring", "-n", str(ranks), "--hosts", "127.0.0.1", "-p",
            str(free_port_base(ranks)), "--", sys.executable, *args]


def env(**extra: str) -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if not k.startswith("MLX_")}
    out.update(PYTHONPATH=str(ROOT), **extra)
    return out


def run_scenario(tmp_path: Path, mode: str, runs: list[dict], ranks: int = 2) -> list[dict]:
    spec, out = tmp_path / f"scenario-{mode}.json", tmp_path / f"results-{mode}.json"
    spec.write_text(json.dumps({"mode": mode, "runs": runs}))
    out.unlink(missing_ok=True)  # a run of the same mode before this one must not stand in for a run that failed
    p = subprocess.run(launch_cmd(str(RANKS), str(spec), str(out), ranks=ranks), capture_output=True, text=True,
                       cwd=ROOT, env=env(), timeout=LAUNCH_TIMEOUT_S)
    assert out.exists(), f"rc={p.returncode}\nstdout:\n{p.stdout[-3000:]}\nstderr:\n{p.stderr[-3000:]}"
    return json.loads(out.read_text())


def one_process(model: str | None, batches: list[list[dict]], **options) -> list[dict]:
    """The same batches through one process's engine (each batch submitted together, as on the ranks)."""
    from mlx_engine import Engine, GenerationRequest, SamplingParams

    out = []
    with Engine.load(model, **options) as engine:
        for batch in batches:
            streams = [engine.generate(GenerationRequest(prompt_token_ids=r["ids"], sampling=SamplingParams(
                **r["sampling"]))) for r in batch]
            for r, stream in zip(batch, streams):
                events = read_events(stream, r.get("cancel_after"))
                out.append({"tokens": [t for e in events for t in e.token_ids], "finish": events[-1].finish_reason,
                            "cached": events[-1].usage.cached_prompt_tokens if events[-1].usage else None})
        stats = engine.kv_stats()
        out.append({"weight_bytes": engine.info.weight_bytes, "kv_budget_bytes": stats["bytes_budget"]})
    return out


def greedy(ids: list[int], n: int, **extra) -> dict:
    return {"ids": ids, "sampling": {"temperature": 0.0, "max_tokens": n, "ignore_eos": True, **extra}}


def golden_batches(name: str) -> list[list[dict]]:
    gold = np.load(GOLDEN / name / "golden.npz")
    return [[greedy(gold["input_ids"].tolist(), len(gold["greedy_tokens"]))]]


PREFIX = [(7 * i) % 120 + 3 for i in range(70)]
# the engine's work beyond one greedy request, each compared with one process: a long prompt in 16-token prefill
# chunks; then two that share its first 64 tokens (a prefix-cache hit) with a seeded sampled one beside them in the
# same continuous batch (a packed forward of decode rows and prefill chunks); then a repetitive prompt verified by
# prompt lookup's drafts
WORK = [
    [greedy(PREFIX, 8)],
    [greedy(PREFIX[:64] + [9, 9, 4], 10),
     {"ids": PREFIX[:64] + [11, 2], "sampling": {"temperature": 0.9, "top_p": 0.95, "seed": 11, "max_tokens": 10,
                                                 "ignore_eos": True}},
     greedy([5, 17, 40, 8, 99, 23, 61, 7, 30, 3, 88, 12, 44, 6] * 3, 12)],
    [greedy([5, 6, 7, 8, 9, 10, 11, 12] * 6, 16, speculative="prompt-lookup", num_draft_tokens=4)],
]
WORK_OPTIONS = {"prefill_chunk_size": 16}
# three 70-token prompts prefilled in one packed forward of 210 rows: the pipeline cuts it into two micro-batches;
# then enough sequences decoding together (greedy, every fourth seeded sampling) that the pipeline cuts each decode
# step's rows into two groups of sequences (stage.MIN_DECODE_ROWS_PER_MICRO_BATCH each)
MANY_DECODING = 2 * MIN_DECODE_ROWS_PER_MICRO_BATCH
TOGETHER = [[greedy(PREFIX[i:] + PREFIX[:i], 6) for i in (1, 2, 3)],
            [greedy(PREFIX[i:i + 3 + i % 3], 6) if i % 4 else
             {"ids": PREFIX[i:i + 4], "sampling": {"temperature": 0.9, "top_p": 0.95, "seed": i, "max_tokens": 6,
                                                   "ignore_eos": True}} for i in range(MANY_DECODING)]]
TOGETHER_OPTIONS = {"max_seqs": MANY_DECODING, "kv_budget_bytes": 2**20}  # a block each and the three prompts
IN_FLIGHT = {"ROOFLINE_PIPELINE_IN_FLIGHT": "1"}  # each group's decode step in flight (opt-in)
# 2, 3 and 4 requests at once, of different lengths (groups change as they end), greedy and seeded: decode steps
# of each group of sequences in flight on the pipeline
SEEDED = {"temperature": 0.9, "top_p": 0.95, "ignore_eos": True}
CONCURRENT = [[greedy(PREFIX[i:i + 5 + i], 9 + 3 * i) for i in range(2)],
              [greedy(PREFIX[i:i + 4], 7 + 4 * i) if i != 1 else
               {"ids": PREFIX[3:11], "sampling": {**SEEDED, "seed": 5, "max_tokens": 14}} for i in range(3)],
              [greedy(PREFIX[9 * i:9 * i + 6], 16 - 3 * i) if i % 2 else
               {"ids": PREFIX[9 * i:9 * i + 3], "sampling": {**SEEDED, "seed": i, "max_tokens": 11 + i}}
               for i in range(4)]]
# two requests cancelled, one in each group (a cancel lands while the group's step is in flight or between, as
# the steps fall), beside two that go on; then requests on the blocks they freed, one of them a prefix-cache hit on
# a cancelled prompt (two blocks): the ranks' caches must still agree
CANCELLED = [[{**greedy(PREFIX[:40], 40), "cancel_after": 5}, greedy(PREFIX[40:46], 12),
              {**greedy(PREFIX[20:30], 40), "cancel_after": 5}, greedy(PREFIX[50:53], 20)],
             [greedy(PREFIX[:40] + [7], 9), greedy(PREFIX[60:65], 12), greedy(PREFIX[5:9], 10)]]


@pytest.fixture(scope="module")
def big_layers(tmp_path_factory) -> Path:
    """A random llama whose decoder layers outweigh its embedding and head 12 to 1, for the bytes per rank."""
    return random_llama_folder(tmp_path_factory.mktemp("big") / "llama8", num_heads=4, num_kv_heads=2, head_dim=32,
                               hidden=128, layers=8, vocab=128)


@pytest.mark.parametrize("mode", ["pipeline", "tensor"])
def test_two_ranks_match_one_process(tmp_path, mode, big_layers):
    runs = [{"model": str(GOLDEN / name), "batches": golden_batches(name)} for name in TINY]
    runs.append({"model": str(GOLDEN / "llama"), "options": WORK_OPTIONS, "batches": WORK})
    runs.append({"model": str(GOLDEN / "llama"), "options": TOGETHER_OPTIONS, "batches": TOGETHER})
    runs.append({"model": str(big_layers), "batches": [[greedy([1, 2, 3], 2)]]})
    results = run_scenario(tmp_path, mode, runs)
    assert len(results) == len(runs), results
    for name, got in zip(TINY, results):
        want = np.load(GOLDEN / name / "golden.npz")["greedy_tokens"].tolist()
        assert got["requests"][0]["tokens"] == want, f"{mode} {name}"
    work, together, big = results[len(TINY):]
    ref = one_process(str(GOLDEN / "llama"), TOGETHER, **TOGETHER_OPTIONS)
    assert len(together["requests"]) == 3 + MANY_DECODING
    for i, (a, b) in enumerate(zip(together["requests"], ref)):
        assert a["tokens"] == b["tokens"], f"{mode} together {i}: {a} != {b}"
    ranks = together["kv"]["ranks"]
    cut = [(r["micro_batched_forwards"], r["micro_batched_decodes"]) for r in ranks]
    if mode == "pipeline":  # the three prompts' prefill, and decode steps of the many (how many: the scheduler's)
        assert cut[0] == cut[1] and cut[0][1] >= 1 and cut[0][0] >= 1 + cut[0][1], cut
    else:
        assert cut == [(0, 0), (0, 0)], cut
    ref = one_process(str(GOLDEN / "llama"), WORK, **WORK_OPTIONS)
    for i, (a, b) in enumerate(zip(work["requests"], ref)):
        assert a["tokens"] == b["tokens"], f"{mode} request {i}: {a} != {b}"
        assert a["finish"] == b["finish"] == "length"
    assert work["requests"][1]["cached"] == ref[1]["cached"] == 64  # the prefix cache, on every rank's blocks
    # weights and KV each rank holds: about half of one process's
    single = one_process(str(big_layers), [])[-1]
    ranks = big["kv"]["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:
        assert 0.4 <= r["weight_bytes"] / single["weight_bytes"] <= 0.6, (mode, r, single)
        assert 0.4 <= r["kv_budget_bytes"] / single["kv_budget_bytes"] <= 0.6, (mode, r, single)
    if mode == "pipeline":
        assert [r["layers"] for r in ranks] == [[4, 8], [0, 4]]
        assert [r["kv_layers"] for r in ranks] == [4, 4]
    else:
        assert [r["kv_heads"] for r in ranks] == [1, 1]


def test_pipeline_in_flight_matches_one_process(tmp_path):
    """2, 3 and 4 concurrent requests, each group's decode step in flight while the other's runs: the tokens of one
    process, as in lockstep; both ranks ran every forward. Then the engine's other work with it on (chunked prefill,
    a prefix-cache hit, seeded sampling beside greedy, prompt lookup), whose steps go in lockstep where they must;
    and a request cancelled mid-flight, then requests on the blocks it freed and its cached prompt."""
    model = str(GOLDEN / "llama")
    flight, lockstep, work, cancelled = run_scenario(tmp_path, "pipeline", [
        {"model": model, "batches": CONCURRENT, "env": IN_FLIGHT}, {"model": model, "batches": CONCURRENT},
        {"model": model, "options": WORK_OPTIONS, "batches": WORK, "env": IN_FLIGHT},
        {"model": model, "batches": CANCELLED, "env": IN_FLIGHT}])
    ref = one_process(model, CONCURRENT)
    assert len(flight["requests"]) == len(ref) - 1 == 9
    for i, (a, b, c) in enumerate(zip(flight["requests"], lockstep["requests"], ref)):
        assert a["tokens"] == b["tokens"] == c["tokens"], f"request {i}: {a} / {b} / {c}"
        assert a["finish"] == c["finish"] == "length" and not a["error"]
    for run, in_flight in ((flight, True), (lockstep, False)):
        ranks = run["kv"]["ranks"]
        assert ranks[0]["forwards"] == ranks[1]["forwards"], ranks
        flown = ranks[0]["in_flight_forwards"]
        # most decode steps: every step but the prefills and those where one sequence decodes alone
        assert (flown > ranks[0]["forwards"] // 2) if in_flight else flown == 0, ranks[0]
    ref = one_process(model, WORK, **WORK_OPTIONS)
    for i, (a, b) in enumerate(zip(work["requests"], ref)):
        assert a["tokens"] == b["tokens"] and a["finish"] == b["finish"] == "length", f"work {i}: {a} != {b}"
    assert work["requests"][1]["cached"] == ref[1]["cached"] == 64
    assert work["kv"]["ranks"][0]["in_flight_forwards"] > 0  # the three requests of the second batch
    ref = one_process(model, CANCELLED)
    got = cancelled["requests"]
    for i, (a, b) in enumerate(zip(got, ref[:7])):
        if i in (0, 2):
            assert len(a["tokens"]) == 5 and a["tokens"] == b["tokens"], (i, a, b)
        else:
            assert a["tokens"] == b["tokens"] and a["finish"] == b["finish"] == "length" and not a["error"], (i, a, b)
    assert got[4]["cached"] == ref[4]["cached"] == 32  # the cancelled request's prompt blocks, on every rank


def test_three_ranks_in_flight_match_one_process(tmp_path, big_layers):
    """Three pipeline ranks on loopback, three groups with two of their steps in flight at once (rank 0 finishes
    the oldest while ranks 1 and 2 each run one): the tokens of one process."""
    batches = CONCURRENT[1:] + [[greedy(PREFIX[i:i + 4], 10 + i) for i in range(6)]]
    got = run_scenario(tmp_path, "pipeline", [{"model": str(big_layers), "batches": batches, "env": IN_FLIGHT}],
                       ranks=3)[0]
    ref = one_process(str(big_layers), batches)
    for i, (a, b) in enumerate(zip(got["requests"], ref)):
        assert a["tokens"] == b["tokens"] and a["finish"] == b["finish"] == "length", f"request {i}: {a} != {b}"
    ranks = got["kv"]["ranks"]
    assert [r["layers"] for r in ranks] == [[6, 8], [0, 3], [3, 6]], ranks
    assert len({r["forwards"] for r in ranks}) == 1 and ranks[0]["in_flight_forwards"] > ranks[0]["forwards"] // 2


def test_smollm2_pipeline_matches_one_process(tmp_path):
    from mlx_engine.loading import load_tokenizer

    tok = load_tokenizer(None)
    ids = tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True)
    batches = [[greedy(ids, 10)]]
    results = run_scenario(tmp_path, "pipeline", [{"model": None, "batches": batches}])
    ref = one_process(None, batches)
    assert results[0]["requests"][0]["tokens"] == ref[0]["tokens"], (results, ref)
    ranks = results[0]["kv"]["ranks"]
    assert [r["layers"] for r in ranks] == [[19, 30], [0, 19]]  # by parameters: the tied embedding sits on rank 0


def test_refusals_at_start(tmp_path):
    """A head count that does not divide (SmolLM2's 9 heads over 2 ranks) and ranks on different model files."""
    tensor = run_scenario(tmp_path, "tensor", [{"model": None}])
    assert "load_error" in tensor[0], tensor
    line = tensor[0]["load_error"]
    assert "9 query and 3 KV heads" in line and "use --distributed pipeline" in line and "\n" not in line
    other = run_scenario(tmp_path, "pipeline", [{"model": str(GOLDEN / "gemma2")}])
    line = other[0]["load_error"]
    assert "needs a natively implemented model" in line and "gemma2" in line and "\n" not in line
    mixed = run_scenario(tmp_path, "pipeline", [{"model": str(GOLDEN / "llama"),
                                                 "model_by_rank": {"1": str(GOLDEN / "mistral")}}])
    line = mixed[0]["load_error"]
    assert "rank 1 loaded" in line and "mistral" in line and "refused" in line and "\n" not in line


def _parent(pid: int) -> int:
    return int((Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[1])


def descendants(launcher: int) -> list[int]:
    out = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            pid = int(proc.name)
            while pid > 1:
                pid = _parent(pid)
                if pid == launcher:
                    out.append(int(proc.name))
                    break
        except (OSError, ValueError, IndexError):
            continue
    return out


def rank_pid(launcher: int, rank: int) -> int | None:
    """The pid of `rank` among the launcher's descendants (its MLX_RANK), or None."""
    for pid in descendants(launcher):
        try:
            if f"MLX_RANK={rank}".encode() in (Path("/proc") / str(pid) / "environ").read_bytes().split(b"\0"):
                return pid
        except OSError:
            continue
    return None


def kill_launch(proc: subprocess.Popen) -> None:
    """A launch the test gives up on: its ranks (by pid), then the launcher."""
    if proc.poll() is None:
        for pid in descendants(proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        proc.kill()
        proc.communicate()


def start_serve(port: int, stdin: int | None = None) -> subprocess.Popen:
    """`roofline serve --distributed pipeline` on two ranks, once its /health answers."""
    import http.client

    proc = subprocess.Popen(launch_cmd("-m", "app.cli", "serve", "--distributed", "pipeline", "--port", str(port)),
                            stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                            env=env())
    deadline = time.monotonic() + 180
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            kill_launch(proc)
            raise AssertionError(proc.stdout.read() if proc.stdout else "did not start")
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            c.request("GET", "/health")
            if c.getresponse().status == 200:
                return proc
        except OSError:
            time.sleep(0.5)


def complete(port: int, prompt: str) -> str:
    import http.client

    c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    c.request("POST", "/v1/completions", json.dumps({"model": "default", "prompt": prompt, "max_tokens": 8,
                                                  "temperature": 0}),
              {"Content-Type": "application/json"})
    r = c.getresponse()
    body = json.loads(r.read())
    assert r.status == 200, body
    return body["choices"][0]["text"]


def cpu_seconds(pid: int) -> float:
    fields = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def test_serve_concurrent_requests_match_alone(tmp_path):
    """Three requests at once through `roofline serve --distributed pipeline` reply as each does alone; idle, the
    ranks cost no CPU (rank 1 used to poll MLX's receive at 40-90% of a core: it rests on the doorbell now)."""
    import threading

    port = free_port_base()
    proc = start_serve(port)
    try:
        prompts = ["The capital of France is", "1, 2, 3, 4,", "Roses are red, violets"]
        alone = [complete(port, p) for p in prompts]
        together: list[str | None] = [None] * 3

        def one(i: int) -> None:
            together[i] = complete(port, prompts[i])

        threads = [threading.Thread(target=one, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert together == alone and all(alone), (together, alone)
        ranks = [rank_pid(proc.pid, r) for r in (0, 1)]
        assert None not in ranks
        time.sleep(0.5)  # the engine goes idle and rests the other rank
        before = [cpu_seconds(pid) for pid in ranks]
        time.sleep(3.0)
        used = [cpu_seconds(pid) - b for pid, b in zip(ranks, before)]
        assert max(used) < 0.15, used  # under 5% of a core each
        assert complete(port, prompts[0]) == alone[0]  # and the doorbell wakes it
    finally:
        rank0 = rank_pid(proc.pid, 0)
        if rank0 is not None:
            os.kill(rank0, signal.SIGINT)
        try:
            out, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            out = "(did not stop within 60 s)"
            kill_launch(proc)
    # mlx.launch exits 0 whatever its ranks do, and warns for each rank that ends otherwise: the server ends as
    # SIGINT asks (status 130), rank 1 with 0 once rank 0 has stopped it
    warnings = [line for line in out.splitlines() if "[WARN]" in line]
    assert len(warnings) <= 1 and all("rank 0 exited with code 130" in w for w in warnings), out[-3000:]
    assert "error" not in out, out[-3000:]


def test_stopping_the_launcher_ends_every_rank(tmp_path):
    """SIGTERM to mlx.launch ends it without a word to its ranks (MLX 0.32): each sees its stdin pipe close, rank 0
    stops as on SIGTERM (the server drains) and rank 1 once rank 0 has stopped it; no rank is left, the port is free."""
    port = free_port_base()
    proc = start_serve(port, stdin=subprocess.PIPE)  # a pipe, as a terminal's launcher has: not /dev/null
    ranks = [rank_pid(proc.pid, r) for r in (0, 1)]
    try:
        assert None not in ranks
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while any(Path(f"/proc/{pid}").exists() for pid in ranks) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [pid for pid in ranks if Path(f"/proc/{pid}").exists()]
        assert not left, f"ranks {left} still running 10 s after the launcher was stopped"
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free again
    finally:
        for pid in ranks:
            if pid is not None and Path(f"/proc/{pid}").exists():
                os.kill(pid, signal.SIGKILL)
        kill_launch(proc)


def test_a_resting_rank_ends_when_rank_0_dies(tmp_path):
    """Rank 0 killed while the engine is idle: rank 1, resting on the doorbell, sees its connection close and ends at
    once with a line that says so (it would otherwise wait for a plan that never comes)."""
    port = free_port_base()
    proc = start_serve(port)
    try:
        complete(port, "Hi")
        time.sleep(0.5)
        rank0, rank1 = rank_pid(proc.pid, 0), rank_pid(proc.pid, 1)
        assert rank0 is not None and rank1 is not None
        os.kill(rank0, signal.SIGKILL)
        out, _ = proc.communicate(timeout=20)
    finally:
        kill_launch(proc)
    assert "rank 1: rank 0 ended while this rank rested (its doorbell connection closed)" in out, out[-3000:]


def test_rank_killed_mid_generation_ends_the_run(tmp_path):
    proc = subprocess.Popen(launch_cmd("-m", "app.cli", "generate", "--distributed", "pipeline", "-n", "2000", "--raw",
                                       "-p", "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env())
    try:
        first = proc.stdout.read(40)  # some tokens are out: the ranks are mid-generation
        assert first, proc.stderr.read()
        victim = rank_pid(proc.pid, 1)
        assert victim is not None
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        _, err = proc.communicate(timeout=60)
        took = time.monotonic() - killed
    finally:
        kill_launch(proc)
    assert took < 30, took
    assert proc.returncode is not None
    errors = [line for line in err.splitlines() if "roofline: error" in line]
    assert errors and "rank 1" in errors[0] and ("lost" in errors[0] or "ended" in errors[0]), err
    assert "Node with rank 0 exited with code 3" in err, err  # EXIT_RANK_LOST, not a crash or a signal
    assert rank_pid(proc.pid, 0) is None


def _signal_rank_1(tmp_path: Path, mode: str, batch: list[dict], signum: int, **run_env: str) -> tuple[float, str]:
    """Starts `batch` on two ranks (a 4 s deadline, `run_env` set on both), sends rank 1 `signum` once the first
    token is out, and returns how long rank 0 lived on after it and the launch's stderr."""
    started = tmp_path / "started"
    spec, out = tmp_path / "signalled.json", tmp_path / "signalled-out.json"
    run = {"model": str(GOLDEN / "llama"), "started_file": str(started), "batches": [batch], "env": run_env}
    spec.write_text(json.dumps({"mode": mode, "runs": [run]}))
    proc = subprocess.Popen(launch_cmd(str(RANKS), str(spec), str(out)), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env(ROOFLINE_DISTRIBUTED_TIMEOUT="4"))
    victim = None
    try:
        deadline = time.monotonic() + 120
        while not started.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        victim = rank_pid(proc.pid, 1)
        assert started.exists() and victim is not None, proc.communicate(timeout=30)
        time.sleep(0.3)  # every request decoding
        os.kill(victim, signum)
        signalled = time.monotonic()
        while rank_pid(proc.pid, 0) is not None and time.monotonic() - signalled < 30:
            time.sleep(0.2)
        took = time.monotonic() - signalled
    finally:
        if victim is not None:
            try:
                os.kill(victim, signal.SIGKILL)  # stopped: the launcher's SIGTERM would wait for ever
            except ProcessLookupError:
                pass  # killed already
        try:
            _, err = proc.communicate(timeout=60)
        finally:
            kill_launch(proc)
    return took, err


def test_silent_rank_ends_the_run_at_the_deadline(tmp_path):
    """A rank that stops answering (SIGSTOP: no connection closes) is named once the deadline passes."""
    took, err = _signal_rank_1(tmp_path, "tensor", [greedy([1, 2, 3], 400)], signal.SIGSTOP)
    assert took < 15, took
    line = [x for x in err.splitlines() if "roofline: error" in x]
    assert line and "no answer from rank 1 (127.0.0.1:" in line[0] and "for 4 s" in line[0], err
    assert "Node with rank 0 exited with code 3" in err, err


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "stopped"])
def test_rank_lost_with_decode_steps_in_flight(tmp_path, signum):
    """Three sequences decoding on the pipeline, a group's step in flight at any time: rank 1 killed (its
    connections close) or stopped (they do not) ends the run with EXIT_RANK_LOST, naming rank 1."""
    took, err = _signal_rank_1(tmp_path, "pipeline", [greedy([1, 2, 3 + i], 400) for i in range(3)], signum,
                               **IN_FLIGHT)
    assert took < 15, took
    line = [x for x in err.splitlines() if "roofline: error" in x]
    if signum == signal.SIGKILL:
        assert line and "rank 1" in line[0] and ("lost" in line[0] or "ended" in line[0]), err
    else:
        assert line and "no answer from rank 1 (127.0.0.1:" in line[0] and "for 4 s" in line[0], err
    assert "Node with rank 0 exited with code 3" in err, err


def roofline(*args: str, **extra_env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "app.cli", *args], capture_output=True, text=True, cwd=ROOT,
                          env=env(**extra_env), timeout=120)


def test_bad_input_is_one_line(tmp_path):
    bad = roofline("generate", "--distributed", "sideways", "-p", "hi")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1, bad.stderr
    assert "--distributed 'sideways': expected pipeline" in bad.stderr
    alone = roofline("generate", "--distributed", "pipeline", "-p", "hi")
    assert alone.returncode == 2 and alone.stderr.count("\n") == 1, alone.stderr
    assert "needs its ranks started by mlx.launch" in alone.stderr
    # a hostfile naming a host that never answers (rank 1's port: nobody listens there)
    base = free_port_base()
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{base}"], [f"127.0.0.1:{base + 1}"]]))
    t = time.monotonic()
    lone = roofline("generate", "--distributed", "pipeline", "-m", str(GOLDEN / "llama"), "-p", "hi",
                    MLX_RANK="0", MLX_HOSTFILE=str(hostfile), ROOFLINE_DISTRIBUTED_TIMEOUT="3")
    assert time.monotonic() - t < 30
    assert lone.returncode != 0
    lines = lone.stderr.strip().splitlines()
    assert len(lines) == 1 and f"rank 1 (127.0.0.1:{base + 1}) did not connect within 3 s" in lines[0], lone.stderr
