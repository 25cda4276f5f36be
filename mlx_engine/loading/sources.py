"""Where models live on this machine, and the one `ref` syntax that names them everywhere `-m` is taken.

    (none), embedded              the embedded SmolLM2
    PATH                          a .gguf file, or a folder with config.json (or one .gguf)
    ORG/NAME[:QUANT|:FILE.gguf]   the Hugging Face cache (pulled through huggingface_hub when missing)
    ollama:NAME[:TAG]             Ollama's store: manifests/<host>/<namespace>/<name>/<tag> -> the GGUF blob
    lmstudio:PUBLISHER/REPO[/FILE] LM Studio's models folder: a GGUF file or an MLX / HF folder

Everything here reads directory entries and small JSON files only; no weights, no MLX.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from mlx_engine.api import ModelLoadError

OLLAMA, LMSTUDIO = "ollama:", "lmstudio:"
EMBEDDED_REF = "embedded"  # the embedded model, where a ref must be written out (`roofline models --json`)
OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"
OLLAMA_REGISTRY, OLLAMA_NAMESPACE, OLLAMA_TAG = "registry.ollama.ai", "library", "latest"
PULL_MARKER = ".roofline-pull.json"  # in a HF cache repo folder while a pull of it is unfinished


class IncompleteModel(ModelLoadError):
    """A repo in the Hugging Face cache that is only partly there (an unfinished pull): pulling again finishes it."""


@dataclass(frozen=True)
class LocalModel:
    """One model found in a store: what `-m` takes, where it is, and whether it is a GGUF file or a folder."""

    ref: str
    source: str  # "hf-cache", "ollama", "lmstudio"
    name: str
    path: Path
    kind: str  # "gguf" or "folder"
    size_bytes: int = 0  # 0: the files' own sizes


# ---- GGUF quantizations by file name (a repo's or a folder's several GGUF files) --------------------------

_QUANT = re.compile(r"(?i)(?:^|[-_.])((?:UD-)?(?:I?Q\d(?:_[A-Z0-9]+)*|BF16|F16|FP16|F32|MXFP4(?:_MOE)?|TQ\d_\d))"
                    r"(?=[-_.]|$)")
_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})$")


def gguf_quant_label(filename: str) -> str:
    """'Llama-3.2-1B-Instruct-Q4_K_M.gguf' -> 'Q4_K_M'; split parts share their label; no label: the stem."""
    stem = _SPLIT.sub("", Path(filename).name.removesuffix(".gguf"))
    found = _QUANT.findall(stem)
    return found[-1].upper() if found else stem


def group_gguf_files(names: list[str]) -> dict[str, list[str]]:
    """{quantization label: its files (a split model's parts in order)}, projector files (mmproj) left out."""
    out: dict[str, list[str]] = {}
    for n in sorted(names):
        base = n.rsplit("/", 1)[-1].lower()
        if not base.endswith(".gguf") or "mmproj" in base:
            continue
        out.setdefault(gguf_quant_label(n), []).append(n)
    return out


def split_parts_missing(files: list[str], exists) -> list[str]:
    """The parts of a split GGUF (`-00001-of-00003`) that `exists(name)` says are not there."""
    missing = []
    for f in files:
        m = _SPLIT.search(f.removesuffix(".gguf"))
        if m:
            total = int(m.group(2))
            prefix = f.removesuffix(".gguf")[: m.start()]
            missing += [p for i in range(1, total + 1) if not exists(p := f"{prefix}-{i:05d}-of-{total:05d}.gguf")]
    return sorted(set(missing))


def pick_gguf(groups: dict[str, list[str]], tag: str | None, where: str, ref_hint: str) -> str:
    """The file to load among `groups` for `tag` (a quantization label or a file name; None: the only one)."""
    if tag is not None:
        if tag.lower().endswith(".gguf"):
            for files in groups.values():
                for f in files:
                    if f == tag or f.rsplit("/", 1)[-1] == tag:
                        return files[0]
            raise ModelLoadError(f"{where}: no GGUF file {tag!r} (there: {_listing(groups)})")
        for label, files in groups.items():
            if label.lower() == tag.lower():
                return files[0]
        raise ModelLoadError(f"{where}: no {tag!r} quantization (there: {_listing(groups)})")
    if len(groups) == 1:
        return next(iter(groups.values()))[0]
    if not groups:
        raise ModelLoadError(f"{where}: no .gguf file and no config.json: not a model")
    raise ModelLoadError(f"{where} holds {len(groups)} quantizations ({_listing(groups)}): name one, e.g. "
                         f"{ref_hint}:{next(iter(groups))}")


def _listing(groups: dict[str, list[str]]) -> str:
    return ", ".join(groups) or "none"


# ---- the Hugging Face cache ------------------------------------------------------------------------------

def hf_cache_dir() -> Path:
    """huggingface_hub's cache folder as the environment names it now (HF_HUB_CACHE, HF_HOME, XDG_CACHE_HOME)."""
    if path := os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE"):
        return Path(path).expanduser()
    if home := os.environ.get("HF_HOME"):
        return Path(home).expanduser() / "hub"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "huggingface" / "hub"


def hf_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


_REPO_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def parse_hf_ref(ref: str) -> tuple[str, str | None] | None:
    """'org/name' or 'org/name:TAG' -> (repo id, TAG or None); None when `ref` is not shaped like one."""
    repo, _, tag = ref.partition(":")
    parts = repo.split("/")
    if len(parts) != 2 or not all(_REPO_PART.fullmatch(p) for p in parts) or ".." in repo:
        return None
    if repo.endswith((".gguf", ".safetensors", ".json")) or ref.startswith((".", "~")):
        return None
    return repo, (tag or None)


def repo_folder(repo_id: str) -> Path:
    return hf_cache_dir() / f"models--{repo_id.replace('/', '--')}"


def cached_snapshot(repo_id: str, revision: str = "main") -> Path | None:
    """The snapshot folder `revision` points to in the cache (no network), or None."""
    folder = repo_folder(repo_id)
    ref_file = folder / "refs" / revision
    commit = ref_file.read_text().strip() if ref_file.is_file() else revision
    snap = folder / "snapshots" / commit
    if snap.is_dir():
        return snap
    snaps = sorted((folder / "snapshots").glob("*"), key=lambda p: p.stat().st_mtime) if revision == "main" else []
    return snaps[-1] if snaps else None


def snapshot_problem(snapshot: Path) -> str | None:
    """Why a cached snapshot is not a whole model (an unfinished pull, a missing shard), or None."""
    marker = snapshot.parent.parent / PULL_MARKER
    if marker.is_file():
        try:
            plan = json.loads(marker.read_text())
            missing = [f for f in plan["files"] if not (snapshot / f).exists()] if plan["commit"] == snapshot.name else []
        except (OSError, ValueError, KeyError, TypeError):
            missing = ["?"]
        if missing:
            return f"an unfinished pull ({len(missing)} of its files still to come)"
    index = snapshot / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return f"{index.name} is unreadable"
        missing = sorted(s for s in shards if not (snapshot / s).exists())
        if missing:
            return f"missing {len(missing)} of its {len(shards)} weight shards ({missing[0]}, ...)"
    return None


def hf_entries(snapshot: Path, repo_id: str) -> list[tuple[str, Path, str]]:
    """(ref, path, kind) of each model in a complete snapshot: the safetensors folder, and each GGUF quantization."""
    out: list[tuple[str, Path, str]] = []
    if (snapshot / "config.json").exists() and any(snapshot.glob("*.safetensors")):
        out.append((repo_id, snapshot, "folder"))
    names = [str(p.relative_to(snapshot)) for p in snapshot.rglob("*.gguf")]
    groups = group_gguf_files(names)
    for label, files in groups.items():
        if not split_parts_missing(files, lambda n: (snapshot / n).exists()):
            out.append((f"{repo_id}:{label}", snapshot / files[0], "gguf"))
    return out


def list_hf_cache() -> tuple[list[LocalModel], list[str]]:
    """(whole models in the cache, one line per cached repo that is not a whole model yet)."""
    root = hf_cache_dir()
    models: list[LocalModel] = []
    partial: list[str] = []
    if not root.is_dir():
        return models, partial
    for folder in sorted(root.glob("models--*")):
        repo_id = folder.name.removeprefix("models--").replace("--", "/", 1)
        snap = cached_snapshot(repo_id)
        if snap is None:
            if (folder / PULL_MARKER).is_file():
                partial.append(f"{repo_id}: an unfinished pull; `roofline pull {repo_id}` finishes it")
            continue
        problem = snapshot_problem(snap)
        if problem:
            partial.append(f"{repo_id}: {problem}; `roofline pull {repo_id}` finishes it")
            continue
        for ref, path, kind in hf_entries(snap, repo_id):
            models.append(LocalModel(ref, "hf-cache", ref, path, kind))
    return models, partial


def resolve_hf_cached(repo_id: str, tag: str | None) -> tuple[Path, str] | None:
    """(path, kind) of a cached model, None when the repo is not cached; ModelLoadError when it is only part there."""
    snap = cached_snapshot(repo_id)
    if snap is None:
        return None
    problem = snapshot_problem(snap)
    if problem:
        raise IncompleteModel(f"{repo_id!r} in the Hugging Face cache is not a whole model: {problem}; "
                              f"`roofline pull {repo_id}` finishes it")
    entries = hf_entries(snap, repo_id)
    if tag is None:
        folder = [e for e in entries if e[2] == "folder"]
        if folder:
            return folder[0][1], "folder"
    groups = {ref.partition(":")[2]: [str(path.relative_to(snap))] for ref, path, kind in entries if kind == "gguf"}
    if not groups and tag is None:
        return None  # cached files but no model among them (e.g. a tokenizer only): let a pull say what is there
    path = pick_gguf(groups, tag, f"{repo_id!r} in the Hugging Face cache", repo_id)
    return snap / path, "gguf"


# ---- Ollama ----------------------------------------------------------------------------------------------

def ollama_dirs() -> list[Path]:
    """OLLAMA_MODELS, else ~/.ollama/models and the Linux service's /usr/share/ollama/.ollama/models."""
    if env := os.environ.get("OLLAMA_MODELS"):
        return [Path(env).expanduser()]
    dirs = [Path.home() / ".ollama" / "models", Path("/usr/share/ollama/.ollama/models")]
    return [d for d in dirs if (d / "manifests").is_dir()]


def parse_ollama_name(name: str) -> tuple[str, str, str, str]:
    """'llama3.2' -> (registry.ollama.ai, library, llama3.2, latest); 'user/m:7b', 'hf.co/org/repo:Q4_K_M' alike."""
    base, tag = name, OLLAMA_TAG
    if ":" in name.rsplit("/", 1)[-1]:
        base, _, tag = name.rpartition(":")
    parts = base.split("/")
    if not base or not tag or len(parts) > 3 or not all(parts) or any(p in (".", "..") for p in parts + [tag]):
        raise ModelLoadError(f"ollama:{name}: expected ollama:NAME[:TAG], e.g. ollama:llama3.2 or ollama:qwen2.5:7b")
    if len(parts) == 1:
        parts = [OLLAMA_REGISTRY, OLLAMA_NAMESPACE, *parts]
    elif len(parts) == 2:
        parts = [OLLAMA_REGISTRY, *parts]
    return parts[0], parts[1], parts[2], tag


def _ollama_short(host: str, namespace: str, model: str, tag: str) -> str:
    if host == OLLAMA_REGISTRY:
        return f"{model}:{tag}" if namespace == OLLAMA_NAMESPACE else f"{namespace}/{model}:{tag}"
    return f"{host}/{namespace}/{model}:{tag}"


def _ollama_blob(root: Path, manifest: Path, short: str) -> tuple[Path, int]:
    try:
        data = json.loads(manifest.read_text())
        layers = data["layers"]
        layer = next((lay for lay in layers if lay.get("mediaType") == OLLAMA_MODEL_LAYER), None)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ModelLoadError(f"ollama:{short}: unreadable manifest {manifest} ({e})") from None
    if layer is None:
        kinds = ", ".join(sorted({str(lay.get("mediaType")) for lay in layers if isinstance(lay, dict)}))
        raise ModelLoadError(f"ollama:{short}: its manifest has no GGUF layer ({OLLAMA_MODEL_LAYER}); it has: {kinds}")
    digest = str(layer.get("digest", ""))
    blob = root / "blobs" / digest.replace(":", "-")
    if not re.fullmatch(r"sha256:[0-9a-f]{64}", digest) or not blob.is_file():
        raise ModelLoadError(f"ollama:{short}: its model blob {blob} is missing (an unfinished `ollama pull`?)")
    return blob, int(layer.get("size") or blob.stat().st_size)


def resolve_ollama(name: str) -> Path:
    host, namespace, model, tag = parse_ollama_name(name)
    short = _ollama_short(host, namespace, model, tag)
    roots = ollama_dirs()
    for root in roots:
        manifest = root / "manifests" / host / namespace / model / tag
        if manifest.is_file():
            return _ollama_blob(root, manifest, short)[0]
    where = " or ".join(str(r) for r in roots) or "~/.ollama/models (none there; OLLAMA_MODELS names another)"
    raise ModelLoadError(f"ollama:{short}: not in Ollama's store ({where}); `ollama pull {short}` fetches it, "
                         "`roofline models` lists what is there")


def ollama_manifest(name: str) -> tuple[Path, Path]:
    """(store root, manifest file) of an Ollama model (for `rm`)."""
    host, namespace, model, tag = parse_ollama_name(name)
    for root in ollama_dirs():
        manifest = root / "manifests" / host / namespace / model / tag
        if manifest.is_file():
            return root, manifest
    raise ModelLoadError(f"ollama:{name}: not in Ollama's store")


def list_ollama() -> tuple[list[LocalModel], list[str]]:
    models, problems = [], []
    for root in ollama_dirs():
        for manifest in sorted((root / "manifests").glob("*/*/*/*")):
            if not manifest.is_file():
                continue
            host, namespace, model, tag = manifest.relative_to(root / "manifests").parts
            short = _ollama_short(host, namespace, model, tag)
            try:
                blob, size = _ollama_blob(root, manifest, short)
            except ModelLoadError as e:
                problems.append(str(e))
                continue
            models.append(LocalModel(OLLAMA + short, "ollama", short, blob, "gguf", size))
    return models, problems


# ---- LM Studio -------------------------------------------------------------------------------------------

def lmstudio_dirs() -> list[Path]:
    """LM Studio's models folders: the one its settings name (`downloadsFolder`), ~/.lmstudio/models (its home
    may be moved: ~/.lmstudio-home-pointer) and the older ~/.cache/lm-studio/models."""
    home = Path.home() / ".lmstudio"
    pointer = Path.home() / ".lmstudio-home-pointer"
    if pointer.is_file():
        try:
            home = Path(pointer.read_text().strip()).expanduser()
        except OSError:
            pass
    dirs: list[Path] = []
    for settings in (home / "settings.json", Path.home() / ".cache" / "lm-studio" / "settings.json"):
        try:
            folder = json.loads(settings.read_text()).get("downloadsFolder")
        except (OSError, ValueError, AttributeError):
            folder = None
        if isinstance(folder, str) and folder:
            dirs.append(Path(folder).expanduser())
    dirs += [home / "models", Path.home() / ".cache" / "lm-studio" / "models"]
    seen: list[Path] = []
    for d in dirs:
        if d.is_dir() and d not in seen:
            seen.append(d)
    return seen


def _lmstudio_models_in(repo_dir: Path, publisher: str, repo: str) -> list[LocalModel]:
    if (repo_dir / "config.json").is_file() and any(repo_dir.glob("*.safetensors")):
        ref = f"{publisher}/{repo}"
        return [LocalModel(LMSTUDIO + ref, "lmstudio", ref, repo_dir, "folder")]
    groups = group_gguf_files([p.name for p in repo_dir.glob("*.gguf")])
    out = []
    for files in groups.values():
        if split_parts_missing(files, lambda n: (repo_dir / n).exists()):
            continue
        ref = f"{publisher}/{repo}/{files[0]}"
        out.append(LocalModel(LMSTUDIO + ref, "lmstudio", ref, repo_dir / files[0], "gguf"))
    return out


def list_lmstudio() -> list[LocalModel]:
    out: list[LocalModel] = []
    for root in lmstudio_dirs():
        for repo_dir in sorted(root.glob("*/*")):
            if repo_dir.is_dir() and not repo_dir.parent.name.startswith("."):
                out += _lmstudio_models_in(repo_dir, repo_dir.parent.name, repo_dir.name)
    return out


def resolve_lmstudio(spec: str) -> tuple[Path, str]:
    parts = spec.split("/")
    if not 2 <= len(parts) <= 3 or not all(parts) or any(p in (".", "..") for p in parts):
        raise ModelLoadError(f"lmstudio:{spec}: expected lmstudio:PUBLISHER/REPO[/FILE.gguf], e.g. "
                             "lmstudio:lmstudio-community/Qwen2.5-7B-Instruct-GGUF")
    roots = lmstudio_dirs()
    for root in roots:
        repo_dir = root / parts[0] / parts[1]
        if not repo_dir.is_dir():
            continue
        if len(parts) == 3:
            f = repo_dir / parts[2]
            if not f.is_file():
                names = ", ".join(sorted(p.name for p in repo_dir.glob("*.gguf"))) or "none"
                raise ModelLoadError(f"lmstudio:{spec}: no file {parts[2]!r} in {repo_dir} (GGUF files there: {names})")
            return f, "gguf"
        found = _lmstudio_models_in(repo_dir, parts[0], parts[1])
        if len(found) == 1:
            return found[0].path, found[0].kind
        if found:
            names = ", ".join(m.path.name for m in found)
            raise ModelLoadError(f"lmstudio:{spec} holds {len(found)} GGUF files ({names}): name one, e.g. "
                                 f"lmstudio:{spec}/{found[0].path.name}")
        raise ModelLoadError(f"lmstudio:{spec}: {repo_dir} holds no model (no .gguf file, no config.json with "
                             "safetensors)")
    where = ", ".join(str(r) for r in roots) or "~/.lmstudio/models (not there)"
    raise ModelLoadError(f"lmstudio:{spec}: not in LM Studio's models folder ({where})")


# ---- one resolver ----------------------------------------------------------------------------------------

def resolve_store_ref(ref: str) -> tuple[Path, str] | None:
    """(path, kind) for an `ollama:` or `lmstudio:` ref; None for any other ref."""
    if ref.startswith(OLLAMA):
        return resolve_ollama(ref[len(OLLAMA):]), "gguf"
    if ref.startswith(LMSTUDIO):
        return resolve_lmstudio(ref[len(LMSTUDIO):])
    return None


def is_embedded(ref: str | None) -> bool:
    return ref is None or ref == "" or (ref == EMBEDDED_REF and not Path(ref).exists())


def display_name(ref: str | None, path: Path) -> str:
    """The model's name for ModelInfo: the ref for store and hub refs (an Ollama blob's file name says nothing)."""
    if ref and (ref.startswith((OLLAMA, LMSTUDIO)) or (not Path(ref).expanduser().exists() and parse_hf_ref(ref))):
        return ref
    return path.name
