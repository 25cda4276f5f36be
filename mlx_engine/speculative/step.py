"""One speculative step: propose, verify in one target forward, accept by rejection sampling, roll back."""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import mlx.core as mx

from mlx_engine.backends.base import PhaseForwards
from mlx_engine.kv.protocol import StateKVCache
from mlx_engine.speculative.accept import point_mass, rejection_sample
from mlx_engine.speculative.proposers import DraftInput

if TYPE_CHECKING:
    from mlx_engine.sampling import Sampler
    from mlx_engine.step import VerifySpan


def speculative_step(runner: PhaseForwards, sampler: Sampler,
                     span: VerifySpan) -> tuple[list[int], int, mx.array | None]:
    """One proposal and verification of a plan's verify span (`step.VerifySpan`: a sequence whose newest token,
    tokens[-1], is known and not yet in the cache), drawn by its `sampler`. Returns the new tokens (the accepted
    drafts, then one sampled token), how many of them are drafts, and their log-probability rows (n + 1, V) when
    asked for. Afterwards the cache (and the draft's) holds every token but the last new one."""
    cache, state, k = runner.cache, span.proposer, span.k
    tokens = list(span.tokens)
    n0, req = len(tokens) - 1, span.seq_id  # n0: tokens in the cache
    cache.allocate(req, tokens, k + 1)  # slots for [last, x_1..x_k], with the known tokens: no draft gets hashed

    draft: list[int] | mx.array = []
    q = None
    constraint = span.grammar  # a response format: drafts and rows held to its grammar
    allowed = sampler.allowed  # the scheduler's mask for the next token (`Scheduler._mask`), or None
    allowed_after = None if constraint is None else (lambda ds: mx.array(constraint.allowed_along(ds)[-1:]))
    if k:
        draft, q = state.proposer.propose(DraftInput(tokens, k, sampler, lambda a, b: cache.prefill_layers(req, a, b),
                                                     allowed_after))
    sampler.allowed = allowed
    if constraint is not None and q is None:  # a copied draft (point mass): cut where the grammar refuses it
        draft = list(draft)[:constraint.consumable(list(draft))]
    m = len(draft)
    if m < k:
        cache.trim(req, n0 + m + 1)
    d = mx.array(draft, dtype=mx.int32) if not isinstance(draft, mx.array) else draft  # (m,)
    layers = cache.prefill_layers(req, n0, n0 + m + 1)
    inputs = mx.concatenate([mx.array([tokens[-1]], dtype=mx.int32), d])[None]  # (1, m+1)
    logits = runner.verify_logits(inputs, layers)  # (m+1, V)
    if constraint is not None and m:  # row i: what the grammar allows after the drafts before it
        sampler.allowed = mx.array(constraint.allowed_along(d.tolist()))
    p = sampler.probs_along(logits, d)  # (m+1, V)
    if q is None:
        q = point_mass(d, p.shape[-1])
    num, nxt = rejection_sample(p[None], q[None], d[None], sampler.next_key())
    lps = sampler.logprobs_along(logits, d) if sampler.params.logprobs is not None else None
    mx.eval(num, nxt, d)
    n = int(num.item())
    new = d.tolist()[:n] + [int(nxt.item())]

    keep = n0 + 1 + n  # the cache keeps last and the accepted drafts
    cache.trim(req, keep)
    if cache.capabilities.state_slots:  # a recurrent state read every draft: back, then the kept ones again
        _replay(runner, cast(StateKVCache, cache), req, tokens + new[:-1])
    if m:
        state.rollback(keep)
    sampler.accept(mx.array([new], dtype=mx.int32))
    state.record(m, n)
    return new, n, (lps[: n + 1] if lps is not None else None)


def _replay(runner: PhaseForwards, cache: StateKVCache, req: str, ids: list[int]) -> None:
    """The positions a trim took the recurrent state back over (`StateKVCache.replay`), fed again: the state then
    holds exactly the kept tokens, as if the rejected drafts were never read."""
    span = cache.replay(req)
    if span is None:
        return
    start, end = span
    layers = cache.prefill_layers(req, start, end)
    runner.prefill(mx.array([ids[start:end]], dtype=mx.int32), layers)
    mx.eval(cache.state(layers))
