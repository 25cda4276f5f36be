"""Sampler: exact numbers on hand-made logits, a numpy twin for the filters, seeds, draws, mlx-lm parity."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import sample_utils as lm

from mlx_engine.api import RequestError, SamplingParams
from mlx_engine.sampling import Sampler
from tests.support.tolerance import assert_f32_close


def sp(**kw) -> SamplingParams:
    kw.setdefault("temperature", 1.0)
    kw.setdefault("seed", 0)
    return SamplingParams(**kw)


def row(*xs: float) -> mx.array:
    return mx.array([list(xs)], dtype=mx.float32)  # (1, V)


def np_of(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32))


# ---- numpy reference (slow, obviously correct twin; float64, positional HF-style filters) --------


def ref_processed(logits, p: SamplingParams, prompt=(), output=()):
    x = np.asarray(logits, np.float64).copy()
    for t, b in p.logit_bias.items():
        x[t] += b
    if p.repetition_penalty != 1.0:
        for t in set(prompt) | set(output):
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(output):
        x[t] -= p.presence_penalty + p.frequency_penalty * list(output).count(t)
    return x


def ref_softmax(z):
    z = z - z[np.isfinite(z)].max()
    e = np.exp(z)
    return e / e.sum()


def ref_probs(logits, p: SamplingParams, prompt=(), output=()):
    x = ref_processed(logits, p, prompt, output)
    V = len(x)
    if p.temperature == 0:
        out = np.zeros(V)
        out[int(np.argmax(x))] = 1.0
        return out
    z = x / p.temperature
    keep = np.ones(V, bool)
    order = np.argsort(-z, kind="stable")
    if 0 < p.top_k < V:
        keep[order[p.top_k :]] = False
    if p.top_p < 1.0:
        pk = ref_softmax(np.where(keep, z, -np.inf))
        mass = 0.0
        for i in order:
            if not keep[i]:
                continue
            if mass >= p.top_p:
                keep[i] = False
            mass += pk[i]
    if p.min_p > 0:
        pz = ref_softmax(z)
        keep &= pz >= p.min_p * pz.max()
    return ref_softmax(np.where(keep, z, -np.inf))


# ---- logit bias ---------------------------------------------------------------------------------


def test_logit_bias_forces_and_bans():
    logits = row(1.0, 2.0, 3.0, 4.0)
    s = Sampler(sp(temperature=0.0, logit_bias={0: 100.0, 3: -100.0}), vocab_size=4)
    np.testing.assert_allclose(np_of(s.process_logits(logits)), [[101.0, 2.0, 3.0, -96.0]], atol=1e-6)
    assert s.sample(logits).tolist() == [0]

    ban = Sampler(sp(temperature=1.0, logit_bias={3: -100.0}), vocab_size=4)
    toks = ban.sample(mx.broadcast_to(logits, (2000, 4)))
    assert not (toks == 3).any().item()
    assert ban.probs(logits)[0, 3].item() < 1e-40

    force = Sampler(sp(temperature=1.0, logit_bias={1: 100.0}), vocab_size=4)
    assert (force.sample(mx.broadcast_to(logits, (2000, 4))) == 1).all().item()


def test_logit_bias_outside_vocab_is_a_request_error():
    with pytest.raises(RequestError, match="outside the vocabulary"):
        Sampler(sp(logit_bias={4: 1.0}), vocab_size=4)


@pytest.mark.parametrize("name", ["logprobs", "prompt_logprobs"])
@pytest.mark.parametrize("value", [-1, 21, 2.0, True])
def test_logprob_counts_out_of_range_are_request_errors(name: str, value) -> None:
    with pytest.raises(RequestError, match=f"{name}={value!r}: expected an integer in \\[0, 20\\] or None"):
        SamplingParams(**{name: value})


# ---- penalties (values by hand) -----------------------------------------------------------------


def test_repetition_penalty_divides_positive_multiplies_negative():
    # seen = prompt {0, 1}; r = 2: 2.0 -> 1.0, -1.0 -> -2.0; unseen unchanged
    logits = row(2.0, -1.0, 0.5, 3.0, -2.0)
    s = Sampler(sp(repetition_penalty=2.0), vocab_size=5, prompt_token_ids=[0, 1, 1, 0])
    np.testing.assert_allclose(np_of(s.process_logits(logits)), [[1.0, -2.0, 0.5, 3.0, -2.0]])
    s.accept(mx.array([3]))  # output tokens count too
    s.accept(mx.array([3]))  # applied once per token, not per occurrence
    np.testing.assert_allclose(np_of(s.process_logits(logits)), [[1.0, -2.0, 0.5, 1.5, -2.0]])


def test_presence_and_frequency_penalties_count_output_tokens_only():
    logits = row(0.0, 0.0, 0.0, 0.0)
    s = Sampler(sp(presence_penalty=0.5, frequency_penalty=0.25), vocab_size=4, prompt_token_ids=[3, 3])
    np.testing.assert_allclose(np_of(s.process_logits(logits)), [[0.0, 0.0, 0.0, 0.0]])
    for t in (2, 2, 1):
        s.accept(mx.array([t]))
    # token 2: -0.5 - 2 * 0.25 = -1.0; token 1: -0.5 - 0.25 = -0.75; prompt token 3 untouched
    np.testing.assert_allclose(np_of(s.process_logits(logits)), [[0.0, -0.75, -1.0, 0.0]])


def test_order_bias_then_repetition_then_presence():
    # token 0: (1.0 + 3.0) / 2 - 0.5 = 1.5   (repetition first would give 1.0 / 2 + 3.0 - 0.5 = 3.0)
    # token 1: (-1.0 + 0.5) * 2 = -1.0       (prompt only: no presence)
    s = Sampler(sp(logit_bias={0: 3.0, 1: 0.5}, repetition_penalty=2.0, presence_penalty=0.5), 3, [1])
    s.accept(mx.array([0]))
    np.testing.assert_allclose(np_of(s.process_logits(row(1.0, -1.0, 0.25))), [[1.5, -1.0, 0.25]])


def test_accept_makes_penalties_apply_to_later_steps():
    # greedy with frequency 0.15 on [1.0, 0.9, 0.8]:
    # [1,.9,.8]->0  [.85,.9,.8]->1  [.85,.75,.8]->0  [.7,.75,.8]->2  [.7,.75,.65]->1  [.7,.6,.65]->0  [.55,.6,.65]->2
    logits = row(1.0, 0.9, 0.8)
    s = Sampler(sp(temperature=0.0, frequency_penalty=0.15), vocab_size=3)
    out = []
    for _ in range(7):
        t = s.sample(logits)
        s.accept(t)
        out.append(t.item())
    assert out == [0, 1, 0, 2, 1, 0, 2]
    # without accept nothing changes
    s2 = Sampler(sp(temperature=0.0, frequency_penalty=0.15), vocab_size=3)
    assert [s2.sample(logits).item() for _ in range(3)] == [0, 0, 0]


def test_batch_of_two_with_different_histories_matches_single_rows():
    rng = np.random.default_rng(1)
    V = 16
    p = sp(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.2, top_k=8, top_p=0.9, temperature=0.8)
    prompts = [[0, 1, 2], [5, 5, 9]]
    outs = [[3, 3, 4], [7, 1, 7]]
    both = Sampler(p, V, prompts)
    singles = [Sampler(p, V, pr) for pr in prompts]
    for t0, t1 in zip(*outs):
        both.accept(mx.array([t0, t1]))
        singles[0].accept(mx.array([t0]))
        singles[1].accept(mx.array([t1]))
    logits = mx.array(rng.normal(size=(2, V)) * 2, dtype=mx.float32)
    pb = np_of(both.probs(logits))
    for b in range(2):
        np.testing.assert_allclose(pb[b], np_of(singles[b].probs(logits[b : b + 1]))[0], atol=1e-6)
        ref = ref_probs(np.array(logits[b]), p, prompts[b], outs[b])
        np.testing.assert_allclose(pb[b], ref, atol=1e-6)
    assert not np.allclose(pb[0], pb[1], atol=1e-3)


def test_shared_history_broadcasts_then_diverges():
    # one prompt, (1, V) state, used over B = 2 rows; accept (B, n) splits it into per-row counts
    s = Sampler(sp(frequency_penalty=1.0), vocab_size=4, prompt_token_ids=[0])
    z = mx.zeros((2, 4))
    np.testing.assert_allclose(np_of(s.process_logits(z)), np.zeros((2, 4)))
    s.accept(mx.array([[1, 1], [2, 3]]))
    np.testing.assert_allclose(np_of(s.process_logits(z)), [[0, -2, 0, 0], [0, 0, -1, -1]])
    with pytest.raises(ValueError):
        s.process_logits(mx.zeros((3, 4)))


# ---- temperature, greedy, filters ---------------------------------------------------------------


def test_temperature_scales_logits():
    logits = row(1.0, 2.0, 3.0, 0.5)
    for t in (0.5, 1.0, 2.0):
        got = np_of(Sampler(sp(temperature=t), 4).probs(logits))[0]
        np.testing.assert_allclose(got, ref_softmax(np.array([1.0, 2.0, 3.0, 0.5]) / t), atol=1e-6)


def test_greedy_is_argmax_lowest_id_on_ties_and_ignores_filters():
    logits = row(1.0, 3.0, 3.0, 2.0)
    s = Sampler(sp(temperature=0.0, top_k=1, top_p=0.1, min_p=0.5, seed=None), 4)
    assert [s.sample(logits).item() for _ in range(5)] == [1] * 5
    np.testing.assert_array_equal(np_of(s.probs(logits)), [[0, 1, 0, 0]])


@pytest.mark.parametrize(
    "kw, kept",
    [
        ({"top_k": 2}, {3, 2}),
        ({"top_p": 0.5}, {3}),  # p = .64 .24 .09 .03 (descending): .64 already >= .5
        ({"top_p": 0.7}, {3, 2}),
        ({"top_p": 0.9}, {3, 2, 1}),
        ({"min_p": 0.3}, {3, 2}),  # p / p_max = 1, .37, .14, .05
        ({"min_p": 0.1}, {3, 2, 1}),
        ({"top_k": 3, "top_p": 0.7, "min_p": 0.01}, {3, 2}),
        ({"top_k": 1, "top_p": 1.0}, {3}),
    ],
)
def test_filters_keep_exactly_the_expected_set(kw, kept):
    logits = np.array([0.0, 1.0, 2.0, 3.0])
    p = sp(**kw)
    got = np_of(Sampler(p, 4).probs(mx.array(logits[None], dtype=mx.float32)))[0]
    assert set(np.flatnonzero(got > 0).tolist()) == kept
    np.testing.assert_allclose(got, ref_probs(logits, p), atol=1e-6)
    assert abs(got.sum() - 1) < 1e-6


def test_top_p_is_computed_over_top_k_survivors():
    # logits [3, 2, 1, 0], top_k=2: renormalised p = .731, .269; top_p=.72 keeps only token 0.
    # Over the full distribution (.64, .24, ...) top_p=.72 would keep two.
    p = sp(top_k=2, top_p=0.72)
    got = np_of(Sampler(p, 4).probs(row(3.0, 2.0, 1.0, 0.0)))[0]
    np.testing.assert_array_equal(got, [1, 0, 0, 0])


def test_ties_at_the_boundary_are_all_kept():
    # thresholds, as HF top-k: with top_k=2 both tokens tied at 2.0 stay
    got = np_of(Sampler(sp(top_k=2), 4).probs(row(3.0, 2.0, 2.0, 1.0)))[0]
    assert set(np.flatnonzero(got > 0).tolist()) == {0, 1, 2}


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"top_k": 50},
        {"top_p": 0.8},
        {"min_p": 0.05},
        {"top_k": 100, "top_p": 0.9, "min_p": 0.02, "temperature": 0.7},
        {"top_k": 20, "min_p": 0.1, "temperature": 1.5},
        {
            "top_p": 0.95,
            "temperature": 0.3,
            "repetition_penalty": 1.2,
            "presence_penalty": 0.3,
            "frequency_penalty": 0.1,
        },
    ],
)
def test_probs_match_numpy_reference(kw, seed):
    V = 1000
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=V) * 3
    prompt = rng.integers(0, V, 30).tolist()
    output = rng.integers(0, V, 10).tolist()
    p = sp(**kw)
    s = Sampler(p, V, prompt)
    for t in output:
        s.accept(mx.array([t]))
    got = np_of(s.probs(mx.array(logits[None], dtype=mx.float32)))[0]
    ref = ref_probs(logits, p, prompt, output)
    # float32 floor: 6.4 units (tests/support/tolerance.py) on an AMD EPYC; x5 headroom
    assert_f32_close(got, ref, 32, "probs vs float64")
    assert np.array_equal(got > 0, ref > 0)


def test_logprobs_are_log_softmax_before_temperature():
    p = sp(temperature=0.5, logit_bias={1: 1.0}, top_k=1)
    got = np_of(Sampler(p, 3).logprobs(row(1.0, 0.0, -1.0)))[0]
    x = np.array([1.0, 1.0, -1.0])
    np.testing.assert_allclose(got, x - np.log(np.exp(x).sum()), atol=1e-6)


def test_filters_trace_under_compile():
    # mx.compile fails on host syncs (.item(), numpy conversion): the per-step path has none
    V = 64
    p = sp(top_k=10, top_p=0.9, min_p=0.05, temperature=0.7, repetition_penalty=1.1, frequency_penalty=0.2)
    s = Sampler(p, V, [1, 2, 3])
    s.accept(mx.array([4]))
    logits = mx.array(np.random.default_rng(0).normal(size=(2, V)), dtype=mx.float32)
    compiled = mx.compile(lambda x: (s.probs(x), s.logprobs(x)))
    for a, b in zip(compiled(logits), (s.probs(logits), s.logprobs(logits))):
        np.testing.assert_allclose(np_of(a), np_of(b), atol=1e-6)


# ---- randomness ---------------------------------------------------------------------------------


def _generate(p: SamplingParams, logits: mx.array, n: int = 20) -> list[int]:
    s = Sampler(p, logits.shape[-1])
    out = []
    for _ in range(n):
        t = s.sample(logits)
        s.accept(t)
        out.append(t.item())
    return out


def test_same_seed_same_sequence_independent_of_global_state():
    logits = mx.array(np.random.default_rng(0).normal(size=(1, 50)), dtype=mx.float32)
    p = sp(seed=1234, temperature=1.0, top_p=0.95, frequency_penalty=0.1)
    mx.random.seed(1)
    a = _generate(p, logits)
    mx.random.seed(2)
    _ = mx.random.uniform(shape=(10,))
    # interleave another request between the steps of this one
    s, other = Sampler(p, 50), Sampler(sp(seed=99), 50)
    b = []
    for _ in range(20):
        other.sample(logits)
        t = s.sample(logits)
        s.accept(t)
        b.append(t.item())
    assert a == b
    assert len(set(a)) > 3
    assert _generate(sp(seed=1235, temperature=1.0, top_p=0.95, frequency_penalty=0.1), logits) != a
    assert _generate(sp(seed=None), logits) != _generate(sp(seed=None), logits)


def _chi2(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    n = counts.sum()
    m = probs > 0
    assert counts[~m].sum() == 0, "drew a filtered-out token"
    e = n * probs[m]
    return float(((counts[m] - e) ** 2 / e).sum()), int(m.sum() - 1)


CHI2_999 = {3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}  # 99.9% quantiles


def test_draws_match_probs_in_one_batched_call():
    logits = row(0.0, 0.5, 1.0, 1.5, 2.0, -1.0, 3.0, -3.0)
    p = sp(seed=7, temperature=0.9, top_p=0.97, min_p=0.02)
    s = Sampler(p, 8)
    n = 40_000
    toks = np.array(s.sample(mx.broadcast_to(logits, (n, 8))))
    probs = np_of(s.probs(logits))[0]
    stat, df = _chi2(np.bincount(toks, minlength=8), probs)
    assert stat < CHI2_999[df], (stat, df)


def test_draws_match_probs_across_steps():
    # the per-step key split gives independent draws
    logits = row(0.2, 1.0, -0.5, 0.7)
    s = Sampler(sp(seed=3, temperature=1.0), 4)
    toks = mx.stack([s.sample(logits)[0] for _ in range(3000)])
    stat, df = _chi2(np.bincount(np.array(toks), minlength=4), np_of(s.probs(logits))[0])
    assert stat < CHI2_999[df], (stat, df)


# ---- parity with mlx-lm's samplers --------------------------------------------------------------
# Same semantics at temperature 1 on tie-free logits. Where they differ:
#  - mlx-lm's make_sampler applies top_p / min_p / top_k to the untempered logprobs and divides by
#    the temperature only inside the draw; we (HF, vLLM) apply temperature first, then filter.
#  - mlx-lm's chain order is top_p, min_p, top_k with top_p over the full distribution; ours is top_k
#    then top_p renormalised over the survivors (HF).
#  - mlx-lm's apply_top_k keeps exactly k by position (ties broken arbitrarily); we keep ties.
#  - mlx-lm's penalties look at the last `context_size` (20) tokens of prompt + output for all three;
#    ours: repetition over the whole prompt + output, presence / frequency over the output only
#    (OpenAI semantics).


def _lm_probs(masked_logprobs: mx.array) -> np.ndarray:
    return np_of(mx.softmax(masked_logprobs, axis=-1))


@pytest.mark.parametrize("seed", range(3))
def test_filters_match_mlx_lm(seed):
    V = 2000
    logits = mx.array(np.random.default_rng(seed).normal(size=(1, V)) * 3, dtype=mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    for kw, theirs in [
        ({"top_p": 0.9}, lm.apply_top_p(logprobs, 0.9)),
        ({"top_p": 0.3}, lm.apply_top_p(logprobs, 0.3)),
        ({"min_p": 0.05}, lm.apply_min_p(logprobs, 0.05)),
        ({"top_k": 40}, lm.apply_top_k(logprobs, 40)),
    ]:
        ours = np_of(Sampler(sp(**kw), V).probs(logits))
        np.testing.assert_allclose(ours, _lm_probs(theirs), atol=1e-6, err_msg=str(kw))


def test_penalties_and_bias_match_mlx_lm_processors():
    V = 50
    rng = np.random.default_rng(0)
    logits = mx.array(rng.normal(size=(1, V)) * 2, dtype=mx.float32)
    prompt = rng.integers(0, V, 12).tolist()
    output = rng.integers(0, V, 8).tolist()

    def ours(p: SamplingParams, with_prompt: bool) -> np.ndarray:
        s = Sampler(p, V, prompt if with_prompt else None)
        for t in output:
            s.accept(mx.array([t]))
        return np_of(s.process_logits(logits))

    def theirs(proc, tokens) -> np.ndarray:
        return np_of(proc(mx.array(tokens), mx.array(logits)))

    # repetition: same over prompt + output when mlx-lm's window covers it all
    np.testing.assert_allclose(
        ours(sp(repetition_penalty=1.3), True),
        theirs(lm.make_repetition_penalty(1.3, context_size=1000), prompt + output),
        atol=1e-6,
    )
    # presence / frequency: same when mlx-lm is given only the output tokens
    np.testing.assert_allclose(
        ours(sp(presence_penalty=0.7), True),
        theirs(lm.make_presence_penalty(0.7, context_size=1000), output),
        atol=1e-6,
    )
    np.testing.assert_allclose(
        ours(sp(frequency_penalty=0.3), True),
        theirs(lm.make_frequency_penalty(0.3, context_size=1000), output),
        atol=1e-6,
    )
    # all together, in mlx-lm's chain order (bias, repetition, presence, frequency) == ours
    bias = {3: 2.0, 7: -5.0}
    procs = lm.make_logits_processors(
        logit_bias=bias, repetition_penalty=1.3, repetition_context_size=1000,
        presence_penalty=0.7, presence_context_size=1000, frequency_penalty=0.3, frequency_context_size=1000,
    )  # fmt: skip
    x = mx.array(logits)
    for proc in procs:
        x = proc(mx.array(output), x)
    # mlx-lm's processors see one token list; give ours the output only so repetition sees the same set
    got = ours(sp(logit_bias=bias, repetition_penalty=1.3, presence_penalty=0.7, frequency_penalty=0.3), False)
    np.testing.assert_allclose(got, np_of(x), atol=1e-6)


def test_temperature_then_filter_differs_from_mlx_lm_on_purpose():
    # p(T=1) = .64 .24 .09 .03 ; at T=0.5 p = .87 .12 ...: top_p=.8 keeps 2 tokens in mlx-lm (filters
    # the untempered distribution) and 1 in ours (HF: filters the tempered one).
    logits = row(3.0, 2.0, 1.0, 0.0)
    ours = np_of(Sampler(sp(temperature=0.5, top_p=0.8), 4).probs(logits))[0]
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    theirs = _lm_probs(lm.apply_top_p(lp, 0.8) / 0.5)[0]
    assert (ours > 0).sum() == 1 and (theirs > 0).sum() == 2
    assert math.isclose(ours[0], 1.0)
