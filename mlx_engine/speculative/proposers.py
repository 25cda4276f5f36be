"""Proposers: what drafts the k tokens a verification tests. `PromptLookup` copies from the text so far,
`DraftModel` runs a small model with its own KV, `SelfDraft` runs the target's first layers."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol, runtime_checkable

import mlx.core as mx
import numpy as np

from mlx_engine.backends.base import PhaseForwards

MAX_NGRAM = 3
# a draft model's catch-up of at most this many tokens goes into the forward that gives its first draft: after a
# fully accepted proposal it had not fed its last draft, so two forwards of one row became one of two
CATCH_UP_IN_ONE = 4


@dataclass
class DraftInput:
    tokens: list[int]  # prompt + generated; the last one is not yet in the target's cache
    k: int
    sampler: Any  # the request's Sampler
    target_layers: Callable[[int, int], list[Any]]  # the target cache over positions [a, b), allocated
    # a request with a response format: drafts so far -> (1, V) bool, what its grammar allows next
    allowed_after: Callable[[list[int]], mx.array] | None = None


@runtime_checkable
class Proposer(Protocol):
    """What `SpecState` and `speculative_step` use of a proposer."""

    name: str
    draft_cost: float  # a drafted token's cost in target decode steps T(1)
    # it copies from the text, so it has a candidate only where the text recurs (`worth_trying`): prompt lookup
    copies: bool
    # its last proposal as timed: (seconds, drafted tokens, whether it caught up as usual), or None (untimed)
    last_spent: tuple[float, int, bool] | None

    def worth_trying(self, known: list[int]) -> bool:
        """Whether it has a candidate for the text `known`."""
        ...

    def prefill(self, prompt: list[int]) -> None:
        """Fills KV of its own beside the target's prefill (a draft model); a no-op where it has none."""
        ...

    def propose(self, inp: DraftInput) -> tuple[list[int] | mx.array, mx.array | None]: ...

    def rollback(self, num_tokens: int) -> None: ...

    def close(self) -> None: ...


class _NoState:
    """The defaults of a proposer that copies nothing, times nothing and keeps no KV of its own."""

    copies = False
    last_spent: tuple[float, int, bool] | None = None

    def worth_trying(self, known: list[int]) -> bool:
        return True

    def prefill(self, prompt: list[int]) -> None:
        pass

    def rollback(self, num_tokens: int) -> None:
        pass

    def close(self) -> None:
        pass


def _mask_next(inp: DraftInput, drafts: list[mx.array]) -> None:
    """Under a response format the next proposal is drawn from q masked by the grammar after the drafts so far
    (a host read of each draft: the grammar advances on host)."""
    if inp.allowed_after is not None:
        inp.sampler.allowed = inp.allowed_after([int(x.item()) for x in drafts])


def prompt_lookup(tokens: list[int] | np.ndarray, k: int, max_ngram: int = MAX_NGRAM) -> list[int]:
    """The k tokens that followed the most recent earlier occurrence of the longest suffix n-gram
    (n = max_ngram .. 1) of `tokens`; [] when no suffix recurs."""
    t = np.asarray(tokens, dtype=np.int64)
    L = len(t)
    for n in range(min(max_ngram, L - 1), 0, -1):
        windows = np.lib.stride_tricks.sliding_window_view(t[: L - 1], n)  # starts 0 .. L-1-n
        hits = np.flatnonzero((windows == t[L - n:]).all(axis=1))
        hits = hits[hits + n < L]  # a continuation exists
        if hits.size:
            start = int(hits[-1]) + n
            out = t[start:start + k].tolist()
            while len(out) < k:  # the match overlaps the suffix (a repeating run): copy on, as LZ77 does
                out.append(out[len(out) - (L - start)])
            return out
    return []


def suffix_recurs(tokens: list[int], n: int) -> bool:
    """Whether the last n tokens occurred earlier with a token after them: where prompt lookup would copy
    from at least an n-gram match."""
    t = np.asarray(tokens, dtype=np.int64)
    L = len(t)
    if L <= n:
        return False
    windows = np.lib.stride_tricks.sliding_window_view(t[: L - 1], n)
    return bool((windows == t[L - n:]).all(axis=1).any())


class PromptLookup(_NoState):
    name = "prompt-lookup"
    draft_cost = 0.0  # of a target forward, per drafted token
    copies = True
    # "auto" verifies prompt-lookup drafts only while the text's last AUTO_MIN_NGRAM tokens recur (a quote,
    # an edit, repeated code): a lone recurring token or pair predicts little, and in open chat the
    # failed probes cost more than they win
    AUTO_MIN_NGRAM = 3

    def worth_trying(self, known: list[int]) -> bool:
        return suffix_recurs(known, self.AUTO_MIN_NGRAM)

    def propose(self, inp: DraftInput) -> tuple[list[int] | mx.array, mx.array | None]:
        return prompt_lookup(inp.tokens, inp.k), None  # q: a point mass


def _draw(sampler: Any, q: mx.array) -> mx.array:
    """(1, V) proposal -> (1,) token drawn from it with the request's key (argmax when greedy)."""
    if sampler.greedy:
        return mx.argmax(q, axis=-1).astype(mx.int32)
    return mx.random.categorical(mx.log(q), axis=-1, key=sampler.next_key()).astype(mx.int32)


class DraftModel(_NoState):
    """A separate small model with the target's vocabulary; its KV (mlx-lm buffers, one set per sequence)
    holds `tokens`, kept a prefix of the sequence's accepted tokens."""

    name = "draft"
    # where the text recurs, guess its drafts from prompt lookup's copy (`propose`). Not under "auto": it drafts by
    # the model where the text recurs only once copies failed there, and its guesses (the same copies) failed too,
    # each a forward over rows thrown away. On the torch CPU backend over six replies a row, guessing took the
    # named draft from 1.82x to 2.43x (edit) and from 1.71x to 1.86x (code) at temperature 0, and "auto" from
    # 2.38x to 2.27x and from 1.61x to 1.50x.
    guesses = True

    def __init__(self, runner: PhaseForwards, draft_cost: float = 0.0):
        self.runner = runner
        self.draft_cost = draft_cost
        self.layers: list[Any] | None = None
        self.tokens: list[int] = []
        # per proposal: (rows of each forward that only caught up, rows of the catch-up in the forward that gave the
        # first draft, rows of the guess in it (logits at every row where there is one), forwards of one row after
        # it, drafts drawn); the prefill apart
        self.proposals: list[tuple[list[int], int, int, int, int]] = []
        # the last proposal: (seconds, drafted tokens, whether it was the usual one: a catch-up of at most
        # CATCH_UP_IN_ONE tokens inside the first draft's forward, and no guess)
        self.last_spent: tuple[float, int, bool] | None = None

    def _feed(self, ids: list[int]) -> None:
        r = self.runner
        if self.layers is None:
            self.layers = r.scratch_layers()
        for start in range(0, len(ids), r.prefill_chunk_size):
            r.prefill(mx.array([ids[start:start + r.prefill_chunk_size]], dtype=mx.int32), self.layers)
            mx.eval([c.state for c in self.layers])
        self.tokens += ids

    def prefill(self, prompt: list[int]) -> None:
        """The draft's own prefill, beside the target's (so the first proposal only catches up a token)."""
        self._feed(prompt[len(self.tokens):])

    def propose(self, inp: DraftInput) -> tuple[list[int] | mx.array, mx.array | None]:
        """k drafts, each drawn from the draft model's distribution after the ones before it. Where the text
        recurs, prompt lookup's copy guesses what the draft will write: the first forward also reads the guess,
        so each draft that equals its guessed token has the next row's logits already (one forward of 1 + m rows
        instead of m + 1 forwards of one). Each draft is still drawn from the draft model's distribution after the
        drafts before it (up to the rounding of a wider forward): a guess only saves forwards. From the first
        draft that differs from it, the rows after are dropped and drafting goes on token by token."""
        r = self.runner
        start = time.perf_counter()
        # catch up: the tokens since the last proposal (its last draft when all passed, plain steps' tokens)
        feed = inp.tokens[len(self.tokens):]
        tail = len(feed) if len(feed) <= CATCH_UP_IN_ONE else 1  # a short catch-up rides the first draft's forward
        chunk = self.runner.prefill_chunk_size
        catch_ups = [min(chunk, len(feed) - tail - a) for a in range(0, len(feed) - tail, chunk)]
        self._feed(feed[:-tail])
        guess = (prompt_lookup(inp.tokens, inp.k - 1) if self.guesses and inp.k > 1
                 and suffix_recurs(inp.tokens, PromptLookup.AUTO_MIN_NGRAM) else [])
        ids = mx.array([feed[-tail:] + guess], dtype=mx.int32)
        # row j: the logits after the known tokens and guess[:j]
        rows = r.verify_logits(ids, self.layers)[tail - 1:] if guess else r.decode_logits(ids, self.layers)
        self.tokens = list(inp.tokens) + guess  # what its KV holds now
        logits, guessed, singles = rows[:1], 0, 0  # guessed: drafts so far that equal the guess
        drafts, qs = [], []
        for i in range(inp.k):
            _mask_next(inp, drafts)
            q = inp.sampler.probs_after(logits, mx.concatenate(drafts) if drafts else [])  # (1, V)
            x = _draw(inp.sampler, q)  # (1,)
            drafts.append(x)
            qs.append(q)
            if i == inp.k - 1:
                break
            if guessed == i < len(guess) and int(x.item()) == guess[i]:  # its row after this draft was computed
                guessed += 1
                logits = rows[i + 1: i + 2]
                continue
            if guessed == i:  # the first draft off the guess: drop the rows the guess wrote after it
                self.rollback(len(inp.tokens) + i)
            logits = r.decode_logits(x.reshape(1, 1), self.layers)
            singles += 1
        draft = mx.concatenate(drafts)  # (k,), lazy
        mx.eval(draft, qs)
        self.tokens = list(inp.tokens) + draft.tolist()[:-1]  # x_k is not fed
        self.proposals.append((catch_ups, tail, len(guess), singles, inp.k))
        # the usual proposal (`SpecState.settle`): its catch-up rode the first forward, token by token
        self.last_spent = (time.perf_counter() - start, inp.k, tail == len(feed) and not guess)
        return draft, mx.concatenate(qs)

    def rollback(self, num_tokens: int) -> None:
        """Keep the first `num_tokens` tokens (at most all it holds)."""
        from mlx_lm.models.cache import trim_prompt_cache

        drop = len(self.tokens) - num_tokens
        if drop > 0:
            trim_prompt_cache(self.layers, drop)
            del self.tokens[num_tokens:]

    def close(self) -> None:
        self.layers, self.tokens = None, []


class SelfDraft(_NoState):
    """The target's first `num_layers` layers + final norm + head. It reads the target's own cache of those
    layers and writes its drafted positions there; the verify forward rewrites them."""

    name = "self"

    def __init__(self, runner: PhaseForwards, num_layers: int, draft_cost: float = 0.0):
        self.runner, self.num_layers, self.draft_cost = runner, num_layers, draft_cost

    def propose(self, inp: DraftInput) -> tuple[list[int] | mx.array, mx.array | None]:
        n0, N = len(inp.tokens) - 1, self.num_layers
        token = mx.array([[inp.tokens[-1]]], dtype=mx.int32)
        drafts, qs = [], []
        layers: list[Any] = []
        for i in range(inp.k):
            layers = inp.target_layers(n0 + i, n0 + i + 1)[:N]
            logits = self.runner.draft_logits(token, layers, N)  # (1, V)
            _mask_next(inp, drafts)
            q = inp.sampler.probs_after(logits, mx.concatenate(drafts) if drafts else [])
            x = _draw(inp.sampler, q)
            drafts.append(x)
            qs.append(q)
            token = x.reshape(1, 1)
        if not self.runner.cache.capabilities.paged:  # contiguous buffers: back to n0 for the verify (paged
            for c in layers:  # slots: the verify forward rewrites them)
                c.trim(inp.k)
        draft = mx.concatenate(drafts)
        return draft, mx.concatenate(qs)
