"""`roofline rm REF`: what removing a model deletes, and deleting it.

Each store is emptied its own way: a Hugging Face cache repo as huggingface_hub's cache cleaner does (the whole
repo folder, or one GGUF quantization's snapshot links and the blobs no other link uses), an Ollama model as
`ollama rm` does (its manifest, and the blobs no other manifest names), an LM Studio model as its file (a split
GGUF's parts) or its folder. The embedded model and paths of the user's own are never deleted.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from mlx_engine.api import ModelLoadError
from mlx_engine.loading import sources


@dataclass
class Removal:
    ref: str
    where: str  # in words, for the question
    paths: list[Path] = field(default_factory=list)  # files and folders to delete
    size_bytes: int = 0
    empty_dirs: list[Path] = field(default_factory=list)  # removed afterwards when left empty


def _size(p: Path) -> int:
    if p.is_symlink():
        return 0
    if p.is_file():
        return p.stat().st_size
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file() and not f.is_symlink())


def _hf_removal(repo_id: str, tag: str | None) -> Removal:
    folder = sources.repo_folder(repo_id)
    if not folder.is_dir():
        raise ModelLoadError(f"{repo_id}: not in the Hugging Face cache ({sources.hf_cache_dir()})")
    if tag is None:
        return Removal(repo_id, f"the Hugging Face cache, {folder}", [folder], _size(folder))
    snap = sources.cached_snapshot(repo_id)
    entries = {ref.partition(":")[2]: path for ref, path, kind in sources.hf_entries(snap, repo_id)
               if kind == "gguf"} if snap else {}
    if tag.lower() not in {k.lower() for k in entries}:
        raise ModelLoadError(f"{repo_id}:{tag}: no such quantization in the Hugging Face cache "
                             f"(there: {', '.join(entries) or 'none'})")
    label = next(k for k in entries if k.lower() == tag.lower())
    assert snap is not None
    names = [str(p.relative_to(snap)) for p in snap.rglob("*.gguf")]
    files = sources.group_gguf_files(names)[label]
    links = [s / f for s in (folder / "snapshots").iterdir() for f in files if (s / f).exists() or (s / f).is_symlink()]
    others = {os.path.realpath(p) for p in (folder / "snapshots").rglob("*") if p.is_symlink() and p not in links}
    blobs = {Path(os.path.realpath(p)) for p in links if p.is_symlink()} - {Path(o) for o in others}
    paths = links + sorted(blobs)
    size = sum(b.stat().st_size for b in blobs if b.exists()) + sum(_size(p) for p in links if not p.is_symlink())
    if len(entries) == 1 and not (snap / "config.json").exists():  # nothing else there: the whole repo goes
        return Removal(f"{repo_id}:{label}", f"the Hugging Face cache, {folder}", [folder], _size(folder))
    return Removal(f"{repo_id}:{label}", f"the Hugging Face cache, {folder}", paths, size)


def _ollama_removal(name: str) -> Removal:
    root, manifest = sources.ollama_manifest(name)

    def digests(m: Path) -> set[str]:
        try:
            data = json.loads(m.read_text())
            layers = list(data.get("layers", [])) + [data.get("config") or {}]
            return {str(lay.get("digest")) for lay in layers if isinstance(lay, dict) and lay.get("digest")}
        except (OSError, ValueError, AttributeError):
            return set()

    mine = digests(manifest)
    others: set[str] = set()
    for m in (root / "manifests").glob("*/*/*/*"):
        if m.is_file() and m != manifest:
            others |= digests(m)
    blobs = [root / "blobs" / d.replace(":", "-") for d in sorted(mine - others)]
    blobs = [b for b in blobs if b.is_file()]
    return Removal(f"ollama:{name}", f"Ollama's store, {root}", [manifest, *blobs], sum(b.stat().st_size for b in blobs),
                   [manifest.parent, manifest.parent.parent])


def _lmstudio_removal(spec: str) -> Removal:
    path, kind = sources.resolve_lmstudio(spec)
    if kind == "folder":
        return Removal(f"lmstudio:{spec}", f"LM Studio's models folder, {path.parent.parent}", [path], _size(path),
                       [path.parent])
    parts = [path]
    files = sources.group_gguf_files([p.name for p in path.parent.glob("*.gguf")]).get(
        sources.gguf_quant_label(path.name), [])
    if path.name in files:
        parts = [path.parent / f for f in files]
    return Removal(f"lmstudio:{spec}", f"LM Studio's models folder, {path.parent.parent.parent}", parts,
                   sum(p.stat().st_size for p in parts), [path.parent, path.parent.parent])


def removal(ref: str) -> Removal:
    """What `rm` of `ref` deletes; ModelLoadError (one line) for a ref it does not delete."""
    ref = ref.strip()
    if not ref or ref == sources.EMBEDDED_REF:
        raise ModelLoadError("the embedded model ships inside Roofline's package and cannot be removed")
    if ref.startswith(sources.OLLAMA):
        return _ollama_removal(ref[len(sources.OLLAMA):])
    if ref.startswith(sources.LMSTUDIO):
        return _lmstudio_removal(ref[len(sources.LMSTUDIO):])
    if Path(ref).expanduser().exists():
        raise ModelLoadError(f"{ref}: a file or folder of yours, not a store's model: `roofline rm` removes models "
                             "from the Hugging Face cache, Ollama and LM Studio; delete it yourself")
    hf = sources.parse_hf_ref(ref)
    if hf is None:
        raise ModelLoadError(f"{ref!r}: not a model ref (expected ORG/NAME[:QUANT], ollama:NAME[:TAG] or "
                             "lmstudio:PUBLISHER/REPO[/FILE])")
    return _hf_removal(*hf)


def remove(r: Removal) -> int:
    """Deletes what `r` names; returns the bytes freed."""
    for p in r.paths:
        if p.is_symlink() or p.is_file():
            p.unlink(missing_ok=True)
        elif p.is_dir():
            shutil.rmtree(p)
    for d in r.empty_dirs:
        try:
            d.rmdir()  # only when empty
        except OSError:
            pass
    return r.size_bytes
