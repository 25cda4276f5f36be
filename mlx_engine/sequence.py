"""A request's state in the scheduler (`Sequence`: its tokens, cache position, mask and timings) and the events
it produces: each token's, an error, the last one with usage and stats. No tensors: its sampler and the tokens it
has not read yet live in the runner (`step.StepPlan`, `step.Sampled`)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from mlx_engine.api import GenerationEvent, RooflineError, SamplingParams, Stats, TokenLogprob, Usage
from mlx_engine.step import plain_sampling
from mlx_engine.stop import StopStringMatcher

if TYPE_CHECKING:
    from mlx_engine.reasoning import ReasoningParser
    from mlx_engine.speculative.policy import SpecState
    from mlx_engine.step import Sampled
    from mlx_engine.structured import Constraint


@dataclass(eq=False)
class Sequence:
    req_id: str
    prompt: list[int]
    params: SamplingParams
    stream: Any  # engine.GenerationStream
    vocab_size: int = 0  # its runner's (a reasoning budget's mask spans it)
    allowed: np.ndarray | None = None  # (V,) bool: the tokens its next draw may take (`Scheduler._mask`), or None
    detok: Any = None
    stops: StopStringMatcher | None = None
    fed: list[int] = field(default_factory=list)  # known tokens whose K/V the cache holds (prompt, then read tokens)
    num_cached: int = 0
    max_new: int = 0
    reserved_blocks: int = 0
    num_prefilled: int = 0  # prompt tokens in the cache
    # it has sampled a token not yet fed: the next decode step's input, which the runner keeps (`last_known`: its
    # value, where the host knows it)
    has_last: bool = False
    last_known: int | None = None
    unread: list[Sampled] = field(default_factory=list)  # sampled, not yet emitted
    num_sampled: int = 0
    num_fed_out: int = 0  # generated tokens fed back as inputs
    generated: list[int] = field(default_factory=list)  # generated tokens read so far
    n_out: int = 0
    t_start: float = 0.0
    t_first: float = 0.0
    t_last: float = 0.0
    num_forwards: int = 0  # target forwards that sampled a token for it
    spec: SpecState | None = None  # when the request speculates
    constraint: Constraint | None = None  # when the request has a response format
    reasoning: ReasoningParser | None = None  # on a reasoning model: splits the reply, holds its budget
    # SamplingParams.prompt_logprobs: per prefill chunk, (target log-probs (L,), top ids (L, k), top log-probs
    # (L, k)) as numpy, until the first event takes them
    prompt_scores: list[tuple[Any, Any, Any]] | None = None

    @property
    def scores_prompt(self) -> bool:
        return self.params.prompt_logprobs is not None

    @property
    def prefilling(self) -> bool:
        return self.num_prefilled < len(self.prompt)

    @property
    def grammar(self) -> Constraint | None:
        """The response format's grammar where it holds the next token: not while the reasoning before the answer
        is open."""
        if self.constraint is None or (self.reasoning is not None and not self.reasoning.answering):
            return None
        return self.constraint

    def steered(self) -> bool:
        """Its next draw depends on the tokens it sampled last (a grammar's mask, a reasoning budget about to run
        out), or a mask from an earlier draw must be lifted: the scheduler reads them before the step."""
        r = self.reasoning
        return (self.constraint is not None or self.allowed is not None
                or (r is not None and r.steers(len(self.unread))))

    def plain(self) -> bool:
        """It samples from its raw logits and wants no log-probabilities (`step.plain_sampling`, no mask now)."""
        return self.allowed is None and self.params.logprobs is None and plain_sampling(self.params)

    def cached_tokens(self) -> list[int]:
        """The tokens whose K/V the cache holds (all known: a fed token was read before it is recorded)."""
        return self.prompt[: self.num_prefilled] + self.generated[: self.num_fed_out]

    def score_targets(self, start: int, end: int) -> tuple[int, ...] | None:
        """A prefill chunk [start, end)'s prompt tokens to score (position p scores the prompt's token p + 1; the
        prompt's last position predicts the reply, not a prompt token); None where the request scores nothing."""
        if not self.scores_prompt:
            return None
        return tuple(self.prompt[start + 1:min(end, len(self.prompt) - 1) + 1])

    def take_prompt_logprobs(self) -> tuple[TokenLogprob, ...]:
        """The prompt's scores as TokenLogprobs, once (on the first event); () after, or when not asked for."""
        if not self.prompt_scores:
            return ()
        chunks, self.prompt_scores = self.prompt_scores, []
        lp, ids, vals = (np.concatenate([c[i] for c in chunks]) for i in range(3))
        return tuple(TokenLogprob(token_id=t, logprob=float(v), top=tuple(zip(i.tolist(), w.tolist())))
                     for t, v, i, w in zip(self.prompt[1:], lp.tolist(), ids, vals))

    def token_event(self, token: int, lp: TokenLogprob | None, text: str, from_draft: bool,
                    reasoning: str = "") -> GenerationEvent:
        logprobs = (lp,) if lp is not None else ()
        return GenerationEvent(text=text, reasoning=reasoning, token_ids=(token,), from_draft=(from_draft,),
                               logprobs=logprobs, prompt_logprobs=self.take_prompt_logprobs())

    def usage(self) -> Usage:
        return Usage(prompt_tokens=len(self.prompt), completion_tokens=self.n_out, cached_prompt_tokens=self.num_cached,
                     reasoning_tokens=self.reasoning.num_tokens if self.reasoning is not None else 0)

    def error_event(self, error: BaseException) -> GenerationEvent:
        msg = str(error) if isinstance(error, RooflineError) else f"{type(error).__name__}: {error}"
        return GenerationEvent(finish_reason="error", error=msg, usage=self.usage())

    def final_event(self, reason: str, peak_memory_bytes: Callable[[], int]) -> GenerationEvent:
        """The last event: the text the stop matcher, the reasoning parser and the detokenizer held back, usage and
        stats."""
        tail = reasoning = ""
        if self.stops is not None and not self.stops.hit:
            held = self.detok.finalize()
            if reason == "length":  # max_tokens cut the last character's bytes: no character, not a U+FFFD
                held = held.rstrip("\ufffd")
            if self.reasoning is not None:
                reasoning, held = self.reasoning.flush(held)
            tail = self.stops.flush(held)
        t_first = self.t_first or time.perf_counter()
        stats = Stats(
            ttft_s=t_first - self.stream.submitted_at,
            prefill_tps=(len(self.prompt) - self.num_cached) / max(t_first - self.t_start, 1e-9) if self.t_start
            else 0.0,
            decode_tps=(self.n_out - 1) / (self.t_last - t_first) if self.n_out > 1 and self.t_last > t_first else 0.0,
            peak_memory_bytes=peak_memory_bytes(),
            target_forwards=self.num_forwards,
        )
        st = self.spec
        if st is not None and st.num_drafted:
            stats = dataclasses.replace(stats, acceptance_rate=st.num_accepted / st.num_drafted,
                                        mean_accepted_tokens=st.num_accepted / st.num_verifies)
        return GenerationEvent(
            text=tail,
            reasoning=reasoning,
            prompt_logprobs=self.take_prompt_logprobs(),  # when no token event took them (EOS first)
            finish_reason=reason,  # type: ignore[arg-type]
            usage=self.usage(),
            stats=stats,
            stop_string=self.stops.hit if self.stops is not None else None,
            # a call is whole once the model ends it (harmony's <|call|> ends the reply): cut by max_tokens, its
            # arguments are a prefix, and no call
            tool_calls=self.reasoning.tool_calls if self.reasoning is not None and reason == "stop" else (),
        )

