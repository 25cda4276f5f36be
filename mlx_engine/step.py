"""The two contracts between the scheduler and a runner: the scheduler hands `ModelRunner.execute` a `StepPlan`
and gets a `StepResult` back (vLLM v1's SchedulerOutput and ModelRunnerOutput). Both are Python and numpy only:
the scheduler knows neither tensors nor forward phases; which forward serves a plan (a decode step, one packed
forward, a forward per prefill chunk, a pipeline's in-flight launch), the KV views, the token tensors and the
samplers are the backend's (`backends.phases`).

A sampled token comes back as a `Sampled`, read later: a decode row's input is the token its sequence sampled in
the step before (`DecodeRow.token` None), which the runner keeps where it computed it, so the next step is queued
before the last one's tokens reach the host (the scheduler emits tokens one step behind; vLLM's async scheduling).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import numpy as np

    from mlx_engine.api import SamplingParams, TokenLogprob


@dataclass(frozen=True)
class NewSequence:
    """A sequence the runner has not seen: its sampler is made from these (penalties count the prompt)."""
    seq_id: str
    params: SamplingParams
    prompt: tuple[int, ...]


@dataclass(frozen=True)
class DecodeRow:
    """One new token of a decoding sequence. `known`: its tokens whose K/V the cache holds, as far as the host
    knows them (the cache places the new token after them and may register their full blocks). `token`: the input
    where the host knows it (after a speculative step); None: the token the runner sampled for it last."""
    seq_id: str
    known: tuple[int, ...]
    token: int | None = None
    allowed: np.ndarray | None = None  # (V,) bool: the tokens its next draw may take (a grammar, a reasoning budget)


@dataclass(frozen=True)
class PrefillChunk:
    """Prompt positions [start, end) of a sequence (`token_ids`). `samples`: its last chunk, whose last position
    draws the first token. `score_targets`: prompt_logprobs: the prompt tokens its positions predict (position p
    scores token p + 1; the prompt's last position predicts the reply), else None."""
    seq_id: str
    start: int
    end: int
    token_ids: tuple[int, ...]
    samples: bool
    score_targets: tuple[int, ...] | None = None
    allowed: np.ndarray | None = None


@dataclass(frozen=True)
class VerifySpan:
    """A speculative sequence's step: propose up to `k` drafts after `tokens` (all known; the last not yet in the
    cache), verify them in one forward, accept by rejection sampling, roll back. `proposer` is its
    `speculative.policy.SpecState` and `grammar` its response format's `structured.Constraint` where one holds the
    next token: host-side state the scheduler keeps between steps."""
    seq_id: str
    tokens: tuple[int, ...]
    k: int
    proposer: Any
    grammar: Any = None
    allowed: np.ndarray | None = None


@dataclass(frozen=True)
class StepPlan:
    """One step. `new` and `finished` come first (a finished sequence's sampler and last token are dropped); then,
    where `settle` is set, every pipeline step in flight finishes; then the decode rows and prefill chunks run in
    the forwards the runner picks for them (or, `in_flight`, the decode rows alone start on a pipeline
    (`backends.base.InFlightDecode`) and come back, tagged with their seq ids, from a later plan); then each verify
    span. `state_slots`: per decode row then per chunk, a recurrent-state slot (reserved: empty for attention-only
    models)."""
    new: tuple[NewSequence, ...] = ()
    finished: tuple[str, ...] = ()
    decode: tuple[DecodeRow, ...] = ()
    prefill: tuple[PrefillChunk, ...] = ()
    verify: tuple[VerifySpan, ...] = ()
    in_flight: bool = False
    settle: bool = False
    state_slots: tuple[int, ...] = ()

    @property
    def num_tokens(self) -> int:
        """Tokens the step feeds (decode rows and chunk tokens; not counting verifications)."""
        return len(self.decode) + sum(c.end - c.start for c in self.prefill)


class Sampled(Protocol):
    """A token a step drew, read when the scheduler emits it (a step later where the runner pipelines)."""

    def read(self) -> tuple[int, TokenLogprob | None]:
        """The token, and its log-probability entry where its request asked for log-probabilities."""
        ...


@dataclass(frozen=True)
class Verified:
    """A verify span's outcome: `tokens` (the accepted drafts, then one sampled token), how many are drafts, and
    each token's log-probability entry (None where not asked for); `error` where the step failed for this sequence
    alone (then nothing else is set)."""
    seq_id: str
    tokens: tuple[int, ...] = ()
    num_drafted: int = 0
    logprobs: tuple[TokenLogprob | None, ...] = ()
    error: BaseException | None = None


@dataclass(frozen=True)
class StepResult:
    """`sampled`: (seq id, token) of every sequence that drew a token in this step's forwards (decode rows, last
    chunks), in plan order; `landed`: (seq ids of a pipeline step launched earlier, their tokens), oldest first;
    `prompt_scores`: (seq id, (target log-probs (m,), top ids (m, k), top log-probs (m, k))) per scoring chunk;
    `timings`: host seconds per phase of building the step."""
    sampled: tuple[tuple[str, Sampled], ...] = ()
    landed: tuple[tuple[tuple[str, ...], tuple[Sampled, ...]], ...] = ()
    prompt_scores: tuple[tuple[str, tuple[np.ndarray, np.ndarray, np.ndarray]], ...] = ()
    verified: tuple[Verified, ...] = ()
    timings: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Known:
    """A token the host already holds (`Sampled` for tokens read synchronously)."""
    token: int
    logprob: TokenLogprob | None = None

    def read(self) -> tuple[int, TokenLogprob | None]:
        return self.token, self.logprob


def plain_sampling(params: SamplingParams) -> bool:
    """No logit bias, no penalties, no response format: a token depends on the raw logits, the temperature, the
    filters and the request's draws only (`sampling.Sampler.plain`, where a mask rules it out too)."""
    return (not params.logit_bias and params.presence_penalty == 0.0 and params.frequency_penalty == 0.0
            and params.repetition_penalty == 1.0 and params.response_format is None)
