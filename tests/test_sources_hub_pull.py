"""`roofline pull` and `-m ORG/NAME` against a local Hub (tests/support/hub_server.py), driven by the real
huggingface_hub client: a pull, a resume after a dropped connection and after Ctrl+C, a missing / gated / private
repo, no network, too little disk, a GGUF quantization choice; the pulled model then loads with HF_HUB_OFFLINE=1."""

from __future__ import annotations

import hashlib
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

from tests.support.cli import one_line_error
from tests.support.hub_server import FakeHub
from tests.support.tiny_models import random_llama_folder, write_gguf_from_folder
from tests.support.tokenizer_files import write_tokenizer

ROOT = Path(__file__).resolve().parent.parent
IDS = [1, 5, 9, 17, 33, 65, 3, 7]


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("hub-src")
    folder = write_tokenizer(random_llama_folder(tmp / "tiny", layers=2, seed=3))
    q8, q4 = tmp / "tiny-Q8_0.gguf", tmp / "tiny-Q4_0.gguf"
    write_gguf_from_folder(folder, q8, {}, "Q8_0")
    write_gguf_from_folder(folder, q4, {}, "Q4_0")
    # past huggingface_hub's 10 MiB download chunk, which is what a dropped or stopped download keeps
    big = write_tokenizer(random_llama_folder(tmp / "big", head_dim=64, hidden=256, vocab=12288, seed=4))
    return {"folder": folder, "q8": q8, "q4": q4, "big": big}


CHUNK = 10 * 2**20  # huggingface_hub.constants.DOWNLOAD_CHUNK_SIZE: bytes reach the file a chunk at a time


def folder_files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


@pytest.fixture
def hub(sources: dict[str, Path]):
    with FakeHub() as h:
        files = folder_files(sources["folder"])
        h.add("org/tiny", {**files, "README.md": b"# tiny\n", "original/consolidated.pth": b"x" * 100})
        h.add("org/tiny-gguf", {"tiny-Q8_0.gguf": sources["q8"].read_bytes(), "tiny-Q4_0.gguf": sources["q4"].read_bytes(),
                                "README.md": b"# gguf\n"})
        h.add("org/private", files, private_token="hf_secret")
        h.add("org/gated", files, gated=True)
        h.add("org/huge", files, claimed_sizes={"model.safetensors": 10**15})
        h.add("org/big", folder_files(sources["big"]))
        yield h


def env_for(home: Path, hub: FakeHub | None, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env.update(HF_HOME=str(home / "hf"), HOME=str(home), ROOFLINE_HOME=str(home / "roofline"),
               HF_HUB_DISABLE_TELEMETRY="1", NO_PROXY="*", no_proxy="*")
    if hub is not None:
        env["HF_ENDPOINT"] = hub.url
    env.update(extra)
    return env


def roofline(env: dict[str, str], *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "app.cli", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def load_offline_logits(env: dict[str, str], ref: str) -> np.ndarray:
    code = ("import sys, numpy as np\nfrom mlx_engine import Engine\n"
            f"e = Engine.load({ref!r})\nnp.save(sys.argv[1], e.forward_logits({IDS!r}))\nprint(e.info.name)\n")
    out = Path(env["HOME"]) / "logits.npy"
    r = subprocess.run([sys.executable, "-c", code, str(out)], cwd=ROOT, env={**env, "HF_HUB_OFFLINE": "1"},
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == ref
    return np.load(out)


def reference_logits(path: Path) -> np.ndarray:
    from mlx_engine import Engine

    with Engine.load(str(path)) as e:
        return e.forward_logits(IDS)


def snapshot(home: Path, repo_id: str) -> Path:
    folder = home / "hf" / "hub" / f"models--{repo_id.replace('/', '--')}"
    commit = (folder / "refs" / "main").read_text()
    return folder / "snapshots" / commit


def test_pull_writes_the_hub_cache_layout_and_loads_offline(hub: FakeHub, sources, tmp_path: Path) -> None:
    env = env_for(tmp_path, hub)
    r = roofline(env, "pull", "org/tiny")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "org/tiny"
    assert "pulling org/tiny (3 files" in r.stderr and "(100%)" in r.stderr and "pulled org/tiny" in r.stderr
    snap = snapshot(tmp_path, "org/tiny")
    assert sorted(p.name for p in snap.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    for p in snap.iterdir():  # huggingface_hub's layout: snapshot links into content-addressed blobs
        assert p.is_symlink() and p.resolve().parent.name == "blobs"
        assert p.read_bytes() == (sources["folder"] / p.name).read_bytes()
    weights = (sources["folder"] / "model.safetensors").read_bytes()
    assert (snap / "model.safetensors").resolve().name == hashlib.sha256(weights).hexdigest()
    assert not (snap.parent.parent / ".roofline-pull.json").exists()
    fetched = {path for method, path, _ in hub.requests if method == "GET"}
    assert not any("README.md" in p or "consolidated" in p for p in fetched)  # only what a model needs
    np.testing.assert_array_equal(load_offline_logits(env, "org/tiny"), reference_logits(sources["folder"]))
    again = roofline(env, "pull", "org/tiny")  # already whole: nothing fetched again
    assert again.returncode == 0 and "already here" in again.stderr


def test_a_dropped_connection_resumes_from_the_bytes_it_has(hub: FakeHub, sources, tmp_path: Path) -> None:
    weights = (sources["big"] / "model.safetensors").read_bytes()
    assert len(weights) > 2 * CHUNK
    hub.drop_after["model.safetensors"] = CHUNK + 12345
    r = roofline(env_for(tmp_path, hub), "pull", "org/big")
    assert r.returncode == 0, r.stderr
    ranges = [rng for method, path, rng in hub.requests if path.endswith("/model.safetensors") and method == "GET"]
    assert ranges == [None, f"bytes={CHUNK}-"]  # the client asked for the rest, not the whole file again
    assert (snapshot(tmp_path, "org/big") / "model.safetensors").read_bytes() == weights


def test_ctrl_c_keeps_the_partial_file_and_the_next_pull_resumes(hub: FakeHub, sources, tmp_path: Path) -> None:
    weights = (sources["big"] / "model.safetensors").read_bytes()
    hub.hold_after["model.safetensors"] = CHUNK + 12345
    env = env_for(tmp_path, hub)
    # SIGINT as a terminal delivers it: a test run in the background of a non-interactive shell ignores SIGINT,
    # and the child would inherit that (then it finished the pull and exited 0)
    proc = subprocess.Popen([sys.executable, "-m", "app.cli", "pull", "org/big"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    partial = tmp_path / "hf" / "hub" / "models--org--big" / "blobs" / f"{hashlib.sha256(weights).hexdigest()}.incomplete"
    deadline = time.monotonic() + 60
    while not (partial.exists() and partial.stat().st_size >= CHUNK) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert partial.exists() and partial.stat().st_size == CHUNK, "the pull never reached the stall"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "`roofline pull org/big` resumes" in err
    assert partial.stat().st_size == CHUNK  # kept
    listed = roofline(env, "models", "--json")
    assert "org/big" not in {m["ref"] for m in json.loads(listed.stdout)}  # half a model is not a model
    assert "org/big: an unfinished pull" in listed.stderr
    line = one_line_error(roofline({**env, "HF_HUB_OFFLINE": "1"}, "generate", "-m", "org/big", "-p", "hi"))
    assert "'org/big' in the Hugging Face cache is not a whole model: an unfinished pull" in line
    hub.release()
    hub.requests.clear()
    r = roofline(env, "pull", "org/big")
    assert r.returncode == 0, r.stderr
    assert "10.5 MB already here" in r.stderr
    ranges = [rng for method, path, rng in hub.requests if path.endswith("/model.safetensors") and method == "GET"]
    assert ranges == [f"bytes={CHUNK}-"]
    assert (snapshot(tmp_path, "org/big") / "model.safetensors").read_bytes() == weights
    assert "org/big" in {m["ref"] for m in json.loads(roofline(env, "models", "--json").stdout)}


def test_gguf_repo_one_quantization_by_name(hub: FakeHub, sources, tmp_path: Path) -> None:
    env = env_for(tmp_path, hub)
    line = one_line_error(roofline(env, "pull", "org/tiny-gguf"))  # not a terminal: nobody to ask, so it lists them
    assert "org/tiny-gguf holds 2 quantizations (Q4_0 " in line and "Q8_0 " in line and "--quant" in line
    assert not any("/cdn/" in path for _, path, _ in hub.requests)
    r = roofline(env, "pull", "org/tiny-gguf", "--quant", "q4_0")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "org/tiny-gguf:Q4_0"
    fetched = [path for method, path, _ in hub.requests if method == "GET" and "/cdn/" in path]
    assert len(fetched) == 1 and fetched[0].endswith("tiny-Q4_0.gguf")
    logits = load_offline_logits(env, "org/tiny-gguf:Q4_0")
    np.testing.assert_array_equal(logits, reference_logits(sources["q4"]))
    one_line_error(roofline(env, "pull", "org/tiny-gguf", "--quant", "Q5_K_M"))
    r = roofline(env, "pull", "org/tiny-gguf:tiny-Q8_0.gguf")  # a file by name, after ':' as in -m
    assert r.returncode == 0 and r.stdout.strip() == "org/tiny-gguf:Q8_0", r.stderr


def test_dash_m_pulls_a_missing_repo_with_the_same_progress(hub: FakeHub, tmp_path: Path) -> None:
    r = roofline(env_for(tmp_path, hub), "generate", "-m", "org/tiny", "-p", "hi", "-n", "3", "--json")
    assert r.returncode == 0, r.stderr
    assert "pulling org/tiny (3 files" in r.stderr and "pulled org/tiny" in r.stderr
    out = json.loads(r.stdout)
    assert out["model"] == "org/tiny" and out["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("repo, extra, words", [
    ("org/missing", {}, "org/missing: no such model on the Hub"),
    ("org/private", {}, "org/private: no such model on the Hub (http://127.0.0.1"),
    ("org/gated", {}, "org/gated is gated: accept its terms at http://127.0.0.1"),
    ("org/huge", {}, "not enough disk space for org/huge: it needs 1000000.00 GB more"),
    ("org/tiny", {"HF_HUB_OFFLINE": "1"}, "cannot pull org/tiny: HF_HUB_OFFLINE is set"),
])
def test_each_failure_is_one_line_and_nothing_is_listed(hub: FakeHub, tmp_path: Path, repo, extra, words) -> None:
    env = env_for(tmp_path, hub, **extra)
    line = one_line_error(roofline(env, "pull", repo))
    assert words in line, line
    assert not any("/cdn/" in path for _, path, _ in hub.requests)  # refused before a byte of weights
    refs = {m["ref"] for m in json.loads(roofline(env, "models", "--json").stdout)}
    assert refs == {"embedded"}


def test_private_repo_with_its_token(hub: FakeHub, tmp_path: Path) -> None:
    r = roofline(env_for(tmp_path, hub, HF_TOKEN="hf_secret"), "pull", "org/private")
    assert r.returncode == 0, r.stderr
    cdn = [path for method, path, _ in hub.requests if "/cdn/" in path]
    assert cdn  # the weights came from the "CDN" host, to which the client sends no token


def test_no_network_and_a_bad_revision(hub: FakeHub, tmp_path: Path) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    line = one_line_error(roofline(env_for(tmp_path, None, HF_ENDPOINT=f"http://127.0.0.1:{port}"), "pull", "org/tiny"))
    assert f"cannot reach the Hub at http://127.0.0.1:{port}" in line
    line = one_line_error(roofline(env_for(tmp_path, None, HF_ENDPOINT=f"http://127.0.0.1:{port}"),
                                   "generate", "-m", "org/tiny", "-p", "hi"))
    assert "cannot reach the Hub" in line
    line = one_line_error(roofline(env_for(tmp_path, hub), "pull", "org/tiny", "--revision", "v9"))
    assert "org/tiny: no revision 'v9' on the Hub" in line
    one_line_error(roofline(env_for(tmp_path, hub), "pull", "not a repo"))


def test_disk_full_mid_file_is_one_line_and_keeps_what_it_has(hub: FakeHub, sources, tmp_path: Path) -> None:
    """A file-size limit stands in for a full disk: the write past it fails (EFBIG) as ENOSPC would."""
    import resource

    limit = 20_000
    code = ("import signal, sys\nsignal.signal(signal.SIGXFSZ, signal.SIG_IGN)\nfrom app.cli import main\n"
            "sys.exit(main(['pull', 'org/tiny']))\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env_for(tmp_path, hub), capture_output=True,
                       text=True, timeout=120,
                       preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)))
    line = one_line_error(r, after_progress=True)
    assert "disk full while pulling org/tiny" in line and "`roofline pull org/tiny` resumes" in line
    partials = list((tmp_path / "hf" / "hub" / "models--org--tiny" / "blobs").glob("*.incomplete"))
    assert [p.stat().st_size for p in partials] == [limit]
    r = roofline(env_for(tmp_path, hub), "pull", "org/tiny")
    assert r.returncode == 0, r.stderr
    weights = (sources["folder"] / "model.safetensors").read_bytes()
    assert (snapshot(tmp_path, "org/tiny") / "model.safetensors").read_bytes() == weights


def _run_in_a_terminal(env: dict[str, str], args: list[str], answer: str, prompt: str) -> tuple[int, str]:
    """Runs the CLI on a pseudo-terminal, types `answer` once `prompt` shows; (exit code, what the terminal showed)."""
    import fcntl
    import pty
    import select
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))  # a 100x30 terminal
    proc = subprocess.Popen([sys.executable, "-m", "app.cli", *args], cwd=ROOT, env={**env, "COLUMNS": "100"},
                            stdin=slave, stdout=slave, stderr=slave, close_fds=True)
    os.close(slave)
    seen, answered, deadline = b"", False, time.monotonic() + 120
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 0.1)
        if ready:
            try:
                chunk = os.read(master, 4096)
            except OSError:  # the child closed the terminal
                break
            if not chunk:
                break
            seen += chunk
        if not answered and prompt.encode() in seen:
            os.write(master, answer.encode())
            answered = True
        if proc.poll() is not None and not ready:
            break
    os.close(master)
    return proc.wait(timeout=60), seen.decode(errors="replace")


def test_on_a_terminal_it_asks_for_the_quantization_and_shows_a_bar(hub: FakeHub, tmp_path: Path) -> None:
    env = env_for(tmp_path, hub)
    rc, screen = _run_in_a_terminal(env, ["pull", "org/tiny-gguf"], "2\n", "which one?")
    assert rc == 0, screen
    assert "1. Q4_0" in screen and "2. Q8_0" in screen
    assert "org/tiny-gguf:Q8_0: 100%" in screen and "B/s" in screen  # tqdm's bar: bytes, rate
    rc, screen = _run_in_a_terminal(env, ["rm", "org/tiny-gguf:Q8_0"], "n\n", "[y/N]")
    assert rc == 1 and "kept" in screen
    rc, screen = _run_in_a_terminal(env, ["rm", "org/tiny-gguf:Q8_0"], "y\n", "[y/N]")
    assert rc == 0 and "removed org/tiny-gguf:Q8_0" in screen
    assert not (tmp_path / "hf" / "hub" / "models--org--tiny-gguf").exists()


async def test_the_app_pulls_a_missing_repo_and_shows_its_progress(hub: FakeHub, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from app.tui.app import RooflineApp
    from app.tui.backend import EngineBackend
    from app.tui.chat_screen import ChatScreen
    from tests.support.tui_helpers import wait_for

    for k, v in env_for(tmp_path, hub).items():
        if k.startswith("HF_"):
            monkeypatch.setenv(k, v)
    labels: list[str | None] = []
    original = ChatScreen.set_loading
    monkeypatch.setattr(ChatScreen, "set_loading", lambda self, label: (labels.append(label), original(self, label)))
    app = RooflineApp(backend=EngineBackend(), model="org/tiny", home=tmp_path / "app")
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: app.engine is not None, what="loaded", timeout=120)
        assert app.engine.info.name == "org/tiny"
    shown = [label for label in labels if label]
    assert shown[0] == "Loading org/tiny…" and any(label.startswith("Pulling org/tiny: ") for label in shown)
    assert "Pulled org/tiny; loading…" in shown
