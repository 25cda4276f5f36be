"""Speculative decoding: propose k tokens cheaply, verify them in one target forward, keep a prefix.

    draft   x_1..x_k ~ q_1..q_k            (prompt lookup: q_i is a point mass on x_i)
    target  p_1..p_{k+1}                   one forward over [last, x_1..x_k], each p_i exactly what plain
                                           decoding samples from there (penalties count x_<i)
    accept  x_i with prob min(1, p_i(x_i) / q_i(x_i)), in order
    reject  at the first rejected i: emit y ~ normalize(max(0, p_i - q_i)) and stop
    bonus   all k accepted: emit y ~ p_{k+1}

The emitted tokens are distributed exactly as plain sampling from p (Leviathan et al. 2023, Chen et al.
2023; gpt-fast's `speculative_decode`); with temperature 0, p and q are one-hot and this is exact greedy.
mlx-lm instead accepts x_i iff the target's own sample equals it: also lossless, but it accepts with
probability sum(p * q) instead of sum(min(p, q)), which collapses as temperature rises.

Rollback: the verify forward writes K/V for all k+1 positions; rejected ones are dropped by trimming the
block table (paged) or the buffers (contiguous). Proposers: `PromptLookup` (n-gram match in the text so
far), `DraftModel` (a small model with its own KV, kept in step), `SelfDraft` (the target's first layers
+ final norm + head, reading and writing the target's own KV of those layers, which the verify forward
then overwrites: no extra weights and no extra KV).

"auto" (`policy.SpecState.auto_k`) verifies only where the backend's cost curve and the running acceptance predict a
gain; with a draft model loaded it drafts each step by prompt lookup or by the model, whichever is predicted to
gain more (a quote is copied for free, the rest drafted by the model).

The package by job: `accept` (the acceptance math), `proposers` (the `Proposer` protocol and its three kinds),
`cost` (the cost model: a forward's cost by width, kept on disk per model and machine), `policy` ("auto"'s
constants and the per-request state that applies them), `step` (one proposal and verification), `timing` (every
timer: forward, decode step, graph forward, cost curve).
"""
