"""A `StepPlan` run through a runner's phase forwards (`backends.base.PhaseForwards`): the plan executor every
backend shares. It owns what the scheduler no longer touches: each sequence's sampler and the token it sampled
last (kept lazy, where it was computed, so the next step's inputs need no host sync), the KV views of each
forward, the token tensors, and which forward serves the step:

- decode rows and prefill chunks, more than one part: one packed forward (`KVCapabilities.packed`);
- else a decode step, then a forward per prefill chunk;
- `in_flight`: the decode rows start on a pipeline (`InFlightDecode.launch`), their tokens come back later;
- a verify span: `speculative.step.speculative_step`.

Plain rows (`Sampler.plain`: raw logits, no log-probabilities) are drawn by the runner where its logits are
(`decode_sample` / `packed_sample`); the others' logits go through their samplers here."""

from __future__ import annotations

import dataclasses
import time
from typing import Any, cast

import mlx.core as mx

from mlx_engine.backends.base import InFlightDecode, PhaseForwards, SequenceWork
from mlx_engine.kv.protocol import StateKVCache
from mlx_engine.sampling import Sampler, target_logprobs, token_logprob
from mlx_engine.step import DecodeRow, PrefillChunk, StepPlan, StepResult, Verified, VerifySpan


class LazyToken:
    """A token drawn this step, evaluated in the background (`mx.async_eval`) and read a step later."""

    __slots__ = ("token", "lp", "top")

    def __init__(self, token: mx.array, lp: mx.array | None, top: int | None):
        self.token, self.lp, self.top = token, lp, top

    def read(self) -> tuple[int, Any]:
        token = int(self.token.item())
        return token, None if self.lp is None else token_logprob(token, self.lp, self.top or 0)


class PhaseExecutor:
    """Runs plans on a runner's phase forwards and its cache."""

    def __init__(self, runner: PhaseForwards):
        self.runner = runner
        self.samplers: dict[str, Sampler] = {}
        self.last: dict[str, mx.array] = {}  # each decoding sequence's newest token (lazy): its next input

    # --- the plan ---------------------------------------------------------------------------------

    def execute(self, plan: StepPlan) -> StepResult:
        t0 = time.perf_counter()
        for seq_id in plan.finished:
            self.samplers.pop(seq_id, None)
            self.last.pop(seq_id, None)
        for new in plan.new:
            self.samplers[new.seq_id] = Sampler(new.params, self.runner.vocab_size, prompt_token_ids=list(new.prompt))
        for row in (*plan.decode, *plan.prefill, *plan.verify):
            allowed = row.allowed
            self.samplers[row.seq_id].allowed = None if allowed is None else mx.array(allowed)[None]
        landed: list[Any] = []
        if plan.settle:
            landed += self._landed(cast(InFlightDecode, self.runner).settle())
        sampled: list[tuple[str, LazyToken]] = []
        scores: list[Any] = []
        if plan.in_flight:
            landed += self._launch(plan.decode)
        elif plan.decode or plan.prefill:
            packed = len(plan.decode) + len(plan.prefill) > 1 and self.runner.cache.capabilities.packed
            if packed:
                self._packed(plan.decode, plan.prefill, sampled, scores)
            else:
                self._separate(plan.decode, plan.prefill, sampled, scores)
            for seq_id, s in sampled:
                self.last[seq_id] = s.token
            if sampled:
                mx.async_eval([s.token for _, s in sampled] + [s.lp for _, s in sampled if s.lp is not None])
        t1 = time.perf_counter()
        verified = tuple(self._verify(span) for span in plan.verify)
        return StepResult(sampled=tuple(sampled), landed=tuple(landed), prompt_scores=tuple(scores),
                          verified=verified, timings={"forwards": t1 - t0, "verify": time.perf_counter() - t1})

    # --- forwards ---------------------------------------------------------------------------------

    def _input(self, row: DecodeRow) -> mx.array:
        return self.last[row.seq_id] if row.token is None else mx.array(row.token, dtype=mx.int32)

    def _plain(self, seq_ids: list[str]) -> bool:
        """Every one samples from its raw logits and wants no log-probabilities: the runner samples them where the
        logits are (`packed_sample`), rather than each row's logits going through the host."""
        return all(self.samplers[i].plain and self.samplers[i].params.logprobs is None for i in seq_ids)

    def _sample(self, seq_id: str, logits: mx.array) -> LazyToken:
        sampler = self.samplers[seq_id]
        token = sampler.sample(logits)  # (1,)
        top = sampler.params.logprobs
        lp = sampler.logprobs(logits) if top is not None else None  # penalties before the token
        sampler.accept(token)
        return LazyToken(token[0], lp, top)

    def _score(self, chunk: PrefillChunk, logits: mx.array, scores: list[Any]) -> None:
        """A scoring chunk's logits (end - start, V) -> its positions' scores of the prompt, as numpy."""
        import numpy as np

        targets = chunk.score_targets or ()
        if not targets:
            return
        top = self.samplers[chunk.seq_id].params.prompt_logprobs or 0
        out = target_logprobs(logits[:len(targets)], list(targets), top)
        mx.eval(out)  # small: the (m, V) logits need not outlive the step
        scores.append((chunk.seq_id, tuple(np.array(a) for a in out)))

    def _separate(self, decode: tuple[DecodeRow, ...], chunks: tuple[PrefillChunk, ...],
                  sampled: list[Any], scores: list[Any]) -> None:
        """A decode step of every decode row, then a forward per prefill chunk."""
        runner, cache = self.runner, self.runner.cache
        if decode:
            ids = [r.seq_id for r in decode]
            layers = cache.decode_layers(ids, [list(r.known) for r in decode])
            inputs = mx.stack([self._input(r) for r in decode]).reshape(len(decode), 1)  # (B, 1), lazy
            if self._plain(ids):
                tokens = runner.decode_sample(inputs, layers, [self.samplers[i] for i in ids])  # (B,)
                sampled += [(i, LazyToken(tokens[b], None, None)) for b, i in enumerate(ids)]
            else:
                logits = runner.decode_logits(inputs, layers)  # (B, V)
                sampled += [(i, self._sample(i, logits[b : b + 1])) for b, i in enumerate(ids)]
        for c in chunks:
            c = self._state_aligned(c)
            layers = cache.prefill_layers(c.seq_id, c.start, c.end)
            inputs = mx.array([list(c.token_ids)], dtype=mx.int32)
            logits = None
            if c.score_targets is not None:  # logits at every position: the chunk's rows score the prompt
                logits = runner.packed_logits(inputs, layers, list(range(c.end - c.start)))
                self._score(c, logits, scores)
            if c.samples:  # the last chunk: its last position gives the first token
                if logits is None and self._plain([c.seq_id]):  # drawn where a packed step draws it: no seed moves
                    sampler = self.samplers[c.seq_id]
                    sampled.append((c.seq_id, LazyToken(runner.decode_sample(inputs, layers, [sampler])[0], None,
                                                        None)))
                else:
                    last = logits[-1:] if logits is not None else runner.prefill_logits(inputs, layers)
                    sampled.append((c.seq_id, self._sample(c.seq_id, last)))
            else:
                if logits is None:
                    runner.prefill(inputs, layers)
                mx.eval(cache.state(layers))

    def _state_aligned(self, c: PrefillChunk) -> PrefillChunk:
        """A hybrid's chunk runs up to its last state snapshot boundary first (`StateKVCache.split_at`), so a later
        prompt sharing that prefix starts from the state there (prefix caching); returns what is left of it."""
        cache = self.runner.cache
        if not cache.capabilities.state_slots or c.score_targets is not None:
            return c
        cut = cast(StateKVCache, cache).split_at(c.start, c.end)
        if cut is None:
            return c
        head = c.token_ids[: cut - c.start]
        layers = cache.prefill_layers(c.seq_id, c.start, cut)
        self.runner.prefill(mx.array([list(head)], dtype=mx.int32), layers)
        mx.eval(cache.state(layers))
        return dataclasses.replace(c, start=cut, token_ids=c.token_ids[cut - c.start:])

    def _packed(self, decode: tuple[DecodeRow, ...], chunks: tuple[PrefillChunk, ...],
                sampled: list[Any], scores: list[Any]) -> None:
        """One forward over the decode rows and prefill chunks packed together (`PackedView`): every projection and
        MLP is one GEMM over all rows, where a forward per prefill chunk paid the whole layer stack's fixed cost
        again (on MLX's CPU backend about as much as a decode step)."""
        runner, cache = self.runner, self.runner.cache
        chunks = tuple(self._state_aligned(c) for c in chunks)
        layers = cache.packed_layers([r.seq_id for r in decode], [list(r.known) for r in decode],
                                     [(c.seq_id, c.start, c.end) for c in chunks])
        parts = [mx.stack([self._input(r) for r in decode])] if decode else []  # lazy: sampled last step
        parts += [mx.array(list(c.token_ids), dtype=mx.int32) for c in chunks]
        rows, sampling = list(range(len(decode))), [r.seq_id for r in decode]
        row = len(decode)
        for c in chunks:
            row += c.end - c.start
            if c.samples:  # its last chunk: the last row gives the first token
                rows.append(row - 1)
                sampling.append(c.seq_id)
        inputs = mx.concatenate(parts).reshape(1, -1)
        scored = []  # scoring chunks: (chunk, where its rows begin in `rows`)
        row = len(decode)
        for c in chunks:
            if c.score_targets is not None:  # every row of the chunk, after the rows that sample
                scored.append((c, len(rows)))
                rows = rows + list(range(row, row + c.end - c.start))
            row += c.end - c.start
        if self._plain(sampling) and not scored:
            tokens = runner.packed_sample(inputs, layers, rows, [self.samplers[i] for i in sampling])  # None: no rows
            sampled += [(i, LazyToken(tokens[b], None, None)) for b, i in enumerate(sampling)]
        else:
            logits = runner.packed_logits(inputs, layers, rows)
            sampled += [(i, self._sample(i, logits[b : b + 1])) for b, i in enumerate(sampling)]
            for c, first in scored:
                self._score(c, logits[first : first + c.end - c.start], scores)

    def _launch(self, decode: tuple[DecodeRow, ...]) -> list[Any]:
        """The decode rows' step in flight, through the views and inputs a step of them alone would use (packed
        rows for several sequences, a decode step for one), so each row computes as there."""
        runner, cache = cast(InFlightDecode, self.runner), self.runner.cache
        ids, known = [r.seq_id for r in decode], [list(r.known) for r in decode]
        last = mx.stack([self._input(r) for r in decode])
        if len(decode) > 1 and cache.capabilities.packed:
            layers, inputs = cache.packed_layers(ids, known, []), last.reshape(1, -1)
        else:
            layers, inputs = cache.decode_layers(ids, known), last.reshape(len(decode), 1)
        return self._landed(runner.launch(inputs, layers, [self.samplers[i] for i in ids], tuple(ids)))

    def _landed(self, landed: list[tuple[Any, Any]]) -> list[Any]:
        out = []
        for ids, tokens in landed:
            for b, i in enumerate(ids):
                if i in self.samplers:  # (not finished meanwhile)
                    self.last[i] = tokens[b]
            out.append((ids, tuple(LazyToken(tokens[b], None, None) for b in range(len(ids)))))
        return out

    def _verify(self, span: VerifySpan) -> Verified:
        from mlx_engine.speculative.step import speculative_step

        sampler = self.samplers[span.seq_id]
        try:
            new, num_drafted, lps = speculative_step(self.runner, sampler, span)
        except Exception as e:  # noqa: BLE001 - one request's failure is its own
            return Verified(span.seq_id, error=e)
        self.last[span.seq_id] = mx.array(new[-1], dtype=mx.int32)
        top = sampler.params.logprobs
        logprobs = tuple(None if lps is None else token_logprob(t, lps[i:i + 1], top or 0) for i, t in enumerate(new))
        return Verified(span.seq_id, tuple(new), num_drafted, logprobs)



class PlanExecution:
    """`ModelRunner.execute` and the typed accessors for a runner that is its own `PhaseForwards` and `SequenceWork`
    and is no `backends.common.CacheRunner` (the distributed runner)."""

    _executor: PhaseExecutor | None = None

    def execute(self, plan: StepPlan) -> StepResult:
        if self._executor is None:
            self._executor = PhaseExecutor(self.forwards())
        return self._executor.execute(plan)

    def forwards(self) -> PhaseForwards:
        return cast("PhaseForwards", self)

    def sequences(self) -> SequenceWork:
        return cast("SequenceWork", self)
