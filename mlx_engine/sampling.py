"""Per-request token sampling: logit bias, penalties, temperature, top-k / top-p / min-p, draws.

Order of operations (HF `LogitsProcessorList` / vLLM):

    x = where(allowed, logits, -inf)                    # a response format's grammar (structured.py)
    x = x + logit_bias
    x = where(seen, where(x > 0, x / r, x * r), x)     # CTRL repetition penalty, prompt + output
    x = x - frequency * count - presence * (count > 0)  # OpenAI penalties, output tokens only
    -- process_logits() returns this; logprobs() is its log-softmax --
    z = x / temperature
    keep z >= max(thr_top_k, thr_top_p, thr_min_p)      # each filter keeps the argmax, so >= 1 token
    token ~ softmax(z)                                  # argmax(x) when temperature == 0

Filters are thresholds on the scaled logits, so tokens tied with the last kept one are all kept (as HF
top-k does). All three filters keep a top slice of the sorted row, and top-p is computed over the
top-k survivors (renormalised), so applying them in the order top_k, top_p, min_p equals keeping
the intersection of their thresholds.

Everything per step is lazy MLX ops on (B, V) arrays: no host syncs. Penalty state is (1, V) until
rows diverge, so one history broadcasts over B rows (the speculative verifier's positions, n > 1).
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import mlx.core as mx

from mlx_engine.api import RequestError, SamplingParams, TokenLogprob
from mlx_engine.step import plain_sampling


class Sampler:
    """Samples next tokens for one request (or B rows sharing its `SamplingParams`).

    `prompt_token_ids` is one history shared by every row (`list[int]`) or one per row
    (`list[list[int]]`); it only feeds the repetition penalty. Logits are (B, V) with V ==
    `vocab_size`.
    """

    def __init__(
        self,
        params: SamplingParams,
        vocab_size: int,
        prompt_token_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
    ) -> None:
        self.params = params
        self.vocab_size = vocab_size
        self.temperature = float(params.temperature)
        self.greedy = self.temperature == 0.0
        self.top_k = params.top_k if 0 < params.top_k < vocab_size else 0
        self.top_p = float(params.top_p)
        self.min_p = float(params.min_p)

        seed = params.seed if params.seed is not None else secrets.randbits(64)
        self.seed = seed % (1 << 64)
        self._key = mx.random.key(self.seed)

        # (1, V) bool, set before each draw of a constrained request (the tokens its grammar allows) or of one whose
        # reasoning budget ran out (its closer)
        self.allowed: mx.array | None = None
        self._bias: mx.array | None = None  # (V,) float32
        if params.logit_bias:
            bad = [t for t in params.logit_bias if not 0 <= t < vocab_size]
            if bad:
                raise RequestError(f"logit_bias token ids {bad} are outside the vocabulary [0, {vocab_size})")
            ids = mx.array(list(params.logit_bias.keys()), dtype=mx.int32)
            vals = mx.array([float(v) for v in params.logit_bias.values()], dtype=mx.float32)
            self._bias = mx.zeros((vocab_size,), dtype=mx.float32).at[ids].add(vals)

        self._use_repetition = params.repetition_penalty != 1.0
        self._use_counts = params.presence_penalty != 0.0 or params.frequency_penalty != 0.0 or self._use_repetition
        self._prompt_seen: mx.array | None = None  # (1 | B, V) bool
        self._counts: mx.array | None = None  # (1 | B, V) int32, emitted tokens only
        if self._use_counts:
            self._counts = mx.zeros((1, vocab_size), dtype=mx.int32)
        if self._use_repetition and prompt_token_ids:
            per_row = isinstance(prompt_token_ids[0], Sequence)
            rows = [list(r) for r in prompt_token_ids] if per_row else [list(prompt_token_ids)]
            for r in rows:
                bad = [t for t in r if not 0 <= t < vocab_size]
                if bad:
                    raise RequestError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
            seen = mx.zeros((len(rows), vocab_size), dtype=mx.bool_)
            row_idx = mx.array([i for i, r in enumerate(rows) for _ in r], dtype=mx.int32)
            col_idx = mx.array([t for r in rows for t in r], dtype=mx.int32)
            if col_idx.size:
                seen = seen.at[row_idx, col_idx].add(True)  # bool add is logical or
            self._prompt_seen = seen

    @property
    def plain(self) -> bool:
        """No logit bias, no penalties, no response format and no mask (a reasoning budget's forced closer): a token
        depends on the raw logits, the temperature, the filters and this request's draws only, so a runner can sample
        where its logits are (`ModelRunner.packed_sample`)."""
        return plain_sampling(self.params) and self.allowed is None

    # ---- state -------------------------------------------------------------------------------

    @property
    def state(self) -> list[mx.array]:
        """Arrays carried between steps, for the caller's `mx.async_eval(tokens, *sampler.state)`."""
        return [a for a in (self._key, self._counts) if a is not None]

    def next_key(self) -> mx.array:
        """A fresh PRNG key from this request's stream (the speculative verifier's uniforms use it)."""
        self._key, sub = mx.random.split(self._key)
        return sub

    def accept(self, tokens: mx.array) -> None:
        """Record emitted tokens, (B,) or (B, n), into the penalty counts."""
        if self._counts is None:
            return
        tokens = tokens.astype(mx.int32)
        if tokens.ndim == 1:
            tokens = tokens[:, None]  # (B, n)
        B, n = tokens.shape
        counts = self._counts
        if counts.shape[0] != B:
            if counts.shape[0] != 1:
                raise ValueError(f"accept: {B} rows of tokens for a sampler holding {counts.shape[0]} rows")
            counts = mx.broadcast_to(counts, (B, self.vocab_size))
        rows = mx.broadcast_to(mx.arange(B, dtype=mx.int32)[:, None], (B, n))
        self._counts = counts.at[rows.reshape(-1), tokens.reshape(-1)].add(1)

    # ---- per step ----------------------------------------------------------------------------

    def _check(self, logits: mx.array) -> None:
        if logits.ndim != 2 or logits.shape[-1] != self.vocab_size:
            raise ValueError(f"expected logits (B, {self.vocab_size}), got {tuple(logits.shape)}")
        for s in (self._counts, self._prompt_seen):
            if s is not None and s.shape[0] not in (1, logits.shape[0]):
                raise ValueError(f"logits have {logits.shape[0]} rows, sampler state has {s.shape[0]}")

    def process_logits(self, logits: mx.array) -> mx.array:
        """(B, V) raw logits -> (B, V) float32 logits after bias and penalties, before temperature."""
        self._check(logits)
        x = logits.astype(mx.float32)  # (B, V)
        if self.allowed is not None:
            x = mx.where(self.allowed, x, -mx.inf)
        if self._bias is not None:
            x = x + self._bias
        if self._counts is not None:
            p = self.params
            if self._use_repetition:
                seen = self._counts > 0
                if self._prompt_seen is not None:
                    seen = seen | self._prompt_seen
                r = p.repetition_penalty
                x = mx.where(seen, mx.where(x > 0, x / r, x * r), x)
            if p.frequency_penalty != 0.0:
                x = x - p.frequency_penalty * self._counts.astype(mx.float32)
            if p.presence_penalty != 0.0:
                x = x - p.presence_penalty * (self._counts > 0).astype(mx.float32)
        return x

    def logprobs(self, logits: mx.array) -> mx.array:
        """(B, V) log-softmax of the processed logits (before temperature and filters)."""
        x = self.process_logits(logits)
        return x - mx.logsumexp(x, axis=-1, keepdims=True)

    def _filtered(self, x: mx.array) -> mx.array:
        """(B, V) processed logits -> temperature-scaled logits, filtered tokens at -inf."""
        z = x / self.temperature if self.temperature != 1.0 else x
        V = z.shape[-1]
        thr: mx.array | None = None  # (B, 1): keep z >= thr
        if self.top_p < 1.0:
            if self.top_k:
                cand = mx.partition(z, kth=V - self.top_k, axis=-1)[..., V - self.top_k :]  # (B, k)
            else:
                cand = z
            s = -mx.sort(-cand, axis=-1)  # (B, k | V), descending
            p = mx.softmax(s, axis=-1)  # renormalised over the top-k survivors
            mass_before = mx.cumsum(p, axis=-1, inclusive=False)  # mass ranked strictly above each token
            n_keep = mx.maximum((mass_before < self.top_p).sum(axis=-1, keepdims=True), 1)  # (B, 1)
            thr = mx.take_along_axis(s, n_keep - 1, axis=-1)  # (B, 1), >= the k-th largest
        elif self.top_k:
            thr = mx.partition(z, kth=V - self.top_k, axis=-1)[..., V - self.top_k : V - self.top_k + 1]
        if self.min_p > 0.0:
            t = mx.max(z, axis=-1, keepdims=True) + math.log(self.min_p)  # p >= min_p * p_max
            thr = t if thr is None else mx.maximum(thr, t)
        if thr is None:
            return z
        return mx.where(z >= thr, z, -mx.inf)

    def probs(self, logits: mx.array) -> mx.array:
        """(B, V) raw logits -> (B, V) the exact distribution `sample` draws from (one-hot when greedy)."""
        x = self.process_logits(logits)
        if self.greedy:
            return (mx.arange(x.shape[-1])[None, :] == mx.argmax(x, axis=-1, keepdims=True)).astype(mx.float32)
        return mx.softmax(self._filtered(x), axis=-1)

    # ---- along a drafted continuation (speculative verification) ------------------------------

    def _counts_along(self, tokens: Sequence[int] | mx.array, last_only: bool) -> mx.array | None:
        """Penalty counts after accepting `tokens` (n,) on top of this sampler's: (n + 1, V), row i
        counting tokens[:i], or (1, V) counting them all."""
        if self._counts is None or len(tokens) == 0:
            return self._counts
        if self._counts.shape[0] != 1:
            raise ValueError("speculative verification needs a single-row sampler")
        t = mx.array(tokens, dtype=mx.int32) if not isinstance(tokens, mx.array) else tokens.astype(mx.int32)
        onehot = (t[:, None] == mx.arange(self.vocab_size)[None, :]).astype(mx.int32)  # (n, V)
        if last_only:
            return self._counts + onehot.sum(axis=0, keepdims=True)
        inc = mx.concatenate([mx.zeros((1, self.vocab_size), dtype=mx.int32), mx.cumsum(onehot, axis=0)])
        return self._counts + inc  # (n + 1, V)

    @contextmanager
    def _with_counts(self, counts: mx.array | None) -> Iterator[None]:
        saved, self._counts = self._counts, counts
        try:
            yield
        finally:
            self._counts = saved

    def probs_along(self, logits: mx.array, tokens: Sequence[int] | mx.array) -> mx.array:
        """(n + 1, V) logits of the positions after each prefix of `tokens` (n,) -> (n + 1, V): row i is
        exactly what plain decoding would sample from after accepting tokens[:i] (penalties count them)."""
        with self._with_counts(self._counts_along(tokens, last_only=False)):
            return self.probs(logits)

    def logprobs_along(self, logits: mx.array, tokens: Sequence[int] | mx.array) -> mx.array:
        """As `probs_along`, for `logprobs`."""
        with self._with_counts(self._counts_along(tokens, last_only=False)):
            return self.logprobs(logits)

    def probs_after(self, logits: mx.array, tokens: Sequence[int] | mx.array) -> mx.array:
        """(1, V) logits of the position after all of `tokens` -> (1, V), penalties counting them (a draft
        model's proposal distribution q)."""
        with self._with_counts(self._counts_along(tokens, last_only=True)):
            return self.probs(logits)

    def sample(self, logits: mx.array) -> mx.array:
        """(B, V) raw logits -> (B,) int32 next tokens. Does not record them: call `accept`."""
        x = self.process_logits(logits)
        if self.greedy:
            return mx.argmax(x, axis=-1).astype(mx.int32)
        return mx.random.categorical(self._filtered(x), axis=-1, key=self.next_key()).astype(mx.int32)


def target_logprobs(logits: mx.array, targets: Sequence[int], top: int) -> tuple[mx.array, mx.array, mx.array]:
    """Scoring given text: logits (L, V) of L positions and the token that followed each -> the raw model's
    log-probability of each target (L,) float32, and each position's `top` most likely tokens, ids (L, top) int32
    and log-probabilities (L, top) float32, best first. Lazy."""
    logits = logits.astype(mx.float32)
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    lp = mx.take_along_axis(logp, mx.array(list(targets), dtype=mx.int32)[:, None], axis=-1)[:, 0]
    return (lp, *top_tokens(logp, top))


def top_tokens(logp: mx.array, top: int) -> tuple[mx.array, mx.array]:
    """logp (L, V) -> each row's `top` most likely tokens, ids (L, top) int32 and their values (L, top), best
    first. Lazy."""
    if not top:
        empty = mx.zeros((logp.shape[0], 0), dtype=logp.dtype)
        return empty.astype(mx.int32), empty
    idx = mx.argpartition(-logp, kth=top - 1, axis=-1)[:, :top]  # unordered
    vals = mx.take_along_axis(logp, idx, axis=-1)
    order = mx.argsort(-vals, axis=-1)
    return mx.take_along_axis(idx, order, axis=-1).astype(mx.int32), mx.take_along_axis(vals, order, axis=-1)


def token_logprob(token: int, lp: mx.array, top: int) -> TokenLogprob:
    """A drawn token's log-probability entry from its row `lp` (1, V), with the row's `top` best (a grammar's
    masked tokens, at -inf, are never among them)."""
    ids, vals = top_tokens(lp, top)
    return TokenLogprob(token_id=token, logprob=float(lp[0, token].item()),
                        top=tuple((i, v) for i, v in zip(ids[0].tolist(), vals[0].tolist()) if v > -math.inf))
