"""Acceptance math: rejection sampling of drafted tokens against the target's distributions, and what a
verification yields at a given per-token acceptance."""

from __future__ import annotations

import mlx.core as mx


def rejection_sample(p: mx.array, q: mx.array, draft: mx.array, key: mx.array) -> tuple[mx.array, mx.array]:
    """One verification for N independent sequences.

    p (N, k+1, V): target distributions at each drafted position and the bonus position; q (N, k, V): the
    draft distributions the tokens `draft` (N, k) were drawn from. Returns (num_accepted (N,), next (N,)):
    the first num_accepted drafted tokens are kept, then `next` (the correction, or the bonus token)."""
    N, k = draft.shape
    V = p.shape[-1]
    u_key, r_key = mx.random.split(key)
    idx = draft.astype(mx.int32)[..., None]  # (N, k, 1)
    px = mx.take_along_axis(p[:, :k], idx, axis=-1)[..., 0]  # (N, k) target prob of each drafted token
    qx = mx.take_along_axis(q, idx, axis=-1)[..., 0]  # (N, k) draft prob, > 0 since x ~ q
    u = mx.random.uniform(shape=(N, k), key=u_key)
    accepted = (u * qx < px).astype(mx.int32)  # u < p/q, without dividing by q
    num = mx.cumprod(accepted, axis=1).sum(axis=1) if k else mx.zeros((N,), mx.int32)  # leading accepts
    q_pad = mx.concatenate([q, mx.zeros((N, 1, V), dtype=q.dtype)], axis=1)  # (N, k+1, V): no draft at bonus
    rows = num.astype(mx.int32)[:, None, None]
    p_n = mx.take_along_axis(p, rows, axis=1)[:, 0]  # (N, V)
    q_n = mx.take_along_axis(q_pad, rows, axis=1)[:, 0]
    residual = mx.maximum(p_n - q_n, 0.0)  # bonus row: p itself
    mass = residual.sum(axis=-1, keepdims=True)
    residual = mx.where(mass > 0, residual / mx.maximum(mass, 1e-30), p_n)  # p == q at a rejection: fp noise
    nxt = mx.random.categorical(mx.log(residual), axis=-1, key=r_key).astype(mx.int32)
    return num.astype(mx.int32), nxt


def point_mass(draft: mx.array, vocab_size: int) -> mx.array:
    """(..., k) tokens -> (..., k, V) one-hot float32: the proposal distribution of a deterministic draft."""
    return (draft[..., None] == mx.arange(vocab_size)).astype(mx.float32)


def tested_tokens(drafted: int, accepted: int) -> int:
    """The drafts a verification tested: the accepted ones and the first rejected one. Rejection sampling stops at
    the first rejection, so the drafts after it say nothing about acceptance. With per-token acceptance alpha
    (`expected_tokens`' model) the likelihood of a verification is alpha^accepted (1 - alpha)^(rejected?), so
    accepted / tested over verifications is its maximum-likelihood estimate. accepted / drafted (the reported
    acceptance rate) counted the untested drafts as rejected: on the torch CPU backend the draft model's drafts
    in open chat at 0.7 read 0.74, "auto" predicted no gain from them (1.09x, under its margin) and never drafted,
    while the named draft measured 1.35x over the same eight replies."""
    return accepted + (accepted < drafted)


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens per verification with k drafts each accepted with probability alpha (i.i.d.), bonus included."""
    return float(k + 1) if alpha >= 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)
