"""The "auto" policy and a request's speculation state: which proposer drafts each step and how many tokens,
from the cost curve, the running acceptance and a loss budget."""

from __future__ import annotations

from dataclasses import dataclass, field

from mlx_engine.speculative.accept import expected_tokens, tested_tokens
from mlx_engine.speculative.cost import AUTO_MARGIN, CostCurve
from mlx_engine.speculative.proposers import Proposer

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
# weight of each timed proposal in a draft model's running cost per drafted token ("auto", `SpecState.settle`)
DRAFT_COST_EMA = 0.3
# "auto": a draft model's acceptance before any is measured where prompt lookup also has a candidate
# (`SpecState.prior_of`)
COPY_CONTEXT_PRIOR = 1.0


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


@dataclass(eq=False)
class SpecState:
    """A request's speculation: its proposer(s), adaptive k and counts."""

    mode: str  # the requested mode: "draft", "prompt-lookup", "self" or "auto"
    proposer: Proposer  # the one that drafts this step (the last one that did)
    k_max: int
    k: int = 0
    prior: float = AUTO_PRIOR_ACCEPTANCE  # where `priors` is not given: every proposer's prior acceptance
    # "auto" with a draft model loaded: prompt lookup and the draft model, each with its own estimate. Each step
    # drafts with the one that has a candidate and the best predicted speedup: a quote is copied for free and the
    # rest drafted by the model (with the model alone an edit read 1.84x on the torch CPU backend, against 2.46x
    # for prompt lookup alone). `priors`: one per proposer.
    proposers: list[Proposer] = field(default_factory=list)
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

    def _index(self, proposer: Proposer) -> int:
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
        if recurs and not p.copies and any(self.proposers[j].copies for j, ctx in self.recent if ctx):
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
            if known is not None and not p.worth_trying(known):
                continue
            candidates.append(i)
        self.recurs = any(self.proposers[i].copies for i in candidates)
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
        spent = self.proposer.last_spent
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
            p.prefill(prompt)

    def rollback(self, num_tokens: int) -> None:
        for p in self.proposers:
            p.rollback(num_tokens)

    def close(self) -> None:
        for p in self.proposers:
            p.close()
