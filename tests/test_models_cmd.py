"""`roofline models` on a temporary home holding a Hugging Face cache entry, an Ollama store (manifest and blobs, in
Ollama's own format) and LM Studio folders: all listed from their headers, and each `ref` loads and generates
through `-m`; `rm`; bad refs are one line each."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.cli import one_line_error
from tests.support.model_stores import hf_cache_entry
from tests.support.tiny_models import random_llama_folder, write_gguf_from_folder
from tests.support.tokenizer_files import write_tokenizer

ROOT = Path(__file__).resolve().parent.parent


def ollama_model(root: Path, name: str, tag: str, gguf: Path, extra_blob: bytes = b"{{ .Prompt }}") -> Path:
    """A model as `ollama pull` leaves it: a Docker v2 manifest naming sha256 blobs (model, template, params)."""
    def blob(data: bytes) -> dict:
        digest = hashlib.sha256(data).hexdigest()
        (root / "blobs").mkdir(parents=True, exist_ok=True)
        (root / "blobs" / f"sha256-{digest}").write_bytes(data)
        return {"digest": f"sha256:{digest}", "size": len(data)}

    manifest = {
        "schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
        "config": {"mediaType": "application/vnd.docker.container.image.v1+json", **blob(b'{"model_format":"gguf"}')},
        "layers": [{"mediaType": "application/vnd.ollama.image.model", **blob(gguf.read_bytes())},
                   {"mediaType": "application/vnd.ollama.image.template", **blob(extra_blob)},
                   {"mediaType": "application/vnd.ollama.image.params", **blob(b'{"stop":["</s>"]}')}],
    }
    path = root / "manifests" / "registry.ollama.ai" / "library" / name / tag
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(manifest))
    return path


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("home")
    src = tmp_path_factory.mktemp("src")
    folder = write_tokenizer(random_llama_folder(src / "tiny", layers=2, seed=5))
    q8, q4 = src / "tiny-Q8_0.gguf", src / "tiny-Q4_0.gguf"
    write_gguf_from_folder(folder, q8, {}, "Q8_0")
    write_gguf_from_folder(folder, q4, {}, "Q4_0")
    hub = tmp / ".cache" / "huggingface" / "hub"
    hf_cache_entry(hub, "org/tiny", {p.name: p for p in folder.iterdir()})
    hf_cache_entry(hub, "org/tiny-gguf", {"tiny-Q8_0.gguf": q8})
    ollama = tmp / ".ollama" / "models"
    ollama_model(ollama, "tiny", "latest", q8)
    ollama_model(ollama, "tiny", "q4", q4)
    broken = ollama_model(ollama, "broken", "latest", q8, extra_blob=b"other")
    data = json.loads(broken.read_text())
    data["layers"][0]["digest"] = "sha256:" + "f" * 64  # its model blob is missing
    broken.write_text(json.dumps(data))
    lms = tmp / ".lmstudio" / "models"
    (lms / "pub" / "tiny-GGUF").mkdir(parents=True)
    shutil.copy(q4, lms / "pub" / "tiny-GGUF" / "tiny-Q4_0.gguf")
    shutil.copytree(folder, lms / "pub" / "tiny-mlx")
    (lms / "pub" / "bad-GGUF").mkdir()
    (lms / "pub" / "bad-GGUF" / "bad-Q4_0.gguf").write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 64)  # corrupt
    added = src / "mine.gguf"
    shutil.copy(q8, added)
    code = ("import json, sys\nfrom app.tui.store import ChatStore\n"
            "ChatStore(sys.argv[1]).set_pref('model_paths', json.dumps([sys.argv[2]]))\n")
    (tmp / "roofline").mkdir()
    subprocess.run([sys.executable, "-c", code, str(tmp / "roofline" / "chats.db"), str(added)], cwd=ROOT, check=True)
    (tmp / "sources.json").write_text(json.dumps({"folder": str(folder), "q8": str(q8), "q4": str(q4),
                                                  "added": str(added)}))
    return tmp


def env_for(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HF_", "HUGGINGFACE_", "OLLAMA_", "XDG_")) and k != "ROOFLINE_HOME"}
    env.update(HOME=str(home), ROOFLINE_HOME=str(home / "roofline"), HF_HUB_OFFLINE="1")
    return env


def roofline(home: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "app.cli", *args], cwd=ROOT, env=env_for(home), capture_output=True,
                          text=True, timeout=180)


def test_models_json_lists_every_source_from_headers(home: Path) -> None:
    src = {k: Path(v) for k, v in json.loads((home / "sources.json").read_text()).items()}
    r = roofline(home, "models", "--json")
    assert r.returncode == 0, r.stderr
    rows = {m["ref"]: m for m in json.loads(r.stdout)}
    expected = {
        "embedded": ("embedded", "gguf", "Q4_1"),
        "org/tiny": ("hf-cache", "safetensors", "fp32"),
        "org/tiny-gguf:Q8_0": ("hf-cache", "gguf", "Q8_0"),
        "ollama:tiny:latest": ("ollama", "gguf", "Q8_0"),
        "ollama:tiny:q4": ("ollama", "gguf", "Q4_0"),
        "lmstudio:pub/tiny-GGUF/tiny-Q4_0.gguf": ("lmstudio", "gguf", "Q4_0"),
        "lmstudio:pub/tiny-mlx": ("lmstudio", "safetensors", "fp32"),
        str(src["added"]): ("path", "gguf", "Q8_0"),
    }
    bad = rows.pop("lmstudio:pub/bad-GGUF/bad-Q4_0.gguf")  # listed, with what is wrong, never raised
    assert bad["source"] == "lmstudio" and "corrupt or truncated GGUF file" in bad["error"]
    assert set(rows) == set(expected)
    for ref, (source, fmt, quant) in expected.items():
        m = rows[ref]
        assert (m["source"], m["format"], m["quantization"]) == (source, fmt, quant), ref
        assert m["error"] is None and m["fits"] is True and m["need_bytes"] > 0, ref
    tiny = [m for ref, m in rows.items() if ref != "embedded"]
    assert {m["num_parameters"] for m in tiny} == {rows["org/tiny"]["num_parameters"]}  # one model, six ways
    assert {m["context_length"] for m in tiny} == {512}
    assert rows["ollama:tiny:latest"]["size_bytes"] == src["q8"].stat().st_size
    assert rows["lmstudio:pub/tiny-GGUF/tiny-Q4_0.gguf"]["size_bytes"] == src["q4"].stat().st_size
    assert rows["org/tiny"]["size_bytes"] == sum(p.stat().st_size for p in src["folder"].iterdir())
    assert "ollama:broken:latest: its model blob" in r.stderr and "missing" in r.stderr
    table = roofline(home, "models")
    assert table.returncode == 0 and table.stdout.splitlines()[0].split() == \
        ["REF", "SOURCE", "FORMAT", "QUANT", "PARAMS", "SIZE", "CONTEXT", "FITS"]


def test_each_ref_loads_and_generates_through_dash_m(home: Path) -> None:
    src = json.loads((home / "sources.json").read_text())
    refs = ["org/tiny", "org/tiny-gguf:Q8_0", "ollama:tiny", "ollama:tiny:q4", "lmstudio:pub/tiny-GGUF",
            "lmstudio:pub/tiny-mlx", src["added"], "embedded"]
    code = ("import contextlib, io, json, sys\nfrom app.cli import main\nout = {}\n"
            "for ref in sys.argv[1:]:\n    buf = io.StringIO()\n    with contextlib.redirect_stdout(buf):\n"
            "        rc = main(['generate', '-m', ref, '-p', 'hi', '-n', '4', '--json'])\n"
            "    out[ref] = (rc, json.loads(buf.getvalue()) if rc == 0 else None)\nprint(json.dumps(out))\n")
    r = subprocess.run([sys.executable, "-c", code, *refs], cwd=ROOT, env=env_for(home), capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.splitlines()[-1])
    for ref in refs:
        rc, reply = out[ref]
        assert rc == 0 and reply["usage"]["completion_tokens"] == 4, (ref, r.stderr)
    assert out["ollama:tiny"][1]["model"] == "ollama:tiny"  # the ref, not the blob's sha256 file name
    assert out["ollama:tiny"][1]["text"] == out[src["added"]][1]["text"]  # the same GGUF, greedy
    assert out["lmstudio:pub/tiny-GGUF"][1]["text"] == out["ollama:tiny:q4"][1]["text"]


@pytest.mark.parametrize("ref, words", [
    ("ollama:nope", "ollama:nope:latest: not in Ollama's store"),
    ("ollama:", "expected ollama:NAME[:TAG]"),
    ("ollama:a/b/c/d", "expected ollama:NAME[:TAG]"),
    ("ollama:broken", "its model blob"),
    ("lmstudio:pub", "expected lmstudio:PUBLISHER/REPO[/FILE.gguf]"),
    ("lmstudio:pub/none", "not in LM Studio's models folder"),
    ("lmstudio:pub/tiny-GGUF/nope.gguf", "no file 'nope.gguf'"),
    ("org/tiny-gguf:Q5_K_M", "no 'Q5_K_M' quantization (there: Q8_0)"),
    ("org/absent", "'org/absent' is not in the local Hugging Face cache and HF_HUB_OFFLINE is set"),
    ("./not/here.gguf", "model not found"),
    ("lmstudio:pub/bad-GGUF", "corrupt or truncated GGUF file"),
])
def test_a_bad_ref_is_one_line(home: Path, ref: str, words: str) -> None:
    line = one_line_error(roofline(home, "generate", "-m", ref, "-p", "hi"))
    assert words in line, line


def test_rm_asks_and_removes_each_store_its_own_way(home: Path, tmp_path: Path) -> None:
    mine = tmp_path / "home"
    shutil.copytree(home, mine, symlinks=True)
    line = one_line_error(roofline(mine, "rm", "org/tiny"))  # not a terminal: nobody to ask
    assert "pass --yes" in line
    assert (mine / ".cache" / "huggingface" / "hub" / "models--org--tiny").exists()
    ollama = mine / ".ollama" / "models"
    blobs = set((ollama / "blobs").iterdir())
    r = roofline(mine, "rm", "ollama:tiny:q4", "--yes")
    assert r.returncode == 0 and "removed ollama:tiny:q4" in r.stderr, r.stderr
    gone = blobs - set((ollama / "blobs").iterdir())
    q4 = hashlib.sha256(Path(json.loads((home / "sources.json").read_text())["q4"]).read_bytes()).hexdigest()
    assert {b.name for b in gone} == {f"sha256-{q4}"}  # the template, params and config blobs are shared
    assert not (ollama / "manifests" / "registry.ollama.ai" / "library" / "tiny" / "q4").exists()
    for ref in ("org/tiny", "org/tiny-gguf:Q8_0", "lmstudio:pub/tiny-GGUF/tiny-Q4_0.gguf", "lmstudio:pub/tiny-mlx",
                "lmstudio:pub/bad-GGUF/bad-Q4_0.gguf"):  # a corrupt file goes too
        r = roofline(mine, "rm", ref, "--yes")
        assert r.returncode == 0, r.stderr
    refs = {m["ref"] for m in json.loads(roofline(mine, "models", "--json").stdout)}
    assert not any(r.startswith(("org/", "lmstudio:")) for r in refs) and "ollama:tiny:latest" in refs
    assert not (mine / ".cache" / "huggingface" / "hub" / "models--org--tiny-gguf").exists()
    assert not (mine / ".lmstudio" / "models" / "pub" / "tiny-GGUF").exists()
    src = json.loads((home / "sources.json").read_text())
    for ref, words in (("embedded", "cannot be removed"), (src["added"], "delete it yourself"),
                       ("org/never", "not in the Hugging Face cache"), ("ollama:nope", "not in Ollama's store")):
        assert words in one_line_error(roofline(mine, "rm", ref, "--yes"))
    assert Path(src["added"]).exists()
