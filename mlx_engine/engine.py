"""The engine: one thread owns the model and all MLX work; front ends submit requests and iterate events."""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from typing import Any

import numpy as np

from mlx_engine.api import (
    LOAD_OPTIONS,
    NO_DRAFT_MODEL,
    GenerationEvent,
    GenerationRequest,
    LoadOptions,
    ModelInfo,
    ModelLoadError,
    RequestError,
    RooflineError,
    SamplingParams,
)
from mlx_engine.backends.base import ModelRunner
from mlx_engine.diagnostics import Diagnostics
from mlx_engine.engine_thread import EngineThread, engine_thread
from mlx_engine.harmony import harmony_warning
from mlx_engine.reasoning import reasoning_family, reasoning_for, template_kwargs


class GenerationStream:
    """An iterator of GenerationEvents; closing it (or breaking out of a for loop over it) cancels the request."""

    def __init__(self) -> None:
        self.events: queue.SimpleQueue[GenerationEvent | BaseException] = queue.SimpleQueue()
        self.cancelled = threading.Event()
        self.submitted_at = time.perf_counter()
        self._done = False

    def __iter__(self) -> GenerationStream:
        return self

    def __next__(self) -> GenerationEvent:
        if self._done:
            raise StopIteration
        item = self.events.get()
        if isinstance(item, BaseException):
            self._done = True
            raise item
        if item.finish_reason is not None:
            self._done = True
        return item

    def cancel(self) -> None:
        self.cancelled.set()

    def close(self) -> None:
        if not self._done:
            self.cancel()

    def __del__(self) -> None:
        cancelled = getattr(self, "cancelled", None)  # None where a Ctrl-C cut __init__ short
        if cancelled is not None:
            cancelled.set()


class Engine:
    """A loaded model behind one engine thread. Build with `Engine.load`."""

    info: ModelInfo

    def __init__(self, thread: EngineThread, runner: ModelRunner, info: ModelInfo):
        self._thread = thread
        self._runner = runner
        self.info = info
        self.tokenizer = runner.tokenizer
        self._reasoning = reasoning_for(runner.tokenizer)  # agrees with info.reasoning (`reasoning_family`)

    @classmethod
    def load(cls, model: str | None = None, **options: Any) -> Engine:
        """Loads `model` (None: the embedded SmolLM2; a GGUF file; a HF or MLX folder; a HF repo id); `options`:
        `mlx_engine.api.LOAD_OPTIONS`."""
        opts = LoadOptions.from_kwargs(options)
        from mlx_engine.backends import load_runner
        from mlx_engine.scheduler import Scheduler

        template = opts.chat_template
        if template is not None:  # checked before the model loads
            from mlx_engine.chat_template import read_chat_template

            template = read_chat_template(template)
        thread = engine_thread()
        runner = thread.call(lambda: load_runner(model, **opts.runner))
        if template is not None:
            if not runner.info.has_tokenizer:
                thread.call(runner.release)
                raise ModelLoadError(f"{runner.info.path} has no tokenizer, so a chat template cannot be used")
            runner.tokenizer.chat_template = template
            runner.info = dataclasses.replace(runner.info, reasoning=reasoning_family(runner.tokenizer))
        warning = harmony_warning(runner.tokenizer)
        if warning is not None:  # else a gpt-oss-like model would answer with its raw markup and no word why
            runner.info = dataclasses.replace(runner.info, warnings=(*runner.info.warnings, warning))
        engine = cls(thread, runner, runner.info)
        engine._scheduler = Scheduler(runner, max_seqs=opts.max_seqs)
        thread.register(engine._scheduler)
        return engine

    def diagnostics(self) -> Diagnostics:
        """The engine's insides for benchmarks and tests (`mlx_engine.diagnostics`); front ends need none of it."""
        return Diagnostics(self)

    def generate(self, request: GenerationRequest) -> GenerationStream:
        """Starts a generation and returns its event stream. Errors in the request (a prompt longer than
        the context, token ids outside the vocabulary, a template error, a response format that does not compile, a
        reasoning budget for a model without reasoning) raise RequestError here."""
        prompt_ids = _prompt_ids(self._runner, request)
        _check_speculation(self._runner, request.sampling)
        budget = request.sampling.reasoning_budget
        if budget is not None and self._reasoning is None:
            raise RequestError(f"invalid sampling parameter reasoning_budget={budget!r}: {self.info.name} does not "
                               "reason (its chat template shows no reasoning family), so there is no thinking to limit")
        # the parser reads the prompt: a generation prompt may open the reasoning itself
        reasoning = self._reasoning.parser(prompt_ids, budget) if self._reasoning is not None else None
        constraint = None
        fmt = request.sampling.response_format
        if fmt is not None:  # compiled here: a bad schema fails this call, not the engine thread
            from mlx_engine.structured import constrain

            constraint = constrain(self.tokenizer, self.info.vocab_size, fmt)
        stream = GenerationStream()
        scheduler = self._scheduler
        self._thread.submit(lambda: scheduler.add(prompt_ids, request.sampling, stream, constraint, reasoning))
        return stream

    def prompt_ids(self, request: GenerationRequest) -> list[int]:
        """The token ids `generate` would run for this request (chat template applied), validated against
        the context and the KV budget."""
        return _prompt_ids(self._runner, request)

    def forward_logits(self, token_ids: list[int]) -> np.ndarray:
        """float32 logits (T, vocab) of one forward pass over `token_ids` from an empty cache."""
        ids = _check_ids(self._runner, list(token_ids), whole=True)
        return self._thread.call(lambda: self._runner.sequences().forward_logits(ids))

    def hidden_states(self, token_ids: list[int]) -> list[np.ndarray]:
        """float32 hidden states of one forward pass over `token_ids` from an empty cache: the embedding
        output, then each decoder layer's output, each (T, hidden)."""
        ids = _check_ids(self._runner, list(token_ids), whole=True)
        return self._thread.call(lambda: self._runner.sequences().hidden_states(ids))

    def decode_bytes_per_token(self, context_tokens: int) -> int:
        """Bytes one decode step reads at this context length: weights (the embedding table only when
        tied to the head) plus K and V of every layer. Times tokens/s over bandwidth is % of roofline."""
        return self._runner.sequences().decode_bytes_per_token(context_tokens)

    def moe_routing(self) -> dict[str, Any] | None:
        """A mixture-of-experts model's recent decode steps: per step, each row's routed experts per MoE layer,
        their union and the weight bytes the step reads (shared weights plus the routed experts); with
        expert_bytes, num_experts, experts_per_token and shared_bytes. None for a dense model."""
        return self._thread.call(self._runner.sequences().moe_routing)

    def score(self, token_ids: list[int]) -> np.ndarray:
        """Log-probability of each token given those before it, float32 (T - 1,), through the engine's own
        KV cache and prefill chunks: perplexity = exp(-mean)."""
        ids = _check_ids(self._runner, list(token_ids), whole=True)
        return self._thread.call(lambda: self._runner.sequences().score(ids))

    def kv_stats(self) -> dict[str, Any]:
        """KV cache occupancy: blocks total/used/cached/free, bytes, prefix hit rate, fragmentation."""
        return self._thread.call(self._runner.sequences().kv_stats)

    def save_kv(self, path: str, request: GenerationRequest | list[int]) -> int:
        """Saves the cached KV of a conversation (a request's prompt, or token ids): every full block of
        its prefix still in the prefix cache, with the tokens and the model fingerprint. Returns tokens saved."""
        ids = _prompt_ids(self._runner, request) if isinstance(request, GenerationRequest) else list(request)
        return self._thread.call(lambda: self._runner.sequences().save_kv(path, ids))

    def restore_kv(self, path: str) -> int:
        """Loads KV saved by `save_kv` into the prefix cache, so a reopened chat needs no re-prefill. A file
        from another model or a corrupt one raises RooflineError (the chat then simply prefills). Returns
        the number of tokens restored."""
        return len(self._thread.call(lambda: self._runner.sequences().restore_kv(path)))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def close(self) -> None:
        """Frees the model and its cache (on the engine thread, after any running generation)."""
        runner, self._runner = self._runner, _Closed()
        if isinstance(runner, _Closed):
            return
        self._thread.unregister(self._scheduler)
        for seq in list(self._scheduler.waiting) + list(self._scheduler.running):
            seq.stream.cancel()
        self._thread.call(lambda: self._scheduler.close())
        self._thread.call(runner.release)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --- prompt handling: on the caller's thread (tokenizers and the runner's declared figures only, no MLX) ---


def _check_ids(runner: ModelRunner, ids: list[int], whole: bool = False) -> list[int]:
    """Token ids inside the vocabulary; `whole`: a forward over them all, so within the context too."""
    if not ids:
        raise RequestError("the prompt is empty (0 tokens)")
    bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < runner.vocab_size]
    if bad:
        raise RequestError(f"token id {bad[0]!r} is outside the vocabulary (0..{runner.vocab_size - 1})")
    if whole and len(ids) > runner.context_length:
        raise RequestError(f"the input is {len(ids)} tokens but the model's context is {runner.context_length} tokens")
    return ids


def _prompt_ids(runner: ModelRunner, request: GenerationRequest) -> list[int]:
    """The token ids a request runs (chat template applied), checked against the context and the KV budget."""
    if request.messages is not None:
        variables = template_kwargs(runner.info.reasoning, request.chat_template_kwargs, request.reasoning_effort)
        ids = runner.tokenizer.encode_chat(request.messages, add_generation_prompt=request.add_generation_prompt,
                                           **variables)
    elif request.prompt is not None:
        ids = runner.tokenizer.encode(request.prompt)
    else:
        ids = list(request.prompt_token_ids or [])
    _check_ids(runner, ids)
    context = runner.context_length
    if len(ids) >= context:
        raise RequestError(f"the prompt is {len(ids)} tokens but the model's context is {context} tokens "
                           f"(at least 1 more is needed to generate)")
    runner.cache.check_fits(len(ids) + min(request.sampling.max_tokens, context - len(ids)))
    return ids


def _check_speculation(runner: ModelRunner, params: SamplingParams) -> None:
    """Refuses a speculative mode this runner cannot serve (RequestError). "auto" is never refused: it falls back
    to plain decoding."""
    mode, caps = params.speculative, runner.capabilities
    if mode is None or mode == "auto":
        return
    if not caps.rollback:
        raise RequestError(f"speculative={mode!r} is not available for {runner.info.name}: {caps.reason('rollback')}, "
                           "so rejected draft tokens cannot be rolled back")
    if mode == "draft" and runner.draft is None:
        raise RequestError(NO_DRAFT_MODEL)
    if mode == "self" and not caps.self_draft:
        raise RequestError(f"speculative='self' {caps.reason('self_draft')}")


class _Closed:
    def __getattr__(self, name: str) -> Any:
        raise RooflineError("this engine is closed")

    def release(self) -> None:
        pass


__all__ = ["LOAD_OPTIONS", "Engine", "GenerationStream"]
