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

"auto" (`SpecState.auto_k`) verifies only where the backend's cost curve and the running acceptance predict a
gain; with a draft model loaded it drafts each step by prompt lookup or by the model, whichever is predicted to
gain more (a quote is copied for free, the rest drafted by the model).
"""

from __future__ import annotations

import json
import math
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
import numpy as np

from mlx_engine.api import MAX_DRAFT_TOKENS

MAX_NGRAM = 3
AUTO_MARGIN = 0.1  # "auto" speculates only where it predicts at least this gain over plain decoding
AUTO_PRIOR_ACCEPTANCE = 0.7  # per-token acceptance assumed before any is measured
PRIOR_WEIGHT = 4.0  # drafted tokens the prior counts as
VERIFY_DECAY = 0.8  # weight of earlier verifications in "auto"'s acceptance estimate, per verification
# ... and per plain step "auto" takes while its proposer has a candidate (prompt lookup: the last tokens
# recur; a draft model: always) but the estimate says a verification would not pay: old rejections fade, so a
# quote that starts after a few misses is tried again (edit at temperature 0.7 stopped verifying after its first
# rejections)
IDLE_DECAY = 0.85
# "auto" risks at most this much predicted time on verifications that could fail, in plain decode steps T(1):
# a fixed allowance, plus a share of the tokens the reply has so far, plus what its verifications have saved.
# Each verification is sized so that even a rejection of its first draft (one token for the whole forward)
# stays within that. So a reply whose drafts keep failing costs at most ~AUTO_LOSS_SHARE over plain decoding,
# whatever the estimate says (on MLX's CPU backend one edit at temperature 0.7 probed its way to a predicted
# 0.96x, measured 0.93x; a simulated reply whose drafts all fail lost 10-12% without the budget).
AUTO_LOSS_ALLOWANCE = 0.5
AUTO_LOSS_SHARE = 0.02
# a draft model's catch-up of at most this many tokens goes into the forward that gives its first draft: after a
# fully accepted proposal it had not fed its last draft, so two forwards of one row became one of two
CATCH_UP_IN_ONE = 4
# weight of each timed proposal in a draft model's running cost per drafted token ("auto", `SpecState.settle`)
DRAFT_COST_EMA = 0.3
# "auto": a draft model's acceptance before any is measured where prompt lookup also has a candidate
# (`SpecState.prior_of`)
COPY_CONTEXT_PRIOR = 1.0


# --- acceptance -------------------------------------------------------------------------------------


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


# --- proposers ----------------------------------------------------------------------------------------


@dataclass
class DraftInput:
    tokens: list[int]  # prompt + generated; the last one is not yet in the target's cache
    k: int
    sampler: Any  # the request's Sampler
    target_layers: Callable[[int, int], list[Any]]  # the target cache over positions [a, b), allocated
    # a request with a response format: drafts so far -> (1, V) bool, what its grammar allows next
    allowed_after: Callable[[list[int]], mx.array] | None = None


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


class PromptLookup:
    name = "prompt-lookup"
    draft_cost = 0.0  # of a target forward, per drafted token
    # "auto" verifies prompt-lookup drafts only while the text's last AUTO_MIN_NGRAM tokens recur (a quote,
    # an edit, repeated code): a lone recurring token or pair predicts little, and in open chat the
    # failed probes cost more than they win
    AUTO_MIN_NGRAM = 3

    def worth_trying(self, known: list[int]) -> bool:
        return suffix_recurs(known, self.AUTO_MIN_NGRAM)

    def propose(self, inp: DraftInput) -> tuple[list[int] | mx.array, mx.array | None]:
        return prompt_lookup(inp.tokens, inp.k), None  # q: a point mass

    def rollback(self, num_tokens: int) -> None:
        pass

    def close(self) -> None:
        pass


def _draw(sampler: Any, q: mx.array) -> mx.array:
    """(1, V) proposal -> (1,) token drawn from it with the request's key (argmax when greedy)."""
    if sampler.greedy:
        return mx.argmax(q, axis=-1).astype(mx.int32)
    return mx.random.categorical(mx.log(q), axis=-1, key=sampler.next_key()).astype(mx.int32)


class DraftModel:
    """A separate small model with the target's vocabulary; its KV (mlx-lm buffers, one set per sequence)
    holds `tokens`, kept a prefix of the sequence's accepted tokens."""

    name = "draft"
    # where the text recurs, guess its drafts from prompt lookup's copy (`propose`). Not under "auto": it drafts by
    # the model where the text recurs only once copies failed there, and its guesses (the same copies) failed too,
    # each a forward over rows thrown away. On the torch CPU backend over six replies a row, guessing took the
    # named draft from 1.82x to 2.43x (edit) and from 1.71x to 1.86x (code) at temperature 0, and "auto" from
    # 2.38x to 2.27x and from 1.61x to 1.50x.
    guesses = True

    def __init__(self, runner: Any, draft_cost: float = 0.0):
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
            self.layers = r._fresh_contiguous()
        for start in range(0, len(ids), r.prefill_chunk_size):
            r.forward(mx.array([ids[start:start + r.prefill_chunk_size]], dtype=mx.int32), self.layers)
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
        rows = r.all_logits(ids, self.layers)[tail - 1:] if guess else r.last_logits(ids, self.layers)
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
            logits = r.last_logits(x.reshape(1, 1), self.layers)
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


class SelfDraft:
    """The target's first `num_layers` layers + final norm + head. It reads the target's own cache of those
    layers and writes its drafted positions there; the verify forward rewrites them."""

    name = "self"

    def __init__(self, runner: Any, num_layers: int, draft_cost: float = 0.0):
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

    def rollback(self, num_tokens: int) -> None:
        pass

    def close(self) -> None:
        pass


# --- the cost of a wider forward, and when speculation pays ------------------------------------------


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


@dataclass
class CostCurve:
    """T(w) / T(1) of a target forward over w new tokens (w = k + 1), measured at some widths."""

    ratios: dict[int, float]
    t1_s: float = 0.0
    draft_costs: dict[str, float] = field(default_factory=dict)  # proposer -> T_draft(1) / T(1)

    def cost(self, width: int) -> float:
        """T(width)/T(1), interpolated between measured widths, past the widest along the last slope. Not forced
        to grow with the width: on the torch CPU backend a forward over 4 rows is cheaper than over 2 or 3 (one
        thread's float32 matmul, SmolLM2's projections: 49, 57 and 44 ms at 2, 3 and 4 rows, the best of 5), so
        a dip in the curve is a width worth drafting to, not noise to smooth over."""
        ws = sorted(self.ratios)
        if width in self.ratios:
            return self.ratios[width]
        lo = max((w for w in ws if w < width), default=ws[0])
        hi = min((w for w in ws if w > width), default=None)
        if hi is None:  # extrapolate with the last slope
            a, b = ws[-2], ws[-1]
            return self.ratios[b] + (self.ratios[b] - self.ratios[a]) / (b - a) * (width - b)
        f = (width - lo) / (hi - lo)
        return self.ratios[lo] + f * (self.ratios[hi] - self.ratios[lo])

    def best_k(self, alpha: float, k_max: int, draft_cost: float = 0.0, margin: float = AUTO_MARGIN,
               max_loss: float = math.inf) -> int:
        """The k with the best predicted speedup E[tokens] / cost, or 0 when none beats plain by `margin`. Only k
        whose worst case (its first draft rejected: one token for the whole verification) loses at most
        `max_loss` plain steps count."""
        return self.best(alpha, k_max, draft_cost, margin, max_loss)[0]

    def best(self, alpha: float, k_max: int, draft_cost: float = 0.0, margin: float = AUTO_MARGIN,
             max_loss: float = math.inf) -> tuple[int, float]:
        """`best_k` and its predicted speedup (1.0 with k = 0)."""
        best, best_gain = 0, 1.0 + margin
        for k in range(1, k_max + 1):
            cost = self.cost(k + 1) + k * draft_cost
            gain = expected_tokens(alpha, k) / cost
            if gain > best_gain and cost - 1.0 <= max_loss:
                best, best_gain = k, gain
        return best, (best_gain if best else 1.0)


def probe_allowance(curve: CostCurve, prior: float, k_max: int, draft_cost: float) -> float:
    """"auto"'s fixed loss allowance for a proposer: AUTO_LOSS_ALLOWANCE, or where that is larger the worst case
    of the cheapest verification predicted to pay at the prior acceptance. Prompt lookup drafts for free, so its
    worst case is the wider forward alone. A draft model's rejected drafts cost their own forwards too: on the
    torch CPU backend (an int8 draft at 0.3 T(1), a verification of 4 at 1.36 T(1)) a verification of 3 drafts
    risks 1.26 T(1), which the fixed allowance would never admit. The cheapest, not the best: at a prior of 0.94
    the best is 7 drafts, whose worst case (4.9 T(1) with the draft at 0.47) cost one 48-token chat reply 12%
    when its first drafts failed; 3 drafts risk 1.8. Once verifications pass, what they save funds wider ones.
    Either way a reply whose drafts keep failing loses at most the allowance plus AUTO_LOSS_SHARE of its
    tokens."""
    if draft_cost <= 0:
        return AUTO_LOSS_ALLOWANCE
    worst = [cost - 1.0 for k in range(1, k_max + 1)
             if expected_tokens(prior, k) / (cost := curve.cost(k + 1) + k * draft_cost) > 1.0 + AUTO_MARGIN]
    return max(AUTO_LOSS_ALLOWANCE, min(worst, default=0.0))


def time_forward(runner: Any, width: int, context: int = 32, repeats: int = 2, first_layers: int | None = None,
                 logits_at: str = "all") -> float:
    """Seconds of one forward over `width` tokens after `context` cached ones (min over repeats), through
    fresh contiguous buffers. `first_layers`: only that many layers + head (the self draft). A runner that
    replays its steps as CUDA graphs times them there (`TorchRunner.time_graph_forward`): the contiguous
    buffers' eager forward is not what its decode or verification costs."""
    from mlx_lm.models.cache import trim_prompt_cache

    if first_layers is None and getattr(runner, "graphs", None) is not None:
        return runner.time_graph_forward(width, context, repeats)

    layers = runner._fresh_contiguous()
    runner.forward(mx.array([[(7 * i) % 97 + 3 for i in range(context)]], dtype=mx.int32), layers)
    mx.eval([c.state for c in layers])
    x = mx.array([[(5 * i) % 89 + 4 for i in range(width)]], dtype=mx.int32)
    best = float("inf")
    for _ in range(repeats + 1):  # the first is a warm-up
        t = time.perf_counter()
        if first_layers is not None:
            out = runner.draft_logits(x, layers[:first_layers], first_layers)
            mx.eval(out)
            for c in layers[:first_layers]:
                c.trim(width)
        else:
            out = runner.all_logits(x, layers) if logits_at == "all" else runner.last_logits(x, layers)
            mx.eval(out)
            trim_prompt_cache(layers, width)
        best = min(best, time.perf_counter() - t)
    return best


def measure_cost_curve(runner: Any, widths: tuple[int, ...] = (2, 3, 4, 5, 9), repeats: int = 2) -> CostCurve:
    """The verify cost curve on this backend: T(w)/T(1), T(1) a plain decode step (logits of one position).
    Stops early once even perfect drafts could not pay (a compute-bound backend: ~4 s on a 2-core CPU). Width 4
    is measured: on the torch CPU backend a forward over 4 rows costs less than over 3 (1.36 against 1.95 T(1)),
    and interpolated between 3 and 5 it read 1.77, so "auto" priced its verifications of 3 drafts too high."""
    t1 = time_forward(runner, 1, repeats=repeats, logits_at="last")
    curve = CostCurve({1: 1.0}, t1)
    for w in widths:
        curve.ratios[w] = time_forward(runner, w, repeats=repeats) / t1
        if curve.best_k(1.0, MAX_DRAFT_TOKENS) == 0:  # extrapolating the measured slope
            break
    return curve


COST_CURVE_FILE = "cost_curves.json"
COST_CURVE_FORMAT = 2  # 2: width 4 measured too (a curve kept before is measured again)


def cache_dir() -> Path:
    """Where measurements are kept between runs: `ROOFLINE_CACHE_DIR`, else platformdirs' user cache dir."""
    if path := os.environ.get("ROOFLINE_CACHE_DIR"):
        return Path(path).expanduser()
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("roofline", appauthor=False))


def cost_curve_key(runner: Any) -> str | None:
    """What a measured curve holds for: the weights (and activation dtype), the backend and device (and on
    MLX's CPU backend whether float32 host weights are resident), the machine and the MLX version. None: the runner
    has no fingerprint, so nothing is kept."""
    fingerprint = getattr(runner, "fingerprint", None)
    if not fingerprint:
        return None
    info = runner.info
    path = "-fp32-host-weights" if getattr(runner, "_host_bytes", 0) else ""  # models.layers: another cost curve
    path += "-cuda-graphs" if getattr(runner, "graphs", None) is not None else ""  # graphed steps: another one
    return "|".join([fingerprint.hex(), f"{info.backend}-{info.device}{path}",
                     f"{platform.system()}-{platform.machine()}", f"mlx-{mx.__version__}"])


def load_cost_curve(key: str) -> CostCurve | None:
    """The curve measured before for `key`, or None (none kept, or the file is unreadable or malformed)."""
    try:
        raw = json.loads((cache_dir() / COST_CURVE_FILE).read_text())
        entry = raw["curves"][key] if raw.get("format") == COST_CURVE_FORMAT else None
        if entry is None:
            return None
        ratios = {int(w): float(r) for w, r in entry["ratios"].items()}
        t1_s = float(entry["t1_s"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if ratios.get(1) != 1.0 or len(ratios) < 2 or not all(math.isfinite(r) and r > 0 for r in ratios.values()):
        return None
    return CostCurve(ratios, t1_s)


def save_cost_curve(key: str, curve: CostCurve) -> None:
    """Keeps `curve` for `key` beside the others (an unreadable file is replaced); never raises."""
    path = cache_dir() / COST_CURVE_FILE
    try:
        raw = json.loads(path.read_text())
        curves = raw["curves"] if raw.get("format") == COST_CURVE_FORMAT and isinstance(raw["curves"], dict) else {}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        curves = {}
    curves[key] = {"ratios": {str(w): r for w, r in sorted(curve.ratios.items())}, "t1_s": curve.t1_s}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"format": COST_CURVE_FORMAT, "curves": curves}, indent=1))
        os.replace(tmp, path)  # atomic: a concurrent reader sees the old file or the new one
    except OSError:
        pass


def cached_cost_curve(runner: Any) -> CostCurve:
    """The verify cost curve, measured once per model, backend and machine (~4 s) and kept in `cache_dir()`."""
    key = cost_curve_key(runner)
    curve = load_cost_curve(key) if key is not None else None
    if curve is None:
        curve = measure_cost_curve(runner)
        if key is not None:
            save_cost_curve(key, curve)
    return curve


# --- per request --------------------------------------------------------------------------------------


@dataclass(eq=False)
class SpecState:
    """A request's speculation: its proposer(s), adaptive k and counts."""

    mode: str  # the requested mode: "draft", "prompt-lookup", "self" or "auto"
    proposer: Any  # the one that drafts this step (the last one that did)
    k_max: int
    k: int = 0
    prior: float = AUTO_PRIOR_ACCEPTANCE  # where `priors` is not given: every proposer's prior acceptance
    # "auto" with a draft model loaded: prompt lookup and the draft model, each with its own estimate. Each step
    # drafts with the one that has a candidate and the best predicted speedup: a quote is copied for free and the
    # rest drafted by the model (with the model alone an edit read 1.84x on the torch CPU backend, against 2.46x
    # for prompt lookup alone). `priors`: one per proposer.
    proposers: list[Any] = field(default_factory=list)
    priors: list[float] = field(default_factory=list)
    num_verifies: int = 0  # verifications with at least one drafted token
    num_forwards: int = 0  # target forwards that sampled tokens
    history: list[tuple[int, int]] = field(default_factory=list)  # (drafted, accepted) per verification
    # per proposer in this request: [accepted, drafted, tested] (`num_accepted`, `num_drafted`: all of them;
    # `tested`: `tested_tokens`)
    tallies: list[list[int]] = field(default_factory=list)
    # "auto"'s acceptance estimate weighs recent verifications more: text moves between quoted and new
    # spans. It drifts back to the prior only over plain steps where the proposer has a candidate
    # (`age`): drifting on every plain step was tried, and on chat, where prompt lookup never matches,
    # the probes cost 8-11% against plain decoding on the torch CPU backend. [tested, accepted] per proposer
    # and context: whether the text recurs (prompt lookup has a candidate), where a draft model drafts another
    # text than elsewhere (`prior_of`)
    recent: dict[tuple[int, bool], list[float]] = field(default_factory=dict)
    recurs: bool = False  # this step's context
    # "auto": plain decode steps its verifications saved so far (negative: lost): their forwards through the cost
    # curve, a draft model's proposals as timed
    balance: float = 0.0
    # "auto": the fixed part of its loss budget, in T(1) (`probe_allowance`)
    allowance: float = field(default_factory=lambda: AUTO_LOSS_ALLOWANCE)

    def __post_init__(self) -> None:
        self.k = self.k or self.k_max
        self.proposers = self.proposers or [self.proposer]
        self.priors = self.priors or [self.prior] * len(self.proposers)
        self.tallies = [[0, 0, 0] for _ in self.proposers]

    @property
    def num_drafted(self) -> int:
        return sum(drafted for _, drafted, _ in self.tallies)

    @property
    def num_accepted(self) -> int:
        return sum(accepted for accepted, _, _ in self.tallies)

    def _index(self, proposer: Any) -> int:
        return next(i for i, p in enumerate(self.proposers) if p is proposer)

    def prior_of(self, i: int, recurs: bool) -> float:
        """Proposer i's acceptance before any is measured in this request and context. Where the text recurs, a
        draft model beside prompt lookup is compared with free copies, so at its usual prior it would never be
        tried there. Once prompt lookup has been tried, the model starts optimistic (COPY_CONTEXT_PRIOR): it
        copies a quote as well as prompt lookup does, and follows where the copy goes wrong. Code at temperature
        0 on the torch CPU backend: prompt lookup's drafts passed at about 0.5 and the int8 draft's at 0.95; with
        the usual prior "auto" read 1.29x, against 1.71x with the draft model alone. Edits keep prompt lookup:
        its drafts pass at 0.9 and cost nothing."""
        p = self.proposers[i]
        if recurs and not hasattr(p, "worth_trying") and any(
                hasattr(self.proposers[j], "worth_trying") for j, ctx in self.recent if ctx):
            return COPY_CONTEXT_PRIOR
        return self.priors[i]

    def alpha_of(self, i: int, recurs: bool | None = None) -> float:
        """Proposer i's per-token acceptance in a context (default: this step's), recency-weighted, starting from
        its prior: accepted over tested tokens (`tested_tokens`)."""
        recurs = self.recurs if recurs is None else recurs
        tested, accepted = self.recent.get((i, recurs), (0.0, 0.0))
        return (accepted + PRIOR_WEIGHT * self.prior_of(i, recurs)) / (tested + PRIOR_WEIGHT)

    @property
    def alpha(self) -> float:
        """The current proposer's per-token acceptance estimate."""
        return self.alpha_of(self._index(self.proposer))

    def auto_k(self, curve: CostCurve, k_max: int, tokens: int, known: list[int] | None = None) -> int:
        """"auto"'s draft tokens this step, for a reply of `tokens` tokens so far: the k with the best predicted
        speedup among those whose worst case fits the loss budget (AUTO_LOSS_*), over the proposers with a
        candidate for the text `known` (prompt lookup: its last tokens recur; a draft model always has one), which
        becomes `proposer`. 0: a plain step; where that was taken although a proposer had a candidate, old
        rejections fade."""
        budget = self.balance + self.allowance + AUTO_LOSS_SHARE * tokens
        best, best_gain, candidates = 0, 0.0, []
        for i, p in enumerate(self.proposers):
            worth_trying = getattr(p, "worth_trying", None)
            if known is not None and worth_trying is not None and not worth_trying(known):
                continue
            candidates.append(i)
        self.recurs = any(hasattr(self.proposers[i], "worth_trying") for i in candidates)
        for i in candidates:
            p = self.proposers[i]
            k, gain = curve.best(self.alpha_of(i), k_max, p.draft_cost, max_loss=budget)
            if k and gain > best_gain:
                best, best_gain, self.proposer = k, gain, p
        if not best:
            self.age(candidates)
        return best

    def settle(self, curve: CostCurve, drafted: int, tokens: int) -> None:
        """After an "auto" verification of `drafted` drafts that gave `tokens` tokens: what it saved or lost.
        A proposer that timed its proposal (a draft model) is charged what it took. Its cost per drafted token
        follows the proposals that caught up as usual (DRAFT_COST_EMA): `time_forward`'s one forward leaves out
        the catch-up of its last draft after a full acceptance and the sampling of each draft. A long catch-up
        (the tokens of plain steps taken since, or copied by prompt lookup) is charged but kept out of that cost:
        counted in, one such proposal on the torch CPU backend raised it from 0.35 to 0.55 T(1), after which
        "auto" stopped drafting, so its catch-ups grew longer still."""
        spent = getattr(self.proposer, "last_spent", None)
        drafting = drafted * self.proposer.draft_cost
        if spent is not None and spent[1] == drafted and curve.t1_s > 0:
            drafting = spent[0] / curve.t1_s
            if spent[2]:
                c = self.proposer.draft_cost
                self.proposer.draft_cost = c + DRAFT_COST_EMA * (drafting / drafted - c)
                curve.draft_costs[self.proposer.name] = self.proposer.draft_cost  # for the next requests too
            self.proposer.last_spent = None
        self.balance += tokens - (curve.cost(drafted + 1) + drafting)

    def age(self, which: list[int] | None = None) -> None:
        """A plain step taken although these proposers (default: all) had a candidate: old evidence fades
        (IDLE_DECAY)."""
        for i in range(len(self.proposers)) if which is None else which:
            if recent := self.recent.get((i, self.recurs)):
                recent[0] *= IDLE_DECAY
                recent[1] *= IDLE_DECAY

    def record(self, drafted: int, accepted: int) -> None:
        self.num_forwards += 1
        if not drafted:
            return
        i, tested = self._index(self.proposer), tested_tokens(drafted, accepted)
        self.tallies[i][0] += accepted
        self.tallies[i][1] += drafted
        self.tallies[i][2] += tested
        recent = self.recent.setdefault((i, self.recurs), [0.0, 0.0])
        recent[0] = recent[0] * VERIFY_DECAY + tested
        recent[1] = recent[1] * VERIFY_DECAY + accepted
        self.num_verifies += 1
        self.history.append((drafted, accepted))
        # adaptive k: one more after a fully accepted draft of the current length; after a rejection, one
        # more than were accepted (a draft that fails early stops costing wide verifications at once)
        if accepted == drafted and drafted >= self.k:
            self.k = min(self.k + 1, self.k_max)
        elif accepted < drafted:
            self.k = max(1, min(self.k, accepted + 1))

    def prefill(self, prompt: list[int]) -> None:
        """Proposers with KV of their own (a draft model) prefill beside the target."""
        for p in self.proposers:
            if hasattr(p, "prefill"):
                p.prefill(prompt)

    def rollback(self, num_tokens: int) -> None:
        for p in self.proposers:
            p.rollback(num_tokens)

    def close(self) -> None:
        for p in self.proposers:
            p.close()


def speculative_step(runner: Any, seq: Any, k: int) -> tuple[list[int], int, mx.array | None]:
    """One proposal and verification for `seq` (a scheduler Sequence whose newest token, generated[-1],
    is known and not yet in the cache). Returns the new tokens (the accepted drafts, then one sampled
    token), how many of them are drafts, and their log-probability rows (n + 1, V) when asked for.
    Afterwards the cache (and the draft's) holds every token but the last new one."""
    cache, sampler, state = runner.cache, seq.sampler, seq.spec
    tokens = seq.prompt + seq.generated
    n0, req = len(tokens) - 1, seq.req_id  # n0: tokens in the cache
    cache.allocate(req, tokens, k + 1)  # slots for [last, x_1..x_k], with the known tokens: no draft gets hashed

    draft: list[int] | mx.array = []
    q = None
    constraint = getattr(seq, "constraint", None)  # a response format: drafts and rows held to its grammar
    allowed_after = None if constraint is None else (lambda ds: mx.array(constraint.allowed_along(ds)[-1:]))
    if k:
        draft, q = state.proposer.propose(DraftInput(tokens, k, sampler, lambda a, b: cache.prefill_layers(req, a, b),
                                                     allowed_after))
    sampler.allowed = None
    if constraint is not None and q is None:  # a copied draft (point mass): cut where the grammar refuses it
        draft = list(draft)[:constraint.consumable(list(draft))]
    m = len(draft)
    if m < k:
        cache.trim(req, n0 + m + 1)
    d = mx.array(draft, dtype=mx.int32) if not isinstance(draft, mx.array) else draft  # (m,)
    layers = cache.prefill_layers(req, n0, n0 + m + 1)
    inputs = mx.concatenate([mx.array([tokens[-1]], dtype=mx.int32), d])[None]  # (1, m+1)
    logits = runner.all_logits(inputs, layers)  # (m+1, V)
    if constraint is not None:  # row i: what the grammar allows after the drafts before it
        sampler.allowed = mx.array(constraint.allowed_along(d.tolist()))
    p = sampler.probs_along(logits, d)  # (m+1, V)
    if q is None:
        q = point_mass(d, p.shape[-1])
    num, nxt = rejection_sample(p[None], q[None], d[None], sampler.next_key())
    lps = sampler.logprobs_along(logits, d) if seq.params.logprobs is not None else None
    mx.eval(num, nxt, d)
    n = int(num.item())
    new = d.tolist()[:n] + [int(nxt.item())]

    keep = n0 + 1 + n  # the cache keeps last and the accepted drafts
    cache.trim(req, keep)
    if m:
        state.rollback(keep)
    sampler.accept(mx.array([new], dtype=mx.int32))
    state.record(m, n)
    return new, n, (lps[: n + 1] if lps is not None else None)
