"""What every backend's runner shares: the context cap, the self draft's layer count, the draft model's attachment
and vocabulary check, the decode step's bytes, a tokenizer stand-in for folders without one, and the weights'
fingerprint. No MLX, no torch."""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar, cast

from mlx_engine.api import ModelInfo, ModelLoadError, RequestError, RooflineError
from mlx_engine.backends.base import ModelRunner

if TYPE_CHECKING:
    from mlx_engine.backends.base import PhaseForwards, SequenceWork
    from mlx_engine.step import StepPlan, StepResult

T = TypeVar("T")


def entry(name: str) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """A forward entry of a `CacheRunner` (decode_sample, packed_logits, ...): the forwards inside it are recorded
    under `name` (`record_path`); an entry called from another keeps the outer one's name."""

    def wrap(method: Callable[..., T]) -> Callable[..., T]:
        @functools.wraps(method)
        def run(self: CacheRunner, *args: Any, **kwargs: Any) -> T:
            if self.entry is not None:
                return method(self, *args, **kwargs)
            self.entry = name
            try:
                return method(self, *args, **kwargs)
            finally:
                self.entry = None

        return run

    return wrap


def cap_context(context: int, max_context: int | None) -> int:
    """The model's context length, capped by the max_context load option."""
    if max_context is None:
        return context
    if not isinstance(max_context, int) or max_context < 2:
        raise RooflineError(f"max_context={max_context!r}: expected an integer >= 2")
    return min(context, max_context)


def check_self_draft_layers(n: int | None, num_layers: int) -> int:
    """The self_draft_layers load option for a model of `num_layers` layers (0: not a native model): default half."""
    if n is None:
        return max(1, num_layers // 2)
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n < max(num_layers, 2):
        raise RooflineError(f"self_draft_layers={n!r}: expected an integer in [1, {max(num_layers - 1, 1)}] "
                            f"(the model has {num_layers} layers)")
    return n


def decode_bytes(shape: dict[str, Any], weight_bytes: int, context: int) -> int:
    """Bytes one decode step reads at `context` tokens, from the figures a runner keeps at load (`shape`: embed_bytes,
    tied, layers, kv_heads, head_dim, kv_itemsize, idle_bytes: weights held but not read, and moe: a
    mixture-of-experts model's expert bytes, of which a step reads the routed ones)."""
    from mlx_engine.roofline import decode_bytes_per_token

    s = shape
    weights = weight_bytes - s.get("idle_bytes", 0)  # float32 host copies replace what they copy
    return decode_bytes_per_token(weights, s["embed_bytes"], s["tied"], s["layers"],
                                  s["kv_heads"], s["head_dim"], context, s["kv_itemsize"], s.get("moe")).total


def attach_draft(target: ModelRunner, load: Callable[[], ModelRunner], optional: bool = False) -> None:
    """Loads the draft model (`load`) and, where it shares the target's tokenizer (`check_same_vocabulary`),
    makes it the target's draft. An error names the draft model. `optional`: the error becomes one of the
    target's warnings and the target goes on without a draft (the chat app, where a model picked in the app need
    not suit the draft named on its command line, and a missing draft should not keep the model from loading)."""
    try:
        try:
            draft = load()
        except RooflineError as e:
            raise ModelLoadError(f"draft model: {e}") from None  # the loader's errors name the path
        target.draft = check_same_vocabulary(target, draft)
    except RooflineError as e:
        if not optional:
            raise
        note = f"{e}. Loaded without a draft model: speculative='draft' is unavailable, 'auto' drafts by prompt lookup"
        target.info = dataclasses.replace(target.info, warnings=(*target.info.warnings, note))
        return
    target.info = dataclasses.replace(target.info, draft_model=draft.info.name)


def check_same_vocabulary(target: ModelRunner, draft: ModelRunner) -> ModelRunner:
    """The draft must propose token ids the target reads the same way: same vocabulary size (model and
    tokenizer), same EOS, and the same pieces at a spread sample of ids. Returns the draft."""
    if not draft.capabilities.rollback:
        raise RooflineError(f"draft model {draft.info.name}: {draft.capabilities.reason('rollback')}")
    t, d = target.tokenizer, draft.tokenizer
    problem = None
    if target.vocab_size != draft.vocab_size:
        problem = f"vocabulary sizes differ ({target.vocab_size} vs {draft.vocab_size})"
    elif t.vocab_size != d.vocab_size:
        problem = f"tokenizer vocabulary sizes differ ({t.vocab_size} vs {d.vocab_size})"
    elif set(t.eos_token_ids) != set(d.eos_token_ids):
        problem = f"end-of-sequence ids differ ({sorted(t.eos_token_ids)} vs {sorted(d.eos_token_ids)})"
    elif t.vocab_size:
        for i in sorted({*range(0, t.vocab_size, max(1, t.vocab_size // 257)), t.vocab_size - 1}):
            a, b = t.backend.id_to_token(i), d.backend.id_to_token(i)
            if a != b:
                problem = f"token {i} is {a!r} in one and {b!r} in the other"
                break
    if problem:
        raise RooflineError(f"draft model {draft.info.name} ({draft.info.path}) does not share the tokenizer of "
                            f"{target.info.name} ({target.info.path}): {problem}")
    return draft


class CacheRunner:
    """What a runner over a KV cache of its own does alike on every backend: a decode step's bytes from its figures,
    KV statistics and files through its cache, and its release (the draft's first). The backend frees its device
    memory (`_free_device_memory`)."""

    draft: Any = None

    def __init__(self, model: Any, tokenizer: Any, info: ModelInfo, prefill_chunk_size: int):
        self.model = model
        self.tokenizer = tokenizer
        self.info = info
        self.prefill_chunk_size = prefill_chunk_size
        self.context_length = info.context_length
        self.vocab_size = info.vocab_size
        self.eos_ids = frozenset(info.eos_token_ids)
        self.cache: Any = None  # the backend's KV cache, set at load (none in a draft that keeps KV of its own)
        self.fingerprint = b""  # `model_fingerprint`, set at load
        self._shape: dict[str, Any] = {}  # what prices a decode step (`decode_bytes`), set at load
        self.entry: str | None = None  # the forward entry running now (`entry`), for `record_path`
        self._paths_taken: Counter[str] = Counter()

    _executor: Any = None  # backends.phases.PhaseExecutor, made at the first plan

    def execute(self, plan: StepPlan) -> StepResult:
        if self._executor is None:
            from mlx_engine.backends.phases import PhaseExecutor  # (MLX: the shared executor runs on mx arrays)

            self._executor = PhaseExecutor(self.forwards())
        return self._executor.execute(plan)

    def forwards(self) -> PhaseForwards:
        return cast("PhaseForwards", self)

    def sequences(self) -> SequenceWork:
        return cast("SequenceWork", self)

    def record_path(self, path: str) -> None:
        """One forward of the running entry went through `path` (the backend's words, threads included)."""
        self._paths_taken[f"{self.entry or 'forward'}: {path}, {threading.current_thread().name}"] += 1

    def forward_paths(self) -> dict[str, int]:
        return dict(self._paths_taken)

    def decode_bytes_per_token(self, context: int) -> int:
        return decode_bytes(self._shape, self.info.weight_bytes, context)

    def moe_routing(self) -> dict[str, Any] | None:
        return None  # a dense model; the MLX runner records a mixture-of-experts model's routing

    def kv_stats(self) -> dict[str, Any]:
        return self.cache.stats()

    def save_kv(self, path: str, token_ids: list[int]) -> int:
        return self.cache.save(path, token_ids, self.fingerprint)

    def restore_kv(self, path: str) -> list[int]:
        return self.cache.restore(path, self.fingerprint)

    def release(self) -> None:
        if self.draft is not None:
            self.draft.release()
            self.draft = None
        self.cache = None
        self.model = None
        self._free_device_memory()

    def _free_device_memory(self) -> None:
        raise NotImplementedError


class NoTokenizer:
    """For a model folder without tokenizer files: token ids in, token ids out, no text."""

    vocab_size = 0
    bos_token_id = None

    def __init__(self, path: Any, config: dict[str, Any]):
        self.path = path
        eos = config.get("eos_token_id")
        self.eos_token_ids = tuple(eos if isinstance(eos, list) else [] if eos is None else [eos])

    def _refuse(self, *args: Any, **kwargs: Any) -> list[int]:
        raise RequestError(f"{self.path} has no tokenizer (tokenizer.json): send prompt_token_ids instead of text")

    encode = encode_chat = _refuse

    def detokenizer(self) -> Any:
        class _Silent:
            def add_token(self, token: int) -> str:
                return ""

            def finalize(self) -> str:
                return ""

        return _Silent()


def model_fingerprint(ckpt: Any, dtype: Any) -> bytes:
    """Identity of the weights and activation dtype: the prefix-cache hash key and the guard on saved KV."""
    import hashlib
    import json

    h = hashlib.sha256()
    h.update(json.dumps(ckpt.config, sort_keys=True, default=str).encode())
    path = ckpt.path
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".gguf"))
    for f in files:  # name, size and three 64 KiB samples: two fine-tunes of one base differ, cheaply
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with open(f, "rb") as fh:
            for at in (0, size // 2, max(0, size - 65536)):
                fh.seek(at)
                h.update(fh.read(65536))
    h.update(str(dtype).encode())
    return h.digest()
