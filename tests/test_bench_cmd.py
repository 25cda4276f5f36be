"""`roofline bench` and `roofline bench compare` on a tiny random model: well-formed JSON and Markdown, ratios,
a PNG, and one clear line for each mistake."""

from __future__ import annotations

import copy
import json
import subprocess
from pathlib import Path

import pytest

from app.bench.schema import SCHEMA, validate
from tests.support.cli import assert_one_line_error, roofline
from tests.support.tiny_models import random_llama_folder


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A data dir whose cached peaks spare the tests measuring this machine (the bandwidth's start-up check reads
    3 copies; none reads above 1 TB/s, so the full measurement never runs)."""
    from app.bench.machine import flops_label
    from mlx_engine.roofline import _cpu_name

    h = tmp_path_factory.mktemp("home")
    (h / "bandwidth.json").write_text(json.dumps({"label": _cpu_name(), "bytes_per_s": 1e12, "median": 1e12,
                                                  "low": 1e12, "runs": 15}))
    (h / "peak_flops.json").write_text(json.dumps({"label": flops_label("cpu"), "flops": 1e11}))
    return h


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory: pytest.TempPathFactory, home: Path) -> tuple[dict, str]:
    import os

    from app.cli import main

    tmp = tmp_path_factory.mktemp("bench")
    model = random_llama_folder(tmp / "tiny")
    out = tmp / "a.json"
    old = os.environ.get("ROOFLINE_HOME")
    os.environ["ROOFLINE_HOME"] = str(home)
    try:
        import contextlib
        import io

        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            rc = main(["bench", "--model", str(model), "-p", "16", "-n", "4", "--batch", "1,2", "--context", "0,32",
                       "--repeats", "2", "--json", str(out), "--markdown"])
    finally:
        if old is None:
            os.environ.pop("ROOFLINE_HOME", None)
        else:
            os.environ["ROOFLINE_HOME"] = old
    assert rc == 0
    return json.loads(out.read_text()), buf.getvalue()


def test_bench_writes_well_formed_json(bench_run: tuple[dict, str]) -> None:
    data, _ = bench_run
    assert validate(data) is data and data["schema"] == SCHEMA
    m = data["machine"]
    assert m["backend"] == "mlx" and m["device"] in ("cpu", "metal") and "mlx" in m["versions"]
    assert data["settings"] == {"prompt_tokens": 16, "gen_tokens": 4, "repeats": 2, "batches": [1, 2],
                                "contexts": [0, 32], "skipped_contexts": []}
    assert [(r["batch"], r["context"]) for r in data["rows"]] == [(1, 0), (1, 32), (2, 0), (2, 32)]
    for r in data["rows"]:
        assert len(r["pp"]["values"]) == 2 and len(r["tg"]["values"]) == 2
        assert r["pp"]["mean"] > 0 and r["tg"]["mean"] > 0 and r["peak_memory_bytes"] > 0
        # the 32-token prefix comes from the prefix cache: only the fresh tokens are prefilled, never fewer
        assert r["pp_tokens"] == 16 * r["batch"]
        assert r["tg_roofline_pct"] > 0 and r["pp_roofline_pct"] > 0
    rows = {(r["batch"], r["context"]): r for r in data["rows"]}
    weights = data["model"]["decode_bytes_per_token"]
    assert rows[1, 0]["decode_bytes_per_step"] > weights  # plus the KV of the tokens so far
    kv_1 = rows[1, 32]["decode_bytes_per_step"] - weights
    assert rows[2, 32]["decode_bytes_per_step"] - weights == pytest.approx(2 * kv_1)  # weights once, KV per sequence
    json.dumps(data, allow_nan=False)  # strict JSON: no NaN or Infinity


def test_bench_markdown_table(bench_run: tuple[dict, str]) -> None:
    _, out = bench_run
    lines = [x for x in out.splitlines() if x.startswith("|")]
    assert lines[0] == "| model | backend | device | batch | test | t/s | % roofline | peak mem |"
    assert set(lines[1].replace("|", "").split()) <= {"---", "---:"}
    body = lines[2:]
    assert len(body) == 8  # 4 (batch, depth) points x (pp, tg)
    assert [x.split("|")[5].strip() for x in body[:4]] == ["pp16", "tg4", "pp16 @ d32", "tg4 @ d32"]
    assert all("±" in x and "%" in x for x in body)
    assert "decode roofline: 1000 GB/s" in out and "(measured: numpy copy, read + write bytes: best of 15" in out


def test_compare_prints_ratios_and_writes_png(bench_run: tuple[dict, str], tmp_path: Path) -> None:
    a, _ = bench_run
    b = copy.deepcopy(a)
    b["machine"]["chip"] = "Other machine"
    for r in b["rows"]:
        r["tg"]["mean"] *= 2
        r["pp"]["mean"] *= 0.5
    b["rows"] = b["rows"][:2]  # only the rows both measured are compared
    (tmp_path / "a.json").write_text(json.dumps(a))
    (tmp_path / "b.json").write_text(json.dumps(b))
    png = tmp_path / "plot.png"
    r = roofline("bench", "compare", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--png", str(png))
    assert r.returncode == 0, r.stderr
    table = [x.split() for x in r.stdout.splitlines() if x.startswith(("pp ", "tg "))]
    assert [(t[0], t[1], t[2], t[5]) for t in table] == [("pp", "1", "0", "0.50x"), ("tg", "1", "0", "2.00x"),
                                                         ("pp", "1", "32", "0.50x"), ("tg", "1", "32", "2.00x")]
    assert "Other machine" in r.stdout and "decode (tg) tokens/s" in r.stdout  # the terminal plot
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_compare_names_the_file_and_field_of_a_bad_json(bench_run: tuple[dict, str], tmp_path: Path) -> None:
    a, _ = bench_run
    good = tmp_path / "good.json"
    good.write_text(json.dumps(a))
    r = roofline("bench", "compare", str(good), str(tmp_path / "missing.json"))
    assert_one_line_error(r, "missing.json", "no such file")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert_one_line_error(roofline("bench", "compare", str(bad), str(good)), "bad.json", "not JSON")
    broken = copy.deepcopy(a)
    del broken["rows"][1]["tg"]["mean"]
    bad.write_text(json.dumps(broken))
    assert_one_line_error(roofline("bench", "compare", str(good), str(bad)), "bad.json", "rows[1].tg.mean is missing")
    broken = copy.deepcopy(a)
    broken["schema"] = "something-else"
    bad.write_text(json.dumps(broken))
    assert_one_line_error(roofline("bench", "compare", str(good), str(bad)), "bad.json", "schema")
    broken = copy.deepcopy(a)
    broken["machine"]["peak_bandwidth"] = "fast"
    bad.write_text(json.dumps(broken))
    assert_one_line_error(roofline("bench", "compare", str(bad), str(good)), "machine.peak_bandwidth",
                          "wrong type")


@pytest.mark.parametrize(("args", "needles"), [
    (("--batch", "0"), ("--batch", "below 1")),
    (("--batch", "1,x"), ("--batch", "comma-separated integers")),
    (("--context", "-5"), ("--context", "below 0")),
    (("-n", "1"), ("-n 1", ">= 2")),
    (("--backend", "mlx", "--device", "cuda"), ("--device cuda", "--backend torch")),  # auto: cuda picks torch
    (("--backend", "mlx", "--no-cuda-graphs"), ("--no-cuda-graphs", "--backend torch")),
])
def test_bad_bench_input_is_one_clear_line(args: tuple[str, ...], needles: tuple[str, ...]) -> None:
    assert_one_line_error(roofline("bench", *args), *needles)


def in_process(capsys: pytest.CaptureFixture, *args: str) -> subprocess.CompletedProcess:
    """main() in this process (MLX already imported: faster than a subprocess), as a CompletedProcess."""
    from app.cli import main

    rc = main(list(args))
    out = capsys.readouterr()
    return subprocess.CompletedProcess(args, rc, out.out, out.err)


def test_context_beyond_the_model_is_one_clear_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    model = random_llama_folder(tmp_path / "tiny")
    r = in_process(capsys, "bench", "--model", str(model), "--context", "500", "-p", "16", "-n", "4")
    assert_one_line_error(r, "--context 500", "context is 512")


def test_cuda_without_cuda_is_one_clear_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from tests.support.torch_support import require

    require("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    model = random_llama_folder(tmp_path / "tiny")
    r = in_process(capsys, "bench", "--model", str(model), "--backend", "torch", "--device", "cuda", "-p", "8",
                   "-n", "2", "--batch", "1", "--context", "0", "--repeats", "1")
    assert_one_line_error(r, "cuda")


def test_bench_on_the_torch_backend(tmp_path: Path, home: Path, capsys: pytest.CaptureFixture,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.support.torch_support import require

    require("torch")
    monkeypatch.setenv("ROOFLINE_HOME", str(home))
    model = random_llama_folder(tmp_path / "tiny")
    out = tmp_path / "torch.json"
    r = in_process(capsys, "bench", "--model", str(model), "--backend", "torch", "--device", "cpu", "-p", "8",
                   "-n", "3", "--batch", "1,2", "--context", "0", "--repeats", "1", "--json", str(out))
    assert r.returncode == 0, r.stderr
    data = validate(json.loads(out.read_text()))
    assert (data["machine"]["backend"], data["machine"]["device"]) == ("torch", "cpu")
    assert [r["batch"] for r in data["rows"]] == [1, 2] and all(r["tg"]["mean"] > 0 for r in data["rows"])


def test_depths_beyond_the_context_are_skipped_and_said(tmp_path: Path, home: Path, capsys: pytest.CaptureFixture,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The default sweep's deeper contexts on a 512-token model: the depths that fit are measured, the others
    named on stderr, in the table's header and in the JSON."""
    monkeypatch.setenv("ROOFLINE_HOME", str(home))
    model = random_llama_folder(tmp_path / "tiny")
    out = tmp_path / "skip.json"
    r = in_process(capsys, "bench", "--model", str(model), "-p", "8", "-n", "3", "--batch", "1", "--context",
                   "0,32,600,4096", "--repeats", "1", "--json", str(out))
    assert r.returncode == 0, r.stderr
    assert "skipping --context 600: with -p 8 -n 3 it needs 609 tokens and the model's context is 512" in r.stderr
    assert "skipping --context 4096" in r.stderr and "skipped: --context 600,4096" in r.stdout
    data = validate(json.loads(out.read_text()))
    assert data["settings"]["contexts"] == [0, 32] and data["settings"]["skipped_contexts"] == [600, 4096]
    assert [(row["batch"], row["context"]) for row in data["rows"]] == [(1, 0), (1, 32)]


def test_rows_print_as_they_finish_off_a_terminal_and_ctrl_c_keeps_them(tmp_path: Path, home: Path) -> None:
    """stdout a pipe, as in `roofline bench | tee`: each point's rows arrive while the sweep runs, and SIGINT after
    the first keeps what was measured (on stdout and in --json, marked interrupted), exit code 130."""
    import os
    import signal
    import sys

    model = random_llama_folder(tmp_path / "tiny")
    out = tmp_path / "partial.json"
    # a sweep of minutes, so that the signal lands inside it; SIGINT as a terminal delivers it (a test run in the
    # background of a non-interactive shell ignores SIGINT, and a child would inherit that)
    proc = subprocess.Popen([sys.executable, "-m", "app.cli", "bench", "--model", str(model), "-p", "8", "-n", "200",
                             "--batch", "1,2,3,4,5,6,7,8", "--context", "0,16,32,64", "--repeats", "5", "--json",
                             str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "ROOFLINE_HOME": str(home)},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if " tg200 " in line:  # the first point is done: the sweep has 31 to go
            proc.send_signal(signal.SIGINT)
            break
    rest, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "interrupted: kept the" in err
    data = validate(json.loads(out.read_text()))
    assert data["interrupted"] is True and 1 <= len(data["rows"]) < 32
    printed = [x for x in (lines + rest.splitlines(keepends=True)) if " pp8 " in x or " tg200 " in x]
    assert len(printed) == 2 * len(data["rows"])


def test_a_batch_the_engine_cannot_run_at_once_is_refused_before_measuring() -> None:
    """`run_bench` asks the engine's scheduler (through Engine.diagnostics) how many sequences run at once: a
    contiguous cache runs one, and a max_seqs load option below the batch would queue it and fake the rate."""
    from app.bench.sweep import _allow_batch
    from mlx_engine import Engine
    from mlx_engine.api import RooflineError
    from tests.support.tiny_models import GOLDEN

    with Engine.load(str(GOLDEN / "llama"), paged_kv=False) as e:
        with pytest.raises(RooflineError, match="contiguous KV cache here, which holds one sequence at a time"):
            _allow_batch(e, 2)
        _allow_batch(e, 1)
    with Engine.load(str(GOLDEN / "llama"), max_seqs=2) as e:
        _allow_batch(e, 2)
        with pytest.raises(RooflineError, match=r"runs 2 sequences at once .*max_seqs=4"):
            _allow_batch(e, 4)
