"""Model stores as other tools leave them on disk, for the lister's and the server's tests."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def hf_cache_entry(hub: Path, repo_id: str, files: dict[str, Path]) -> Path:
    """huggingface_hub's layout: blobs named by their sha256, snapshot links to them, refs/main."""
    repo = hub / f"models--{repo_id.replace('/', '--')}"
    snap = repo / "snapshots" / COMMIT
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for name, src in files.items():
        sha = hashlib.sha256(src.read_bytes()).hexdigest()
        shutil.copy(src, repo / "blobs" / sha)
        (snap / name).symlink_to(Path("../../blobs") / sha)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return snap
