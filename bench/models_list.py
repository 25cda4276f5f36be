"""`roofline models` over 50 models (issue 24): its wall time cold (no header cache) and warm, against
huggingface_hub's own `scan_cache_dir` (a file-system walk that reads no header) over the same cache.

    uv run python bench/models_list.py [--models 50] [--repeats 5]

A temporary home holds the models as a user's machine would: GGUF repos in the Hugging Face cache, Ollama
manifests and blobs, LM Studio folders, each file a hard link to the embedded SmolLM2 GGUF (98 MB, a 49K-token
vocabulary with its merges: what a header read steps over), so nothing is copied. Each listing runs as
`roofline models --json` in a fresh process, as a user runs it; the figures are the median of the repeats.
Prints a markdown section for docs/benchmarks/models-list.md on stdout.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mlx_engine.loading import embedded_model_path  # noqa: E402


def build_home(home: Path, n: int, gguf: Path) -> None:
    hub = home / ".cache" / "huggingface" / "hub"
    ollama = home / ".ollama" / "models"
    lms = home / ".lmstudio" / "models"
    for i in range(n):
        kind = i % 3
        if kind == 0:
            repo = hub / f"models--org--model-{i}-GGUF"
            commit = hashlib.sha1(str(i).encode()).hexdigest()
            (repo / "blobs").mkdir(parents=True)
            (repo / "snapshots" / commit).mkdir(parents=True)
            blob = repo / "blobs" / hashlib.sha256(str(i).encode()).hexdigest()
            os.link(gguf, blob)
            (repo / "snapshots" / commit / f"model-{i}-Q4_1.gguf").symlink_to(Path("../../blobs") / blob.name)
            (repo / "refs").mkdir()
            (repo / "refs" / "main").write_text(commit)
        elif kind == 1:
            digest = hashlib.sha256(f"ollama{i}".encode()).hexdigest()
            (ollama / "blobs").mkdir(parents=True, exist_ok=True)
            os.link(gguf, ollama / "blobs" / f"sha256-{digest}")
            manifest = {"schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
                        "layers": [{"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{digest}",
                                    "size": gguf.stat().st_size}]}
            path = ollama / "manifests" / "registry.ollama.ai" / "library" / f"model{i}" / "latest"
            path.parent.mkdir(parents=True)
            path.write_text(json.dumps(manifest))
        else:
            folder = lms / "pub" / f"model-{i}-GGUF"
            folder.mkdir(parents=True)
            os.link(gguf, folder / f"model-{i}-Q4_1.gguf")


def timed(cmd: list[str], env: dict[str, str]) -> tuple[float, str]:
    t = time.perf_counter()
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise SystemExit(r.stderr)
    return time.perf_counter() - t, r.stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    gguf = embedded_model_path()
    with tempfile.TemporaryDirectory(dir=gguf.parent.parent) as tmp:  # same file system: hard links
        home = Path(tmp)
        build_home(home, args.models, gguf)
        # a user's install keeps bytecode: without it every start compiles ~170 modules (0.4 s quiet), which a
        # sandbox's PYTHONDONTWRITEBYTECODE would add to every figure
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("HF_", "OLLAMA_", "XDG_")) and k != "PYTHONDONTWRITEBYTECODE"}
        env.update(HOME=str(home), ROOFLINE_HOME=str(home / "roofline"), HF_HUB_OFFLINE="1")
        listing = [sys.executable, "-m", "app.cli", "models", "--json"]
        timed(listing, {**env, "ROOFLINE_CACHE_DIR": str(home / "cache-warmup")})  # writes the bytecode, untimed
        cold, warm, scan = [], [], []
        for r in range(args.repeats):
            env["ROOFLINE_CACHE_DIR"] = str(home / f"cache-{r}")
            seconds, out = timed(listing, env)
            cold.append(seconds)
            assert len(json.loads(out)) == args.models + 1, "every model listed, and the embedded one"
            warm.append(timed(listing, env)[0])
            scan.append(timed([sys.executable, "-c", "from huggingface_hub import scan_cache_dir; scan_cache_dir()"],
                              {**env, "HF_HUB_CACHE": str(home / ".cache" / "huggingface" / "hub")})[0])
        start = timed([sys.executable, "-c", "import app.cli"], env)[0]
    c, w, s = (statistics.median(x) for x in (cold, warm, scan))
    load = os.getloadavg()[0]
    print(f"## Issue 24: `roofline models` over {args.models} models\n")
    print(f"- Command: `uv run python bench/models_list.py --models {args.models} --repeats {args.repeats}`; "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, load {load:.1f}, "
          f"{datetime.date.today()}.")
    print(f"- {args.models} GGUF models (a third each in the Hugging Face cache, Ollama's store and LM Studio's "
          "folder), each a hard link to the embedded SmolLM2 (98 MB, 49K-token vocabulary).\n")
    print("| | median wall time | per model |")
    print("|---|---:|---:|")
    print(f"| `roofline models --json`, cold (no header cache: every header read) | {c:.2f} s | {c / args.models * 1e3:.0f} ms |")
    print(f"| `roofline models --json`, warm (headers cached by size and mtime) | {w:.2f} s | {w / args.models * 1e3:.1f} ms |")
    print(f"| peer: `huggingface_hub.scan_cache_dir()` (its third of the models, no header read) | {s:.2f} s | |")
    print(f"| a Python start-up importing `app.cli` (in both of ours) | {start:.2f} s | |\n")
    print(f"- Warm against the peer: {w / s:.2f}x its time, listing three stores with headers, sizes and fits "
          f"where it walks one cache. Cold, each header costs {(c - w) / args.models * 1e3:.0f} ms: the vocabulary "
          "and merges are stepped over string by string (GGUF has no index), once per file and version.")


if __name__ == "__main__":
    main()
