"""Continuous batching: every step advances every running request; requests join and leave between steps.

A step is one batched decode forward over all sequences that have a sampled token to feed, plus prefill chunks
for admitted sequences within a token budget, so a long prompt never stalls the others' decode. KV
blocks are reserved at admission for the whole request (prompt + max new tokens), so a running request
never runs out of blocks and nothing is ever preempted.

The scheduler plans; the runner computes. Each step is a plain-data `step.StepPlan` (decode rows, prefill chunks,
verify spans, masks as numpy) handed to `ModelRunner.execute`, which returns a `step.StepResult`: no tensor, no
sampler and no forward phase is the scheduler's (the runner's executor, `backends.phases`, picks the forwards).

A speculative request (`SamplingParams.speculative`) leaves the batched decode: each step it reads its
newest token, proposes k more and verifies them in its own forward over k + 1 positions (a `step.VerifySpan`:
`speculative.step.speculative_step` in the runner), so its tokens are read synchronously. "auto" requests join the
batched, pipelined decode on every step where the backend's cost curve and their acceptance say speculation does
not pay.

A request with a response format (`structured.Constraint`) is not pipelined: each step first reads the token it
sampled in the last one, since the grammar's mask for its next token depends on it. Speculating, its verification
masks each row with the grammar's state after the drafts before it.

On a reasoning model each emitted token goes through the request's `reasoning.ReasoningParser`, which splits the
reply into reasoning and answer (stop strings and the grammar see the answer only). A reasoning budget is held
exactly: once the tokens not yet read could reach it, the request reads them before the step (`Sequence.steered`),
and at the budget its next draws are masked to the family's closer; speculating, its drafts stop short of it.

On a pipeline of N ranks (`RunnerCapabilities.decode_groups` N > 1) a step that only decodes plain sequences
decodes one of N groups of them in flight (`backends.base.InFlightDecode.launch`): the other ranks run that group's
step while rank 0 finishes an earlier group's, whose tokens come back from the same call; each group's next step
needs only its own tokens. A step that does anything else first settles every group in flight.

A request with `prompt_logprobs` is prefilled whole (no prefix-cache hits: a cached block has no logits), and
its chunks' logits at every position, packed with the step's other rows like any chunk, score its prompt. With
max_tokens=0 it samples nothing and ends ("length") at the step that prefills its last chunk.
"""

from __future__ import annotations

import math
import time
from collections import deque
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from mlx_engine.api import DEFAULT_MAX_SEQS, RooflineError, SamplingParams, TokenLogprob
from mlx_engine.backends.base import ModelRunner
from mlx_engine.kv.protocol import StateKVCache
from mlx_engine.scheduler_speculation import SpeculationPolicy
from mlx_engine.sequence import Sequence
from mlx_engine.step import DecodeRow, NewSequence, PrefillChunk, Sampled, StepPlan, StepResult, VerifySpan
from mlx_engine.stop import StopStringMatcher

if TYPE_CHECKING:
    from mlx_engine.speculative.cost import CostCurve

DEFAULT_TOKEN_BUDGET = 512  # tokens per step (decode rows + prefill chunk tokens)


class Scheduler(SpeculationPolicy):
    def __init__(self, runner: ModelRunner, token_budget: int | None = None, max_seqs: int = DEFAULT_MAX_SEQS):
        self.runner = runner
        # default: DEFAULT_TOKEN_BUDGET, or one whole prefill chunk when the runner's chunks are larger
        self.token_budget = token_budget or max(DEFAULT_TOKEN_BUDGET, runner.prefill_chunk_size)
        width = runner.capabilities.max_batch  # the contiguous cache holds one
        self.max_seqs = max_seqs if width is None else min(max_seqs, width)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._counter = 0
        self.num_steps = 0
        self.trace: list[tuple[int, int]] | None = None  # set to [] to record (decode rows, prefill tokens) per step
        self.retired: list[Sequence] | None = None  # set to [] to keep each request's state as it ends (benchmarks)
        self.cost_curve: CostCurve | None = None  # measured at the first "auto" request
        # proposer -> [accepted, tested] draft tokens over finished requests ("auto"'s priors; `tested_tokens`)
        self.acceptance: dict[str, list[int]] = {}
        self.decode_groups = runner.capabilities.decode_groups
        self._flying: dict[str, Sequence] = {}  # sequences whose step is in flight (their token is not back yet)
        self._by_id: dict[str, Sequence] = {}  # the running sequences
        # sequences started and ended since the last plan: the runner makes and drops their samplers
        self._new: list[NewSequence] = []
        self._finished: list[str] = []

    def add(self, prompt: list[int], params: SamplingParams, stream: Any, constraint: Any = None,
            reasoning: Any = None) -> None:
        self._counter += 1
        self.waiting.append(Sequence(f"req-{self._counter}", prompt, params, stream, constraint=constraint,
                                     reasoning=reasoning))

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def close(self) -> None:
        """Ends every request with "cancelled" (the engine is closing)."""
        for seq in list(self.running):
            self._retire(seq, "cancelled")
        while self.waiting:
            self._finish(self.waiting.popleft(), "cancelled")

    # --- admission --------------------------------------------------------------------------------

    def _blocks_for(self, seq: Sequence) -> int:
        return self.runner.cache.blocks_for(len(seq.prompt) + seq.max_new)

    def _admit(self) -> None:
        cache = self.runner.cache
        for seq in [s for s in self.waiting if s.stream.cancelled.is_set()]:  # anywhere in the queue
            self.waiting.remove(seq)
            self._finish(seq, "cancelled")
        while self.waiting and len(self.running) < self.max_seqs:
            seq = self.waiting[0]
            seq.max_new = min(seq.params.max_tokens, self.runner.context_length - len(seq.prompt))
            if cache.capabilities.paged:
                # blocks still owed to running sequences must stay available to them
                owed = sum(s.reserved_blocks - cache.num_blocks_held(s.req_id) for s in self.running)
                need = self._blocks_for(seq)
                if need > cache.num_free_blocks() - owed:
                    if not self.running:  # nothing will free blocks: unreachable after check_fits
                        self.waiting.popleft()
                        self._fail(seq, RooflineError("no free KV blocks for this request"))
                        continue
                    return  # wait for running requests to finish
                seq.reserved_blocks = need
            self.waiting.popleft()
            self._start(seq)

    def _start(self, seq: Sequence) -> None:
        if not self.running:
            self.runner.reset_peak_memory()
        seq.t_start = time.perf_counter()
        # a prompt to score is computed whole: a cached prefix has no logits to give
        seq.num_cached = self.runner.cache.start(seq.req_id, seq.prompt, reuse=not seq.scores_prompt)
        seq.prompt_scores = [] if seq.scores_prompt else None
        seq.num_prefilled = seq.num_cached
        seq.vocab_size = self.runner.vocab_size
        # its sampler now (a logit bias outside the vocabulary fails here, before the step)
        self._new.append(NewSequence(seq.req_id, seq.params, tuple(seq.prompt)))
        self._execute()
        seq.detok = self.runner.tokenizer.detokenizer()
        seq.stops = StopStringMatcher(seq.params.stop)
        seq.spec = self._spec_state(seq.params)
        self.running.append(seq)
        self._by_id[seq.req_id] = seq

    # --- the step ---------------------------------------------------------------------------------

    def step(self) -> None:
        """Invariant: at entry and exit every running sequence's cache holds its prompt prefix
        `num_prefilled` and its first `num_fed_out` generated tokens; a decoding sequence's newest sampled
        token `last` is not yet fed and is its next input; tokens are emitted one step after they are
        sampled (the next step is queued on the lazy tokens first, so the host never waits on an idle
        device); the tokens scheduled in a step never exceed `token_budget`, and every decoding sequence
        advances by one token each step (in flight on a pipeline: each group in turn, `_flight_group`)."""
        self.num_steps += 1
        for seq in [s for s in self.running if s.stream.cancelled.is_set()]:
            self._retire(seq, "cancelled")
        self._admit()
        for seq in [s for s in self.running if s.steered()]:
            self._read_all(seq)  # its next mask (a grammar's, a reasoning budget's) depends on the tokens sampled last
            if seq in self.running:
                self._mask(seq)
        if not self.running:
            return
        try:
            new, speculating = self._queue_step()
        except Exception as e:  # noqa: BLE001 - a failed forward fails the requests in this step, not the engine
            for seq in list(self.running):
                self._retire(seq, "error", error=e)
            self.runner.cache.drop()
            self._flying.clear()
            return
        for seq, k in speculating:
            self._speculate(seq, k)
        for seq in [s for s in self.running if not s.max_new and not s.prefilling]:
            self._retire(seq, "length")  # max_tokens=0: the prompt is scored, nothing is generated
        self._read(new)
        if self._finished and not self.has_work():  # idle: the runner lets go of the ended sequences' state now
            self._execute()

    def _queue_step(self) -> tuple[set[Sequence], list[tuple[Sequence, int]]]:
        """Plans this step's batched forwards and has the runner start them; returns the sequences that sampled a
        token in them, and the speculative sequences (with their k) that step on their own."""
        group = self._flight_group()
        if group is None and self._flying:  # every token back first, then this step as its sequences stand
            self._land(self._execute(settle=True).landed)
            group = self._flight_group()
        if group is not None:
            rows = self._decode_rows(group)
            self._flying.update((s.req_id, s) for s in group)
            self._land(self._execute(decode=rows, in_flight=True).landed)
            if self.trace is not None:
                self.trace.append((len(group), 0))
            return set(), []  # the tokens that came back are evaluated: all may be read
        decoding, speculating = [], []
        for s in self.running:
            if s.has_last and s.num_sampled < s.max_new:
                k = self._spec_k(s)
                if k is None:
                    decoding.append(s)
                else:
                    speculating.append((s, k))
        budget = self.token_budget - len(decoding)
        chunks: list[PrefillChunk] = []
        for s in [s for s in self.running if s.prefilling]:
            if budget <= 0:
                break
            start = s.num_prefilled
            end = min(len(s.prompt), start + min(budget, self.runner.prefill_chunk_size))
            budget -= end - start
            samples = end == len(s.prompt) and s.max_new > 0
            chunks.append(PrefillChunk(s.req_id, start, end, tuple(s.prompt[start:end]), samples,
                                       s.score_targets(start, end), s.allowed if samples else None))
        rows = self._decode_rows(decoding)
        result = self._execute(decode=rows, prefill=tuple(chunks))
        for c in chunks:
            self._by_id[c.seq_id].num_prefilled = c.end
        for seq_id, scores in result.prompt_scores:
            prompt_scores = self._by_id[seq_id].prompt_scores
            assert prompt_scores is not None
            prompt_scores.append(scores)
        for c in chunks:
            spec = self._by_id[c.seq_id].spec
            if c.samples and spec is not None:  # prefilled now: a draft model prefills its own cache
                spec.prefill(self._by_id[c.seq_id].prompt)
        if self.trace is not None:
            self.trace.append((len(decoding), self.token_budget - len(decoding) - budget))
        new = set()
        for seq_id, token in result.sampled:
            s = self._by_id[seq_id]
            s.has_last, s.last_known = True, None
            s.num_sampled += 1
            s.num_forwards += 1
            s.unread.append(token)
            new.add(s)
        return new, speculating

    def _execute(self, **parts: Any) -> StepResult:
        """The runner runs a plan of `parts`, after telling it of the sequences that started and ended since."""
        cache = self.runner.cache
        if cache.capabilities.state_slots:  # a hybrid: each row's recurrent-state slot (`kv.state`)
            rows = (*parts.get("decode", ()), *parts.get("prefill", ()))
            parts["state_slots"] = tuple(cast(StateKVCache, cache).state_slot(r.seq_id) for r in rows)
        plan = StepPlan(new=tuple(self._new), finished=tuple(self._finished), **parts)
        self._new, self._finished = [], []
        return self.runner.execute(plan)

    def _decode_rows(self, decoding: list[Sequence]) -> tuple[DecodeRow, ...]:
        """A decode row per sequence, each fed its newest token (`num_fed_out` counts it from here)."""
        rows = tuple(DecodeRow(s.req_id, tuple(s.cached_tokens()), s.last_known, s.allowed) for s in decoding)
        for s in decoding:
            s.num_fed_out += 1
        return rows

    def _flight_group(self) -> list[Sequence] | None:
        """The sequences this step decodes in flight (`decode_groups` > 1): where every running sequence decodes
        plainly (none prefilling, speculating, constrained, or wanting log-probabilities) and at least two do, the
        next ceil(n / decode_groups) of those not in flight; None: a step in lockstep."""
        if self.decode_groups < 2 or any(s.prefilling or s.spec is not None or s.constraint is not None
                                         or (s.reasoning is not None and s.reasoning.budgeted)
                                         or not s.plain() for s in self.running):
            return None
        decoding = [s for s in self.running if s.has_last and s.num_sampled < s.max_new]
        if len(decoding) < 2:
            return None
        ready = [s for s in decoding if s.req_id not in self._flying]
        return ready[: math.ceil(len(decoding) / self.decode_groups)] or None

    def _land(self, landed: tuple[tuple[tuple[str, ...], tuple[Sampled, ...]], ...]) -> None:
        """Tokens back from groups' steps in flight: each sequence's next input, read this step."""
        for ids, tokens in landed:
            for seq_id, token in zip(ids, tokens):
                s = self._flying.pop(seq_id, None)
                if s is not None and s in self.running:  # (not cancelled meanwhile)
                    s.has_last, s.last_known = True, None
                    s.num_sampled += 1
                    s.num_forwards += 1
                    s.unread.append(token)

    def _speculate(self, s: Sequence, k: int) -> None:
        """A speculative sequence's step: read its newest token, propose k more, verify, emit."""
        self._read_all(s)
        if s not in self.running:
            return
        drafted_before = s.spec.num_drafted
        span = VerifySpan(s.req_id, tuple(s.prompt + s.generated), k, s.spec, s.grammar, s.allowed)
        try:
            (verified,) = self._execute(verify=(span,)).verified
        except Exception as e:  # noqa: BLE001 - one request's failure is its own
            return self._retire(s, "error", error=e)
        if verified.error is not None:
            return self._retire(s, "error", error=verified.error)
        new, num_drafted = verified.tokens, verified.num_drafted
        if s.spec.mode == "auto":
            s.spec.settle(self._cost_curve(), s.spec.num_drafted - drafted_before, len(new))
        s.num_fed_out += 1 + num_drafted
        s.num_sampled += len(new)
        s.num_forwards += 1
        s.has_last, s.last_known = True, new[-1]
        now = time.perf_counter()
        for i, token in enumerate(new):
            if s not in self.running:
                break
            try:
                self._emit(s, token, verified.logprobs[i], now, from_draft=i < num_drafted)
            except Exception as e:  # noqa: BLE001
                self._retire(s, "error", error=e)

    def _read_all(self, s: Sequence) -> None:
        while s.unread and s in self.running:
            sampled = s.unread.pop(0)
            try:
                self._emit(s, *sampled.read(), time.perf_counter())
            except Exception as e:  # noqa: BLE001
                self._retire(s, "error", error=e)

    def _read(self, sampled_now: set[Sequence]) -> None:
        """Emits what earlier steps sampled: all unread tokens but the one each sequence sampled in this
        step (whose value this step's forward is still computing), or all when it will sample no more."""
        for s in list(self.running):
            keep = 1 if s in sampled_now and s.num_sampled < s.max_new else 0
            while len(s.unread) > keep and s in self.running:
                sampled = s.unread.pop(0)
                try:
                    self._emit(s, *sampled.read(), time.perf_counter())
                except Exception as e:  # noqa: BLE001 - one request's failure (detokenizer, stops) is its own
                    self._retire(s, "error", error=e)

    def _mask(self, seq: Sequence) -> None:
        """A steered sequence's mask for this step, before any forward is planned (its grammar's, narrowed or
        lifted by its reasoning; None: no mask): a grammar that fails (a dead end, a resource limit) fails its own
        request, not the step's others."""
        try:
            grammar = seq.grammar
            allowed = None if grammar is None else grammar.allowed()
            if seq.reasoning is not None:
                allowed = seq.reasoning.mask(allowed, seq.vocab_size)
            seq.allowed = None if allowed is None else np.asarray(allowed)
        except Exception as e:  # noqa: BLE001 - one request's failure is its own
            self._retire(seq, "error", error=e)

    def _emit(self, seq: Sequence, token: int, lp: TokenLogprob | None, now: float, from_draft: bool = False) -> None:
        if seq.n_out == 0 and seq.t_first == 0.0:
            seq.t_first = now
        seq.t_last = now
        seq.generated.append(token)
        self.runner.cache.record(seq.req_id, seq.cached_tokens())
        if token in self.runner.eos_ids and not seq.params.ignore_eos:
            return self._retire(seq, "stop")
        piece, reasoning = seq.detok.add_token(token), ""
        if seq.reasoning is not None:
            reasoning, piece = seq.reasoning.feed(token, piece)
        if (seq.constraint is not None and token not in self.runner.eos_ids  # (EOS here: ignore_eos)
                and (seq.reasoning is None or seq.reasoning.answer_token)):
            seq.constraint.consume(token)
        seq.n_out += 1
        text, hit = seq.stops.feed(piece)
        seq.stream.events.put(seq.token_event(token, lp, text, from_draft, reasoning))
        if hit or (seq.constraint is not None and seq.constraint.done):
            return self._retire(seq, "stop")
        if seq.n_out >= seq.max_new:
            return self._retire(seq, "length")

    # --- leaving ----------------------------------------------------------------------------------

    def _retire(self, seq: Sequence, reason: str, error: BaseException | None = None) -> None:
        if self.retired is not None:
            self.retired.append(seq)
        if seq in self.running:
            self.running.remove(seq)
            del self._by_id[seq.req_id]
            self._finished.append(seq.req_id)
            if seq.spec is not None:
                seq.spec.close()
                for p, (accepted, _, tested) in zip(seq.spec.proposers, seq.spec.tallies):
                    tally = self.acceptance.setdefault(p.name, [0, 0])
                    tally[0] += accepted
                    tally[1] += tested
            if error is None:
                self.runner.cache.finish(seq.req_id, seq.cached_tokens())
            else:
                self.runner.cache.drop_request(seq.req_id)
        if error is not None:
            return self._fail(seq, error)
        self._finish(seq, reason)

    def _fail(self, seq: Sequence, error: BaseException) -> None:
        seq.stream.events.put(seq.error_event(error))

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.stream.events.put(seq.final_event(reason, self.runner.peak_memory_bytes))
