"""Each chat's KV cache on disk, one file per chat and model, `ROOFLINE_HOME/kv/<chat_id>-<model key>.safetensors`:
saved after every reply, restored into the engine's prefix cache when the chat is opened, so reopening a long
chat needs no re-prefill, and switching models and back needs none either (each model keeps its own file; a
chat keeps the files of its MAX_MODELS_PER_CHAT most recently saved models).

All engine work runs in thread workers (the engine may be busy with a reply for seconds); the UI thread only
ever deletes files. Failures are logged, never shown: without the file a chat simply prefills. A refused
file (another model, corrupt) is deleted, with a short notice.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mlx_engine.api import EngineLike, RooflineError

log = logging.getLogger(__name__)

MAX_MODELS_PER_CHAT = 4


def model_key(engine: EngineLike) -> str:
    """A short name for the model an engine runs and how (a file is only ever restored into the same)."""
    i = engine.info
    ident = "\0".join(str(x) for x in (i.name, i.path, i.backend, i.device, i.dtype, i.quantization))
    return hashlib.sha256(ident.encode()).hexdigest()[:12]


class ChatKV:
    def __init__(self, app: Any, backend: Any, folder: Path):
        self.app = app
        self.backend = backend
        self.folder = folder
        self.restored: dict[int, int] = {}  # chat id -> tokens restored (this session)
        self._lock = threading.Lock()  # around file renames and deletions (never held during engine calls)
        self._epoch: dict[int, int] = {}  # chat id -> times its file was forgotten; a save older than that is void
        self._warm_engine: Any = None
        self._warm: set[int] = set()  # chats whose KV is already in _warm_engine's prefix cache
        self._supported: dict[int, bool] = {}  # id(engine) -> keeps a paged cache
        self._pending = 0
        self._idle = threading.Condition()
        self._names = itertools.count()

    def path(self, chat_id: int, engine: EngineLike) -> Path:
        return self.folder / f"{chat_id}-{model_key(engine)}.safetensors"

    def files(self, chat_id: int) -> list[Path]:
        """Every model's file of the chat, and the one file per chat of earlier versions (`<chat_id>.safetensors`)."""
        if not self.folder.is_dir():
            return []
        return [*self.folder.glob(f"{chat_id}-*.safetensors"), *self.folder.glob(f"{chat_id}.safetensors")]

    # ---- UI thread -----------------------------------------------------------------------------------

    def save(self, engine: EngineLike, chat_id: int, messages: list[dict[str, str]]) -> None:
        """Saves the conversation `messages` (ending with the reply just finished) in a worker."""
        self._mark_warm(engine, chat_id)
        epoch = self._epoch.get(chat_id, 0)
        self._start(lambda: self._save(engine, chat_id, messages, epoch), f"save KV of chat {chat_id}")

    def restore(self, engine: EngineLike, chat_id: int) -> None:
        """Restores the chat's saved KV into `engine` in a worker, once per engine (a chat already replied to or
        restored with this engine has its blocks cached)."""
        if engine is not self._warm_engine:
            self._warm_engine, self._warm = engine, set()
        if chat_id in self._warm or not self.path(chat_id, engine).exists():
            return
        self._warm.add(chat_id)
        epoch = self._epoch.get(chat_id, 0)
        self._start(lambda: self._restore(engine, chat_id, epoch), f"restore KV of chat {chat_id}")

    def forget(self, chat_id: int) -> None:
        """Deletes the chat's files, every model's (the chat was deleted, or its history changed); a save in flight
        is voided."""
        with self._lock:
            self._epoch[chat_id] = self._epoch.get(chat_id, 0) + 1
            for path in self.files(chat_id):
                self._unlink(path)
        self.restored.pop(chat_id, None)

    def flush(self, timeout: float) -> bool:
        """Waits up to `timeout` seconds for saves and restores in flight (on quit); True when none is left."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout)

    # ---- workers -------------------------------------------------------------------------------------

    def _mark_warm(self, engine: EngineLike, chat_id: int) -> None:
        if engine is not self._warm_engine:
            self._warm_engine, self._warm = engine, set()
        self._warm.add(chat_id)

    def _start(self, fn: Callable[[], None], name: str) -> None:
        with self._idle:
            self._pending += 1

        def run() -> None:
            try:
                fn()
            finally:
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()

        self.app.run_worker(run, name=name, group="kv", thread=True, exit_on_error=False)

    def _supports(self, engine: EngineLike) -> bool:
        key = id(engine)
        if key not in self._supported:
            self._supported[key] = self.backend.kv_persistence(engine)
        return self._supported[key]

    def _save(self, engine: EngineLike, chat_id: int, messages: list[dict[str, str]], epoch: int) -> None:
        if not self._supports(engine):
            return
        tmp = self.folder / f"{chat_id}.saving-{next(self._names)}.safetensors"
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            n = self.backend.save_kv(engine, tmp, messages)
        except RooflineError as e:  # shorter than one block ("nothing to save"), a closed engine, ...
            log.info("KV of chat %s not saved: %s", chat_id, e)
            self._unlink(tmp)
            return
        except Exception:  # noqa: BLE001 - persistence is an optimisation: log, never crash the app
            log.warning("KV of chat %s not saved", chat_id, exc_info=True)
            self._unlink(tmp)
            return
        with self._lock:
            if self._epoch.get(chat_id, 0) != epoch:  # deleted or rewritten while we saved
                self._unlink(tmp)
                return
            try:
                os.replace(tmp, self.path(chat_id, engine))
            except OSError as e:
                log.warning("KV of chat %s not saved: %s", chat_id, e)
                self._unlink(tmp)
                return
            self._prune(chat_id)
        log.info("saved KV of chat %s: %d tokens", chat_id, n)

    def _prune(self, chat_id: int) -> None:
        """Keeps the chat's MAX_MODELS_PER_CHAT newest files (under the lock)."""
        try:
            files = sorted(self.files(chat_id), key=lambda p: p.stat().st_mtime, reverse=True)
        except OSError:
            return
        for path in files[MAX_MODELS_PER_CHAT:]:
            self._unlink(path)

    def _restore(self, engine: EngineLike, chat_id: int, epoch: int) -> None:
        if not self._supports(engine):
            return
        path = self.path(chat_id, engine)
        try:
            n = self.backend.restore_kv(engine, path)
        except RooflineError as e:  # another model, another KV layout, a corrupt file
            with self._lock:
                if self._epoch.get(chat_id, 0) == epoch:
                    self._unlink(path)
            log.warning("KV of chat %s refused, file deleted: %s", chat_id, e)
            self._notify("This chat's saved KV could not be used; it will prefill instead.")
            return
        except Exception:  # noqa: BLE001
            log.warning("KV of chat %s not restored", chat_id, exc_info=True)
            return
        self.restored[chat_id] = n
        log.info("restored KV of chat %s: %d tokens", chat_id, n)

    def _notify(self, text: str) -> None:
        try:
            self.app.call_from_thread(self.app.notify, text, timeout=3)
        except RuntimeError:  # the app has exited
            pass

    @staticmethod
    def _unlink(path: Path) -> None:
        try:
            path.unlink(missing_ok=True)
        except OSError as e:
            log.warning("cannot delete %s: %s", path, e)
