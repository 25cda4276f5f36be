"""The real outside world of the app: mlx_engine's Engine, catalog and tokenizers, and the chip table.
Every import of the engine is deferred to the call (these run in workers), so importing the app loads no MLX."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mlx_engine.api import EngineLike, GenerationRequest, SamplingParams

from mlx_engine.roofline import Bandwidth, machine_bandwidth


class EngineBackend:
    def __init__(self, **load_options: Any) -> None:
        self.load_options = load_options  # Engine.load's options for every model (the KV cache's, from the CLI)

    def load(self, ref: str | None, status: Callable[[str], None] | None = None) -> EngineLike:
        """Loads `ref`; a repo id not in the Hugging Face cache is pulled first, its progress told to `status`."""
        from mlx_engine import Engine

        if ref and self.needs_pull(ref):
            self.pull(ref, _StatusProgress(ref, status or (lambda _: None)), threading.Event())
        return Engine.load(ref, **self.load_options)

    def list_models(self) -> list[Any]:
        from mlx_engine.catalog import list_local_models

        return list_local_models()

    # ---- getting and removing models (called from workers) ---------------------------------------------

    def is_repo_ref(self, text: str) -> bool:
        """Whether `text` names a Hugging Face repo (ORG/NAME[:QUANT]) rather than a path on this machine."""
        from mlx_engine.loading.sources import parse_hf_ref

        return not Path(text).expanduser().exists() and parse_hf_ref(text) is not None

    def needs_pull(self, ref: str) -> bool:
        """Whether `ref` is a Hub repo that is not (wholly) in the cache; never when HF_HUB_OFFLINE is set."""
        from mlx_engine.loading.sources import IncompleteModel, hf_offline, parse_hf_ref, resolve_hf_cached

        parsed = parse_hf_ref(ref) if self.is_repo_ref(ref) else None
        if parsed is None or hf_offline():
            return False
        try:
            return resolve_hf_cached(*parsed) is None
        except IncompleteModel:
            return True  # an unfinished pull: finish it
        except RooflineError:
            return False  # cached but unusable: loading says why

    def pull(self, ref: str, progress: Any, cancel: threading.Event) -> str:
        """Pulls ORG/NAME[:QUANT] (progress: mlx_engine.loading.sources_hub.PullProgress); returns the ref that
        loads it. PullError (one line) when it cannot, PullCancelled when `cancel` is set."""
        from mlx_engine.loading.sources import parse_hf_ref
        from mlx_engine.loading.sources_hub import pull

        parsed = parse_hf_ref(ref)
        if parsed is None:
            raise RooflineError(f"{ref!r}: expected ORG/NAME or ORG/NAME:QUANT (a Hugging Face repo)")
        repo_id, tag = parsed
        gguf_file = tag if tag and tag.lower().endswith(".gguf") else None
        _, _, plan = pull(repo_id, quant=None if gguf_file else tag, file=gguf_file, progress=progress, cancel=cancel)
        return plan.ref

    def removal(self, ref: str) -> Any:
        """What removing `ref` deletes (ref, where, size_bytes); RooflineError for a model it never deletes."""
        from mlx_engine.loading.sources_rm import removal

        return removal(ref)

    def remove(self, removal: Any) -> int:
        from mlx_engine.loading.sources_rm import remove

        return remove(removal)

    def describe(self, ref: str) -> Any:
        from mlx_engine.catalog import describe_model

        return describe_model(ref)

    def load_tokenizer(self, ref: str | None) -> Any:
        from mlx_engine.loading import load_tokenizer

        return load_tokenizer(ref)

    def bandwidth(self, home: Path) -> Bandwidth:
        return machine_bandwidth(home)

    # ---- a chat's KV on disk (called from workers) ----------------------------------------------------

    def kv_persistence(self, engine: EngineLike) -> bool:
        """Whether `engine` can save and restore a chat's KV (its cache declares KV files: `ModelInfo.kv_files`)."""
        return engine.info.kv_files

    def save_kv(self, engine: EngineLike, path: Path, messages: list[dict[str, str]]) -> int:
        """Saves the cached KV of the conversation `messages` (ending with a reply, so no generation prompt);
        tokens saved. RooflineError when nothing is cached yet (a chat shorter than one block)."""
        request = GenerationRequest(messages=messages, sampling=SamplingParams(max_tokens=1),
                                    add_generation_prompt=False)
        return engine.save_kv(str(path), request)

    def restore_kv(self, engine: EngineLike, path: Path) -> int:
        """Loads a file written by `save_kv` into the engine's prefix cache; tokens restored. RooflineError
        when the file is refused (another model or KV layout, corrupt)."""
        return engine.restore_kv(str(path))


def pull_status(ref: str, done: int, total: int, rate: float) -> str:
    """'Pulling org/x: 12.3 of 45.6 MB (27%), 3.4 MB/s, 10 s left'."""
    pct = 100 * done / total if total else 100.0
    left = (total - done) / rate if rate > 0 else 0.0
    return (f"Pulling {ref}: {done / 1e6:,.1f} of {total / 1e6:,.1f} MB ({pct:.0f}%)"
            + (f", {rate / 1e6:.1f} MB/s, {left:.0f} s left" if rate > 0 else ""))


class _StatusProgress:
    """A pull's progress as one status line, at most ten times a second."""

    def __init__(self, ref: str, status: Callable[[str], None]):
        self.ref, self.status = ref, status

    def start(self, plan: Any, done_bytes: int) -> None:
        self.total, self.done, self.first, self.t0, self.last = plan.total_bytes, done_bytes, done_bytes, \
            time.monotonic(), 0.0
        self.status(pull_status(self.ref, self.done, self.total, 0.0))

    def advance(self, nbytes: int) -> None:
        self.done += nbytes
        now = time.monotonic()
        if now - self.last >= 0.1:
            self.last = now
            self.status(pull_status(self.ref, self.done, self.total, (self.done - self.first) / max(now - self.t0,
                                                                                                    1e-6)))

    def finish(self) -> None:
        self.status(f"Pulled {self.ref}; loading…")
