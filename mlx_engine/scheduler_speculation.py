"""The scheduler's speculation policy: which proposers a request speculates with, how many drafts a step verifies
(`auto` reads the backend's cost curve and the acceptance so far), and the draft model's cost, timed beside the
target. A part of `Scheduler` (its `runner`, `cost_curve` and `acceptance`), kept apart from the step itself."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mlx_engine.api import SamplingParams

if TYPE_CHECKING:
    from mlx_engine.sequence import Sequence
    from mlx_engine.speculative.cost import CostCurve
    from mlx_engine.speculative.policy import SpecState
    from mlx_engine.speculative.proposers import Proposer


class SpeculationPolicy:
    runner: Any  # backends.base.ModelRunner
    cost_curve: CostCurve | None
    acceptance: dict[str, list[int]]

    def _spec_state(self, params: SamplingParams) -> SpecState | None:
        from mlx_engine.speculative import policy as sp
        from mlx_engine.speculative.proposers import DraftModel, PromptLookup, SelfDraft

        mode, runner = params.speculative, self.runner
        if mode is None or (mode == "auto" and not runner.capabilities.rollback):
            return None
        if mode != "auto":
            kinds = [mode]
        else:  # prompt lookup (free to draft) and a loaded draft model, each step the one predicted to gain most
            kinds = ["prompt-lookup"] + (["draft"] if runner.draft is not None else [])
        curve = self._cost_curve() if mode == "auto" else None
        proposers, priors = [], []
        for kind in kinds:
            if kind == "draft":
                model = DraftModel(runner.draft.forwards(), self._draft_cost() if curve else 0.0)
                if mode == "auto":
                    model.guesses = False  # see DraftModel.guesses
                proposer: Proposer = model
            elif kind == "self":
                forwards = runner.forwards()
                proposer = SelfDraft(forwards, forwards.self_draft_layers)
            else:
                proposer = PromptLookup()
            if curve is not None and curve.best_k(1.0, params.num_draft_tokens, proposer.draft_cost) == 0:
                continue  # "auto": not even perfect drafts from it would pay on this backend
            acc, tested = self.acceptance.get(kind, [0, 0])
            proposers.append(proposer)
            priors.append((acc + sp.PRIOR_WEIGHT * sp.AUTO_PRIOR_ACCEPTANCE) / (tested + sp.PRIOR_WEIGHT))
        if not proposers:
            return None
        state = sp.SpecState(mode, proposers[-1], params.num_draft_tokens, proposers=proposers, priors=priors)
        if curve is not None:  # the largest first verification any of them would make
            state.allowance = max(sp.probe_allowance(curve, prior, params.num_draft_tokens, p.draft_cost)
                                  for p, prior in zip(proposers, priors))
        return state

    def _cost_curve(self) -> CostCurve:
        if self.cost_curve is None:
            from mlx_engine.speculative.timing import cached_cost_curve

            self.cost_curve = cached_cost_curve(self.runner.forwards())  # measured once per model and machine
        return self.cost_curve

    def _draft_cost(self) -> float:
        """T_draft(1) / T(1): a draft model's step in target decode steps, timed beside a target step. Divided by
        the curve's T(1), timed minutes or runs before, a slow spell of the machine made the draft look dearer, and
        one such reading kept "auto" from drafting for the rest of a run, since only the proposals it makes correct
        the figure (docs/benchmarks/code-figures.md, "Measurements moved out of the code")."""
        curve = self._cost_curve()
        if "draft" not in curve.draft_costs:
            from mlx_engine.speculative import timing

            t = timing.time_forward(self.runner.draft.forwards(), 1, logits_at="last")
            t1 = timing.time_forward(self.runner.forwards(), 1, logits_at="last")
            curve.draft_costs["draft"] = t / t1 if t1 > 0 else 0.0
        return curve.draft_costs["draft"]

    def _spec_k(self, seq: Sequence) -> int | None:
        """Draft tokens for a speculative sequence this step (0: verify none, a plain step of its own), or
        None: it decodes in the batch."""
        st = seq.spec
        if st is None:
            return None
        room = seq.max_new - seq.num_sampled - 1  # the verification samples one token more than it drafts
        if seq.reasoning is not None:  # no draft past a reasoning budget, or into an answer whose grammar starts late
            cap = seq.reasoning.draft_room(len(seq.unread), seq.constraint is not None)
            room = room if cap is None else min(room, cap)
        if st.mode != "auto":
            return max(0, min(st.k, room))
        # the proposers with a candidate (prompt lookup: the last tokens recur; a draft model always has one, so one
        # bad verification no longer ends its turn; the loss budget bounds what retrying costs)
        return st.auto_k(self._cost_curve(), min(st.k_max, room), seq.num_sampled, seq.prompt + seq.generated) or None
