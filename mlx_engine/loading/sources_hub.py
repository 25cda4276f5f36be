"""`roofline pull`: a model from the Hugging Face Hub into huggingface_hub's own cache, through its client.

The repo's listing (`HfApi.model_info`, with file sizes) decides what to fetch: a safetensors model's config,
tokenizer and weights, or one quantization of a GGUF repo. Free disk is checked before the first byte. Each file
goes through huggingface_hub's `http_get` (which re-requests the rest with a Range header when a connection
drops) into `blobs/<etag>.incomplete`, the partial-file name older huggingface_hub versions resumed from, so an
interrupted pull (Ctrl+C, a cancel in the app, a lost network) resumes from the bytes it has: this version of
the client deletes its own partial files on any error. The finished blob is checked against its LFS sha256 and
linked into the snapshot by `hf_hub_download`, which finds it there. Xet-stored files (the Hub's newer storage)
go through `hf_hub_download` whole, where hf_xet keeps its own chunk cache to resume from.

While a pull is unfinished its repo folder holds PULL_MARKER, so `roofline models` and `-m` never take a half
pulled model for a model.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from mlx_engine.api import ModelLoadError, RooflineError
from mlx_engine.loading.sources import (
    PULL_MARKER,
    cached_snapshot,
    group_gguf_files,
    hf_cache_dir,
    hf_offline,
    repo_folder,
)

DISK_RESERVE_BYTES = 64 * 2**20  # left free after a pull
FOLDER_FILES = ("*.json", "*.safetensors", "*.jinja", "tokenizer.model", "*.txt", "*.tiktoken")
_NETWORK_ERRORS = {"ConnectError", "ConnectTimeout", "TimeoutException", "ReadTimeout", "ConnectionError",
                   "NetworkError", "RemoteProtocolError", "ReadError", "OfflineModeIsEnabled"}


class PullError(ModelLoadError):
    """A pull that cannot go on: one line saying why and what to do."""


class PullCancelled(RooflineError):
    """The pull was cancelled (its partial files are kept: pulling again resumes)."""


@dataclass(frozen=True)
class RemoteFile:
    name: str
    size: int
    sha256: str | None  # LFS files: the content's sha256, which is also the blob's etag
    blob_id: str | None

    @property
    def etag(self) -> str | None:
        return self.sha256 or self.blob_id


@dataclass
class PullPlan:
    repo_id: str
    commit: str
    kind: str  # "folder" or "gguf"
    files: list[RemoteFile]
    label: str | None = None  # the GGUF quantization
    warnings: list[str] = field(default_factory=list)

    @property
    def ref(self) -> str:
        return f"{self.repo_id}:{self.label}" if self.label else self.repo_id

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


class PullProgress(Protocol):
    def start(self, plan: PullPlan, done_bytes: int) -> None: ...

    def advance(self, nbytes: int) -> None: ...

    def finish(self) -> None: ...


ChooseQuant = Callable[[list[tuple[str, int]]], str | None]  # [(label, bytes)] -> the label, or None to give up


def endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")


def _is_network_error(e: BaseException) -> bool:
    return any(c.__name__ in _NETWORK_ERRORS for c in type(e).__mro__)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _no_space(e: OSError) -> bool:
    return e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def hub_error(e: BaseException, repo_id: str, revision: str | None = None) -> PullError:
    """One line for whatever the Hub or the network raised."""
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, RemoteEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    if isinstance(e, GatedRepoError):
        return PullError(f"{repo_id} is gated: accept its terms at {endpoint()}/{repo_id}, then set HF_TOKEN to a "
                         "token of that account (or run `hf auth login`)")
    if isinstance(e, RepositoryNotFoundError):
        return PullError(f"{repo_id}: no such model on the Hub ({endpoint()}), or it is private: check the name, "
                         "or set HF_TOKEN to a token that can read it")
    if isinstance(e, RevisionNotFoundError):
        return PullError(f"{repo_id}: no revision {revision or 'main'!r} on the Hub")
    if isinstance(e, RemoteEntryNotFoundError):
        return PullError(f"{repo_id}: a file listed by the Hub is missing there ({_first_line(e)}); try again later")
    if _is_network_error(e):
        return PullError(f"cannot reach the Hub at {endpoint()} ({type(e).__name__}: {_first_line(e)}): no network? "
                         "Models already on disk: `roofline models`")
    if isinstance(e, HfHubHTTPError):
        status = getattr(getattr(e, "response", None), "status_code", "?")
        return PullError(f"{repo_id}: the Hub answered HTTP {status} ({_first_line(e)})")
    return PullError(f"{repo_id}: pull failed ({type(e).__name__}: {_first_line(e)})")


# ---- what to fetch ---------------------------------------------------------------------------------------

def _remote_files(repo_id: str, revision: str | None) -> tuple[str, list[RemoteFile]]:
    from huggingface_hub import HfApi

    try:
        info = HfApi(endpoint=endpoint()).model_info(repo_id, revision=revision, files_metadata=True)
    except Exception as e:  # noqa: BLE001 - the Hub client raises many kinds; each becomes one line
        raise hub_error(e, repo_id, revision) from None
    files = [RemoteFile(s.rfilename, int(s.size or (s.lfs.size if s.lfs else 0) or 0),
                        s.lfs.sha256 if s.lfs else None, s.blob_id) for s in info.siblings or []]
    if not info.sha:
        raise PullError(f"{repo_id}: the Hub's answer has no commit (sha); is HF_ENDPOINT={endpoint()} a Hub?")
    return info.sha, files


def _folder_files(files: list[RemoteFile]) -> list[RemoteFile]:
    from fnmatch import fnmatch

    root = [f for f in files if "/" not in f.name and not f.name.startswith("consolidated")]
    return [f for f in root if any(fnmatch(f.name, p) for p in FOLDER_FILES)]


def plan_pull(repo_id: str, revision: str | None = None, quant: str | None = None, file: str | None = None,
              choose: ChooseQuant | None = None) -> PullPlan:
    """What a pull of `repo_id` fetches (PullError when the repo holds nothing Roofline loads, or a GGUF repo's
    quantization is not named and `choose` does not pick one)."""
    if hf_offline():
        raise PullError(f"cannot pull {repo_id}: HF_HUB_OFFLINE is set (unset it to download)")
    commit, files = _remote_files(repo_id, revision)
    by_name = {f.name: f for f in files}
    groups = group_gguf_files(list(by_name))
    has_folder = "config.json" in by_name and any(n.endswith(".safetensors") and "/" not in n for n in by_name)
    if quant is None and file is None and has_folder:
        return PullPlan(repo_id, commit, "folder", _folder_files(files))
    if not groups:
        if quant or file:
            raise PullError(f"{repo_id} has no GGUF files" + (": it is a safetensors model, pull it without "
                                                               "--quant/--file" if has_folder else ""))
        listed = ", ".join(sorted(by_name)[:6]) or "no files"
        raise PullError(f"{repo_id}: no safetensors weights with config.json and no .gguf file, so nothing "
                        f"Roofline can load ({listed})")
    sizes = {label: sum(by_name[n].size for n in names) for label, names in groups.items()}
    label = None
    if file is not None:
        label = next((lab for lab, names in groups.items() if any(n == file or n.rsplit("/", 1)[-1] == file
                                                                   for n in names)), None)
        if label is None:
            raise PullError(f"{repo_id}: no GGUF file {file!r} (there: {', '.join(n for v in groups.values() for n in v)})")
    elif quant is not None:
        label = next((lab for lab in groups if lab.lower() == quant.lower()), None)
        if label is None:
            raise PullError(f"{repo_id}: no {quant!r} quantization (there: {_sizes(sizes)})")
    elif len(groups) == 1:
        label = next(iter(groups))
    elif choose is not None:
        label = choose(list(sizes.items()))
        if label not in groups:
            raise PullError(f"{repo_id}: no quantization chosen (there: {_sizes(sizes)})")
    else:
        raise PullError(f"{repo_id} holds {len(groups)} quantizations ({_sizes(sizes)}): choose one with --quant, "
                        f"e.g. `roofline pull {repo_id} --quant {_suggest(sizes)}` or -m {repo_id}:{_suggest(sizes)}")
    return PullPlan(repo_id, commit, "gguf", [by_name[n] for n in groups[label]], label)


def _sizes(sizes: dict[str, int]) -> str:
    return ", ".join(f"{lab} {_human(n)}" for lab, n in sizes.items())


def _suggest(sizes: dict[str, int]) -> str:
    return next((lab for lab in ("Q4_K_M", "Q4_0", "Q8_0") if lab in sizes), next(iter(sizes)))


# ---- fetching --------------------------------------------------------------------------------------------

def _partial(storage: Path, etag: str) -> Path:
    return storage / "blobs" / f"{etag}.incomplete"


def _have(storage: Path, f: RemoteFile) -> int:
    """Bytes of `f` in the cache: all of it as a blob, or what a pull left in its partial file."""
    if f.etag is None:
        return 0
    if (storage / "blobs" / f.etag).exists():
        return f.size
    part = _partial(storage, f.etag)
    return min(part.stat().st_size, f.size) if part.exists() else 0


def bytes_on_disk(plan: PullPlan) -> int:
    """Bytes of the plan already in the cache (whole blobs, and partial files a pull left)."""
    storage = repo_folder(plan.repo_id)
    return sum(_have(storage, f) for f in plan.files)


def check_disk(plan: PullPlan, done: int) -> None:
    root = hf_cache_dir()
    probe = root
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    need = plan.total_bytes - done
    if need + DISK_RESERVE_BYTES > free:
        raise PullError(f"not enough disk space for {plan.ref}: it needs {need / 1e9:.2f} GB more in {root} but "
                        f"{free / 1e9:.2f} GB are free there; free some space or set HF_HOME to another disk")


class _Tracker:
    """Per-file positions -> PullProgress.advance deltas; the cancel check on every chunk."""

    def __init__(self, progress: PullProgress | None, cancel: threading.Event | None):
        self.progress, self.cancel = progress, cancel
        self.position: dict[str, int] = {}
        self.current = ""

    def check(self) -> None:
        if self.cancel is not None and self.cancel.is_set():
            raise PullCancelled("pull cancelled; its partial files are kept, so pulling again resumes")

    def set(self, name: str, position: int) -> None:
        delta = position - self.position.get(name, 0)
        self.position[name] = position
        if delta and self.progress is not None:
            self.progress.advance(delta)

    def bar_class(self) -> type:
        """A tqdm stand-in for huggingface_hub's download loops (their `tqdm_class`): it counts from `initial`,
        the bytes of the file already on disk, and checks for a cancel at every chunk."""
        tracker, name = self, self.current

        class Bar:
            def __init__(self, *args: object, initial: int = 0, **kwargs: object):
                self.n = initial or 0
                tracker.set(name, self.n)

            def __enter__(self) -> Bar:
                return self

            def __exit__(self, *exc: object) -> bool:
                return False

            def update(self, n: float | None = 1) -> None:
                tracker.check()
                self.n += int(n or 0)
                tracker.set(name, self.n)

            def __getattr__(self, attr: str) -> Callable[..., None]:  # close, refresh, set_postfix_str, ...
                return lambda *a, **k: None

        return Bar


def _sha256(path: Path, tracker: _Tracker) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            tracker.check()
            h.update(chunk)
    return h.hexdigest()


def _fetch(plan: PullPlan, f: RemoteFile, tracker: _Tracker) -> None:
    from huggingface_hub import hf_hub_download
    from huggingface_hub.file_download import get_hf_file_metadata, hf_hub_url, http_get
    from huggingface_hub.utils import WeakFileLock, build_hf_headers

    cache, storage = str(hf_cache_dir()), repo_folder(plan.repo_id)
    tracker.current = f.name
    common = dict(repo_id=plan.repo_id, filename=f.name, revision=plan.commit, cache_dir=cache, endpoint=endpoint())
    url = hf_hub_url(plan.repo_id, f.name, revision=plan.commit, endpoint=endpoint())
    meta = get_hf_file_metadata(url)
    if meta.etag is None:
        raise PullError(f"{plan.repo_id}/{f.name}: the Hub sent no ETag for it")
    blob = storage / "blobs" / meta.etag
    if not blob.exists():
        if meta.xet_file_data is not None and _xet_available():
            hf_hub_download(**common, tqdm_class=tracker.bar_class())
            tracker.set(f.name, f.size)
            return
        partial = _partial(storage, meta.etag)
        partial.parent.mkdir(parents=True, exist_ok=True)
        headers = build_hf_headers()
        if not _same_host(url, meta.location):
            headers.pop("authorization", None)  # a signed CDN address: the token stays with the Hub
        with WeakFileLock(storage.parent / ".locks" / storage.name / f"{meta.etag}.lock"):
            with open(partial, "ab") as out:
                have = out.tell()
                if meta.size is not None and have > meta.size:
                    out.truncate(0)
                    have = 0
                if meta.size is None or have < meta.size:
                    http_get(meta.location, out, resume_size=have, headers=headers, expected_size=meta.size,
                             tqdm_class=tracker.bar_class())
            tracker.set(f.name, partial.stat().st_size)
            if len(meta.etag) == 64 and _sha256(partial, tracker) != meta.etag:
                partial.unlink()
                raise PullError(f"{plan.repo_id}/{f.name}: the download does not match its sha256 (removed); "
                                "pull again")
            os.chmod(partial, 0o666 & ~_umask())
            os.replace(partial, blob)
    hf_hub_download(**common)  # the blob is there: this links it into the snapshot
    tracker.set(f.name, f.size)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _same_host(a: str, b: str) -> bool:
    from urllib.parse import urlparse

    return urlparse(a).netloc == urlparse(b).netloc


def _xet_available() -> bool:
    try:
        from huggingface_hub.utils._runtime import is_xet_available
    except ImportError:
        return False
    return bool(is_xet_available())


def pull(repo_id: str, *, revision: str | None = None, quant: str | None = None, file: str | None = None,
         progress: PullProgress | None = None, cancel: threading.Event | None = None,
         choose: ChooseQuant | None = None, plan: PullPlan | None = None) -> tuple[Path, str, PullPlan]:
    """Pulls a model into the Hugging Face cache; returns (local path, kind 'folder' or 'gguf', the plan).
    PullError for anything that stops it (one line), PullCancelled when `cancel` is set; a KeyboardInterrupt
    passes through. Either way the bytes fetched stay for the next pull to resume from."""
    plan = plan or plan_pull(repo_id, revision, quant, file, choose)
    done = bytes_on_disk(plan)
    check_disk(plan, done)
    storage = repo_folder(repo_id)
    storage.mkdir(parents=True, exist_ok=True)
    marker = storage / PULL_MARKER
    marker.write_text(json.dumps({"commit": plan.commit, "files": [f.name for f in plan.files]}))
    tracker = _Tracker(progress, cancel)
    if progress is not None:
        progress.start(plan, done)
    tracker.position = {f.name: _have(storage, f) for f in plan.files}
    try:
        for f in sorted(plan.files, key=lambda f: f.size):
            tracker.check()
            _fetch(plan, f, tracker)
    except (PullError, PullCancelled, KeyboardInterrupt):
        raise
    except OSError as e:
        if _no_space(e):
            raise PullError(f"disk full while pulling {plan.ref} into {hf_cache_dir()} ({e.strerror}); what it "
                            f"fetched is kept: free some space and `roofline pull {plan.ref}` resumes") from None
        if _is_network_error(e):
            raise hub_error(e, repo_id, revision) from None
        raise PullError(f"pulling {plan.ref} failed: {e.strerror or _first_line(e)} "
                        f"({getattr(e, 'filename', None) or hf_cache_dir()})") from None
    except Exception as e:  # noqa: BLE001 - the Hub client's own errors, one line each
        raise hub_error(e, repo_id, revision) from None
    ref_file = storage / "refs" / (revision or "main")
    ref_file.parent.mkdir(parents=True, exist_ok=True)
    ref_file.write_text(plan.commit)
    marker.unlink(missing_ok=True)
    if progress is not None:
        progress.finish()
    snap = cached_snapshot(repo_id, revision or "main") or storage / "snapshots" / plan.commit
    if plan.kind == "gguf":
        return snap / plan.files[0].name, "gguf", plan
    return snap, "folder", plan


# ---- progress on stderr ----------------------------------------------------------------------------------

def _human(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


class StderrProgress:
    """A bar (bytes, rate, time left) on a terminal; otherwise a plain line every 10% or 5 s."""

    def __init__(self, stream=None, interval_s: float = 5.0):
        self.stream = stream or sys.stderr
        self.interval_s = interval_s
        self.bar = None

    def start(self, plan: PullPlan, done_bytes: int) -> None:
        self.plan, self.done, self.total = plan, done_bytes, plan.total_bytes
        self.t0, self.start_done, self.last_t, self.last_pct = time.monotonic(), done_bytes, 0.0, -10
        files = f"{len(plan.files)} file{'s' if len(plan.files) != 1 else ''}"
        resumed = f", {_human(done_bytes)} already here" if done_bytes else ""
        print(f"pulling {plan.ref} ({files}, {_human(self.total)}{resumed}) into {hf_cache_dir()}", file=self.stream)
        if self.stream.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=self.total, initial=done_bytes, unit="B", unit_scale=True, file=self.stream,
                            desc=plan.ref, dynamic_ncols=True)

    def advance(self, nbytes: int) -> None:
        self.done += nbytes
        if self.bar is not None:
            self.bar.update(nbytes)
            return
        now = time.monotonic()
        pct = int(100 * self.done / self.total) if self.total else 100
        if pct >= self.last_pct + 10 or now - self.last_t >= self.interval_s:
            self.last_t, self.last_pct = now, pct
            rate = (self.done - self.start_done) / max(now - self.t0, 1e-6)
            left = (self.total - self.done) / rate if rate > 0 else 0
            print(f"pulling {self.plan.ref}: {_human(self.done)} of {_human(self.total)} ({pct}%), "
                  f"{_human(rate)}/s, {left:.0f} s left", file=self.stream, flush=True)

    def finish(self) -> None:
        if self.bar is not None:
            self.bar.close()
        print(f"pulled {self.plan.ref}: {_human(self.total)} in {time.monotonic() - self.t0:.1f} s",
              file=self.stream)
