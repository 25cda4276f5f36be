"""A scripted engine with the real Engine's surface, for tests, snapshots and the responsiveness bench.

`FakeBackend(script=[...])` hands out `FakeEngine`s whose replies come from the script in order (the last
one repeats); a `FakeReply` can stop at a token and wait (`hold_after`, released by `release()`), end in an
engine error (`error_after`), or mark tokens as drafted (`drafted`, with speculative stats). A FakeEngine
refuses speculative="draft" unless made with `draft_model=True`. `FakeReply.call` / `FakeReply.answer` are a
reply in the JSON tool-call format (a tool call, or text). It keeps a pretend prefix cache of 16-token
blocks (the conversations it has generated or restored), reports hits in `usage.cached_prompt_tokens`, and
saves and restores it as JSON files (`kv_calls` records each call). Its tokenizer is
tests/support/tui_fake_tokenizer.py's.

A FakeEngine made with `reasoning="think"` (`FakeBackend(reasoning=...)`) is a reasoning model: a reply's `thought`
streams first as `GenerationEvent.reasoning` (a token a piece), then a closer token with no text, then the answer, and
`usage.reasoning_tokens` counts the thought and the closer, as the engine counts its tags. A request whose
`reasoning_effort` is "none" or "minimal" (or whose template variables set enable_thinking false) gets the answer
alone. A model without reasoning never thinks, whatever its script says.
"""

from __future__ import annotations

import dataclasses
import json
import queue
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from mlx_engine.api import (
    NO_DRAFT_MODEL,
    GenerationEvent,
    GenerationRequest,
    ModelInfo,
    ModelLoadError,
    RequestError,
    RooflineError,
    Stats,
    Usage,
)
from mlx_engine.catalog import ModelSummary
from mlx_engine.reasoning import EFFORTS_OFF

from app.tui.backend import EngineBackend
from mlx_engine.roofline import Bandwidth
from tests.support.tui_fake_tokenizer import FakeTokenizer, NoFakeTokenizer

FAKE_KV_FORMAT = "fake-kv-1"


@dataclass
class FakeReply:
    text: str
    hold_after: int | None = None  # emit this many tokens, then wait for FakeEngine.release()
    error_after: int | None = None  # emit this many tokens, then end with finish_reason "error"
    error: str = "engine failure: the fake engine was told to fail"
    # speculative decoding: drafted[i] marks token i as from the draft, for requests that speculate (any mode
    # but None); the final stats then carry these figures
    drafted: tuple[bool, ...] = ()
    acceptance_rate: float | None = None
    mean_accepted_tokens: float | None = None
    thought: str = ""  # a reasoning model's thinking before `text` (hold_after, error_after and drafted count it)

    # A model offered tools in the JSON format (templates without tool markup) answers one JSON object
    @classmethod
    def call(cls, name: str, arguments: dict, thought: str = "") -> FakeReply:
        """A reply calling the tool `name` (after thinking `thought`, on a reasoning model)."""
        return cls(json.dumps({"tool_calls": [{"name": name, "arguments": arguments}]}), thought=thought)

    @classmethod
    def answer(cls, text: str, thought: str = "") -> FakeReply:
        """A reply in text while tools are offered."""
        return cls(json.dumps({"response": text}), thought=thought)


FAKE_CLOSER = "</think>"  # the token that ends a thought: the engine gives it no text


def thinks(request: GenerationRequest) -> bool:
    """Whether a reasoning model thinks for `request` (mlx_engine.reasoning.template_kwargs' rule for "think")."""
    variables = request.chat_template_kwargs or {}
    return request.reasoning_effort not in EFFORTS_OFF and variables.get("enable_thinking") is not False


class FakeStream:
    def __init__(self) -> None:
        self.events: queue.SimpleQueue[GenerationEvent] = queue.SimpleQueue()
        self.cancelled = threading.Event()
        self._done = False

    def __iter__(self) -> FakeStream:
        return self

    def __next__(self) -> GenerationEvent:
        if self._done:
            raise StopIteration
        event = self.events.get()
        if event.finish_reason is not None:
            self._done = True
        return event

    def cancel(self) -> None:
        self.cancelled.set()

    close = cancel


FAKE_DRAFT_NAME = "FakeDraft-100K (test)"


def fake_info(name: str = "FakeLM-1M (test)", context_length: int = 2048, reasoning: str | None = None) -> ModelInfo:
    return ModelInfo(name=name, path="/fake/" + name, model_type="llama", source_format="gguf",
                     num_parameters=1_000_000, quantization="Q4_1", context_length=context_length,
                     weight_bytes=50 * 2**20, vocab_size=49152, native=True, dtype="float32",
                     eos_token_ids=(1,), reasoning=reasoning)


class FakeEngine:
    """Streams scripted replies at `tokens_per_s` (None: as fast as possible) on its own thread."""

    def __init__(self, script: list[str | FakeReply] | None = None, tokens_per_s: float | None = 200.0,
                 info: ModelInfo | None = None, ttft_s: float = 0.0, tokenizer: FakeTokenizer | None = None,
                 paged: bool = True, block_size: int = 16, draft_model: bool = False):
        self.script = [r if isinstance(r, FakeReply) else FakeReply(r) for r in (script or ["Hello! How can I help?"])]
        self.draft_model = draft_model
        self.tokens_per_s = tokens_per_s
        self.ttft_s = ttft_s
        self.info = info or fake_info()
        if draft_model:  # as Engine.load names its draft model
            self.info = dataclasses.replace(self.info, draft_model=FAKE_DRAFT_NAME)
        self.tokenizer = tokenizer or FakeTokenizer()
        self.requests: list[GenerationRequest] = []
        self._next = 0
        self._hold = threading.Event()
        self.closed = False
        self.paged = paged
        self.info = dataclasses.replace(self.info, kv_files=paged)  # the paged cache keeps KV files, as Engine's
        self.block_size = block_size
        self.cached: list[list[int]] = []  # token sequences whose full blocks the pretend prefix cache holds
        self.kv_calls: list[tuple[str, str, int]] = []  # ("save" | "restore", path, tokens)

    def release(self) -> None:
        """Lets a reply held at `hold_after` continue."""
        self._hold.set()

    def generate(self, request: GenerationRequest) -> FakeStream:
        prompt_ids = self.tokenizer.encode_chat(request.messages or [{"role": "user", "content": request.prompt or ""}])
        if len(prompt_ids) >= self.info.context_length:
            raise RequestError(f"prompt is {len(prompt_ids)} tokens, longer than the context ({self.info.context_length})")
        if request.sampling.speculative == "draft" and not self.draft_model:
            raise RequestError(NO_DRAFT_MODEL)
        if request.sampling.reasoning_budget is not None and self.info.reasoning is None:
            raise RequestError(f"invalid sampling parameter reasoning_budget={request.sampling.reasoning_budget}: "
                               f"{self.info.name} does not reason")
        self.requests.append(request)
        reply = self.script[min(self._next, len(self.script) - 1)]
        self._next += 1
        self._hold.clear()
        stream = FakeStream()
        num_cached = min(self.cached_prefix(prompt_ids), (len(prompt_ids) - 1) // self.block_size * self.block_size)
        threading.Thread(target=self._run, args=(reply, request, prompt_ids, num_cached, stream), daemon=True).start()
        return stream

    def _run(self, reply: FakeReply, request: GenerationRequest, prompt_ids: list[int], num_cached: int,
             stream: FakeStream) -> None:
        num_prompt = len(prompt_ids)
        fed = list(prompt_ids)
        thought = self.tokenizer.pieces(reply.thought) if self.info.reasoning and thinks(request) else []
        if thought:
            thought.append(FAKE_CLOSER)
        pieces = thought + self.tokenizer.pieces(reply.text)
        max_tokens = request.sampling.max_tokens
        start = time.perf_counter()
        if self.ttft_s:
            time.sleep(self.ttft_s)
        first = None
        n = 0
        drafted = reply.drafted if request.sampling.speculative is not None else ()
        num_drafted = 0
        finish = "stop"
        error = None
        for i, piece in enumerate(pieces):
            if stream.cancelled.is_set():
                finish = "cancelled"
                break
            if reply.hold_after is not None and i == reply.hold_after:
                while not self._hold.wait(0.01):
                    if stream.cancelled.is_set():
                        break
                if stream.cancelled.is_set():
                    finish = "cancelled"
                    break
            if reply.error_after is not None and i == reply.error_after:
                finish, error = "error", reply.error
                break
            if n >= max_tokens:
                finish = "length"
                break
            if self.tokens_per_s:
                delay = start + self.ttft_s + (i + 1) / self.tokens_per_s - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
            token = self.tokenizer._id(piece)
            fed.append(token)
            from_draft = i < len(drafted) and drafted[i]
            num_drafted += from_draft
            if i < len(thought):
                text = "" if piece == FAKE_CLOSER else piece
                event = GenerationEvent(reasoning=text, token_ids=(token,), from_draft=(from_draft,))
            else:
                event = GenerationEvent(text=piece, token_ids=(token,), from_draft=(from_draft,))
            stream.events.put(event)
            n += 1
            if first is None:
                first = time.perf_counter()
        end = time.perf_counter()
        ttft = (first or end) - start
        decode_s = end - (first or end)
        stats = Stats(ttft_s=ttft, prefill_tps=num_prompt / ttft if ttft > 0 else 0.0,
                      decode_tps=(n - 1) / decode_s if n > 1 and decode_s > 0 else 0.0,
                      peak_memory_bytes=self.info.weight_bytes + 2**20, target_forwards=n - num_drafted,
                      acceptance_rate=reply.acceptance_rate if drafted else None,
                      mean_accepted_tokens=reply.mean_accepted_tokens if drafted else None)
        if self.paged and finish != "error":
            self.cached.append(fed)
        usage = Usage(num_prompt, n, num_cached, reasoning_tokens=min(n, len(thought)))
        stream.events.put(GenerationEvent(finish_reason=finish, usage=usage, stats=stats, error=error))

    # ---- the pretend prefix cache and its files ----------------------------------------------------------

    def cached_prefix(self, ids: list[int]) -> int:
        """Tokens of `ids` covered by full cached blocks (longest common prefix with a cached sequence)."""
        best = 0
        for seq in self.cached:
            n = 0
            for a, b in zip(ids, seq):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        return best // self.block_size * self.block_size

    def kv_stats(self) -> dict:
        return {"kind": "paged" if self.paged else "contiguous", "num_cached_sequences": len(self.cached)}

    def save_kv(self, path: str, request: GenerationRequest | list[int]) -> int:
        if not self.paged:
            raise RooflineError("saving KV needs the paged KV cache, which this model does not use")
        if isinstance(request, GenerationRequest):
            ids = self.tokenizer.encode_chat(request.messages or [], add_generation_prompt=request.add_generation_prompt)
        else:
            ids = list(request)
        n = self.cached_prefix(ids)
        if n == 0:
            raise RooflineError("nothing to save: no full KV block of these tokens is in the cache")
        pieces = [self.tokenizer.id_to_piece(i) for i in ids[:n]]  # ids differ between runs; pieces do not
        Path(path).write_text(json.dumps({"format": FAKE_KV_FORMAT, "model": self.info.name, "pieces": pieces}))
        self.kv_calls.append(("save", str(path), n))
        return n

    def restore_kv(self, path: str) -> int:
        if not self.paged:
            raise RooflineError("restoring KV needs the paged KV cache, which this model does not use")
        try:
            raw = json.loads(Path(path).read_text())
            pieces = raw["pieces"]
            if not isinstance(pieces, list) or not all(isinstance(p, str) for p in pieces):
                raise TypeError("pieces must be a list of strings")
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise RooflineError(f"saved KV refused: {path}: cannot read ({e})") from None
        if raw.get("format") != FAKE_KV_FORMAT or raw.get("model") != self.info.name:
            raise RooflineError(f"saved KV refused: {path} was made by another model")
        ids = [self.tokenizer._id(p) for p in pieces]
        self.cached.append(ids)
        self.kv_calls.append(("restore", str(path), len(ids)))
        return len(ids)

    def decode_bytes_per_token(self, context_tokens: int) -> int:
        # 30 layers x 3 KV heads x 64 dims x K and V x fp32
        return self.info.weight_bytes + 2 * 30 * 3 * 64 * 4 * context_tokens

    def moe_routing(self) -> None:
        return None  # a dense model

    def close(self) -> None:
        self.closed = True


class FakeBackend(EngineBackend):
    """What the app asks of the outside world (load models, list them, tokenizers, bandwidth), scripted; the
    KV file methods are EngineBackend's own, on FakeEngines."""

    def __init__(self, script: list[str | FakeReply] | None = None, tokens_per_s: float | None = 200.0,
                 load_delay_s: float = 0.0, models: list[ModelSummary] | None = None, fail: dict[str, str] | None =
                 None, bandwidth: Bandwidth | None = None, ttft_s: float = 0.0, paged: bool = True, block_size: int =
                 16, draft_model: bool = False, no_tokenizer: tuple[str, ...] = (), pull_bytes: int = 40 * 2**20,
                 pull_hold_at: float | None = None, reasoning: str | None = None):
        self.script = script
        self.reasoning = reasoning  # ModelInfo.reasoning of every model it loads
        self.no_tokenizer = no_tokenizer  # refs whose model comes without tokenizer files (token ids only)
        # pulls: `pull_bytes` in 20 chunks; with `pull_hold_at` (a fraction) the pull waits there until
        # `release_pull()` or a cancel; `pulls` records each pull's ref and how it ended
        self.pull_bytes, self.pull_hold_at = pull_bytes, pull_hold_at
        self.pull_gate = threading.Event()
        self.pulls: list[tuple[str, str]] = []
        self.removed: list[str] = []
        self.draft_model = draft_model
        self.tokens_per_s = tokens_per_s
        self.load_delay_s = load_delay_s
        self.ttft_s = ttft_s
        self.paged = paged
        self.block_size = block_size
        self.models = models if models is not None else [
            ModelSummary("", "FakeLM-1M (test)", "embedded", 52 * 2**20, 1_000_000, "Q4_1", 2048, "llama",
                         format="gguf", fits=True),
            ModelSummary("org/fake-big", "org/fake-big", "hf-cache", 1_200 * 2**20, 600_000_000, "bf16", 32768, "qwen2",
                         format="safetensors", fits=False, need_bytes=1_400 * 2**20),
        ]
        self.fail = fail or {}  # ref -> error message
        self._bandwidth = bandwidth or Bandwidth("Test chip", 100e9, measured=False)
        self.engines: list[FakeEngine] = []
        self._tokenizers: dict[str, FakeTokenizer] = {}

    @property
    def engine(self) -> FakeEngine:
        return self.engines[-1]

    def load(self, ref: str | None, status=None) -> FakeEngine:
        if self.load_delay_s:
            time.sleep(self.load_delay_s)
        key = ref or ""
        if key in self.fail:
            raise ModelLoadError(self.fail[key])
        name = next((m.name for m in self.models if m.ref == key), None)
        if name is None:
            if not Path(key).exists():
                raise ModelLoadError(f"{key}: no such file or folder, and not a model in the Hugging Face cache")
            name = Path(key).name
        info = fake_info(name, reasoning=self.reasoning)
        tokenizer = self.load_tokenizer(ref)
        if key in self.no_tokenizer:
            info, tokenizer = dataclasses.replace(info, has_tokenizer=False), NoFakeTokenizer(name)
        engine = FakeEngine(self.script, self.tokens_per_s, info, ttft_s=self.ttft_s, tokenizer=tokenizer,
                            paged=self.paged, block_size=self.block_size, draft_model=self.draft_model)
        self.engines.append(engine)
        return engine

    def list_models(self) -> list[ModelSummary]:
        return list(self.models)

    def is_repo_ref(self, text: str) -> bool:
        return not Path(text).expanduser().exists() and re.fullmatch(r"[\w.-]+/[\w.-]+(:[\w.-]+)?", text) is not None

    def needs_pull(self, ref: str) -> bool:
        return False

    def release_pull(self) -> None:
        self.pull_gate.set()

    def pull(self, ref: str, progress, cancel: threading.Event) -> str:
        from mlx_engine.loading.sources_hub import PullCancelled, PullPlan, RemoteFile

        if ref in self.fail:
            self.pulls.append((ref, "failed"))
            raise ModelLoadError(self.fail[ref])
        plan = PullPlan(ref, "0" * 40, "folder", [RemoteFile("model.safetensors", self.pull_bytes, None, None)])
        progress.start(plan, 0)
        chunk = self.pull_bytes // 20
        for i in range(20):
            if self.pull_hold_at is not None and i == int(20 * self.pull_hold_at):
                while not (self.pull_gate.wait(0.01) or cancel.is_set()):
                    pass
            if cancel.is_set():
                self.pulls.append((ref, "cancelled"))
                raise PullCancelled("pull cancelled; its partial files are kept, so pulling again resumes")
            progress.advance(chunk)
            time.sleep(0.005)
        progress.finish()
        self.pulls.append((ref, "done"))
        self.models.append(ModelSummary(ref, ref, "hf-cache", self.pull_bytes, 360_000_000, "bf16", 8192, "llama",
                                        format="safetensors", fits=True))
        return ref

    def removal(self, ref: str):
        from mlx_engine.loading.sources_rm import Removal

        m = next((m for m in self.models if m.ref == ref), None)
        if m is None or m.source == "embedded":
            raise ModelLoadError("the embedded model ships inside Roofline's package and cannot be removed"
                                 if m is not None else f"{ref}: not a model here")
        return Removal(ref, f"the fake {m.source} store", [], m.size_bytes)

    def remove(self, removal) -> int:
        self.models = [m for m in self.models if m.ref != removal.ref]
        self.removed.append(removal.ref)
        return removal.size_bytes

    def describe(self, ref: str) -> ModelSummary:
        path = Path(ref).expanduser()
        if not path.exists():
            raise ModelLoadError(f"{ref}: no such file or folder")
        return ModelSummary(str(path), path.name, "path", path.stat().st_size, 0, "?", 0, "?",
                            format="gguf" if path.suffix == ".gguf" else "safetensors")

    def load_tokenizer(self, ref: str | None) -> FakeTokenizer:
        key = ref or ""
        if key not in self._tokenizers:
            self._tokenizers[key] = FakeTokenizer(key or "embedded", non_ascii_split=1 if key else 3)
        return self._tokenizers[key]

    def bandwidth(self, home: Path) -> Bandwidth:
        return self._bandwidth
