"""Speculative decoding on this backend: the verify-cost curve, then plain decoding against each proposer.

    uv run python bench/speculative.py [--model M] [--backend mlx|torch] [--tokens 48] [--temperatures 0 0.7]
                                       [--modes ...] [--kinds ...] [--seed S] [--repeats N] [--vary-seed]

1. The cost curve T(k+1)/T(1): a target forward over k+1 new tokens (logits at every position, as a
   verification computes) against a plain decode step (one token, logits at one position), k = 1..8,
   after 64 cached tokens, min of 3 timed runs after a warm-up.
2. For one prompt per kind, (a) an edit that quotes its input, (b) open chat, (c) code, at each
   temperature: plain decoding and each proposer. Per run: tokens per target forward (decode phase),
   acceptance rate, mean accepted tokens per verification, decode tokens/s, and the speedup over plain
   predicted from the forwards actually made (their widths, through the cost curve, plus the drafting
   cost) beside the measured one. With `--vary-seed`, repeat r samples with seed S + r: at temperature > 0
   each repeat is another reply, and a row sums its counts over the replies (one reply's speedup moved by
   20-50% from seed to seed on code at 0.7, so one seed's row says little about a proposer).

The "draft" proposer is the same model at another precision (`Engine.load(draft_bits=...)`):
- MLX: the target's weights (the embedded Q4_1 GGUF: 4-bit, groups of 32) quantized again to affine 4-bit
  groups of 64 (`--draft-bits`, default 4). On MLX's CPU backend it costs as much as the target (float32
  host copies either way), so there it shows the acceptance of a near-identical draft, not a speedup.
- torch on the CPU: the target's float32 weights held as int8, for the CPU's int8 matmul (`--draft-bits 8`,
  the default there): about 0.3 T(1) a drafted token.
- torch on CUDA: the same model loaded again, its weights rounded through 4-bit groups of 64
  (`requantize_torch`): the target's cost, other numbers.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402

from mlx_engine import Engine, GenerationRequest, SamplingParams  # noqa: E402
from mlx_engine.speculative.cost import CostCurve  # noqa: E402
from mlx_engine.speculative.timing import time_forward  # noqa: E402

EDIT_TEXT = ("Our team met on Tuesday to review the quarterly plan. We agreed to move the launch to May, hire "
             "two more engineers for the data platform, and cut the travel budget by ten percent. Maria will "
             "send the updated timeline to everyone by Friday, and the next review is set for the first week "
             "of June.")
CODE = '''def total_price(items, tax_rate):
    total = 0
    for item in items:
        if item["quantity"] > 0:
            total = total + item["price"] * item["quantity"]
    return total * (1 + tax_rate)
'''
PROMPTS = {
    "edit": f"Fix the grammar of this text and return it otherwise unchanged:\n\n{EDIT_TEXT}",
    "chat": "What are three good habits for staying healthy? Answer in a few sentences.",
    "code": f"Add type hints and a docstring to this Python function, keeping the code the same:\n\n{CODE}",
}
# more open-chat prompts, for a mean over prompts (`--kinds chat chat2 ... chat6`); not run by default
MORE_CHAT = ["Explain why the sky is blue to a ten-year-old.",
             "Give me some tips for learning a new language.",
             "What is the difference between a virus and a bacterium?",
             "Describe a good morning routine for a busy student.",
             "Why do people enjoy music? Answer briefly."]
PROMPTS.update({f"chat{i + 2}": p for i, p in enumerate(MORE_CHAT)})
DEFAULT_KINDS = ["edit", "chat", "code"]
MODES = ["plain", "prompt-lookup", "self", "draft", "auto"]


def requantize_torch(model, bits: int = 4, group_size: int = 64) -> None:
    """The torch backend's `requantize`: every projection, the embedding and the head, rounded in place through
    affine `bits`-bit groups of `group_size` (as MLX's quantize: scale (max - min) / (2^bits - 1), offset min).
    The weights stay float32, so the draft costs what the target does; only its numbers change."""
    import torch

    def round_trip(w: torch.Tensor) -> None:
        out, inp = w.shape
        g = w.float().reshape(out, inp // group_size, group_size)
        lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
        scale = (hi - lo).clamp_min(1e-12) / (2**bits - 1)
        w.copy_((torch.round((g - lo) / scale) * scale + lo).reshape(out, inp).to(w.dtype))

    layers = [m for block in model.layers for m in (
        block.self_attn.q_proj, block.self_attn.k_proj, block.self_attn.v_proj, block.self_attn.o_proj,
        block.mlp.gate_proj, block.mlp.up_proj, block.mlp.down_proj)]
    with torch.inference_mode():
        for m in [model.embed_tokens, *([model.lm_head] if model.lm_head is not None else []), *layers]:
            if isinstance(m.weight, torch.Tensor):
                round_trip(m.weight)


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _draft_label(engine: Engine) -> str:
    draft = engine.diagnostics().runner.draft
    return "none" if draft is None else draft.info.quantization


DRAFT_WIDTHS = (1, 2, 4, 5, 8, 16, 32, 33, 64)  # a draft model's forwards: a draft step, catch-ups, long catch-ups
FIRST_WIDTHS = (1, 2, 4, 8, 12)  # its first forward of a proposal: the catch-up's last rows and the guess


def cost_curve(engine: Engine, k_max: int = 8) -> tuple[CostCurve, float, tuple[CostCurve, CostCurve] | None]:
    """The target's verify cost curve T(w)/T(1); the self draft's step; the draft model's forward over w rows,
    also over T(1): with the last row's logits (a catch-up over the tokens prompt lookup copied or plain steps took,
    a draft step), and with every row's (a proposal's first forward, which reads the guess of its drafts)."""
    target = engine.diagnostics().runner
    runner = target.forwards()
    t1 = time_forward(runner, 1, context=64, repeats=3, logits_at="last")
    ratios = {1: 1.0}
    for w in range(2, k_max + 2):
        ratios[w] = time_forward(runner, w, context=64, repeats=3) / t1
    self_cost = time_forward(runner, 1, context=64, repeats=3, first_layers=runner.self_draft_layers) / t1
    draft = None
    if target.draft is not None:
        draft = (CostCurve({w: time_forward(target.draft.forwards(), w, context=64, repeats=3, logits_at="last") / t1
                            for w in DRAFT_WIDTHS}),
                 CostCurve({w: time_forward(target.draft.forwards(), w, context=64, repeats=3) / t1
                            for w in FIRST_WIDTHS}))
    return CostCurve(ratios, t1), self_cost, draft


def run(engine: Engine, prompt: str, mode: str, temperature: float, tokens: int, seed: int = 0) -> dict:
    """One request in `mode`: "plain" or a speculative mode; "draft:noguess" runs the draft model without guessing
    its drafts from prompt lookup's copy (`DraftModel.guesses`), for a side-by-side ("auto" never guesses)."""
    from mlx_engine.speculative.proposers import DraftModel

    mode, _, variant = mode.partition(":")
    sched = engine.diagnostics().scheduler
    sched.retired = finished = []
    DraftModel.guesses = variant != "noguess"
    try:
        params = SamplingParams(temperature=temperature, seed=seed, max_tokens=tokens, ignore_eos=True,
                                speculative=None if mode == "plain" else mode, num_draft_tokens=8)
        t = time.perf_counter()
        events = list(engine.generate(GenerationRequest(messages=[{"role": "user", "content": prompt}],
                                                        sampling=params)))
        wall = time.perf_counter() - t
    finally:
        sched.retired = None
        DraftModel.guesses = True
    final = events[-1]
    seq = finished[0]
    history = seq.spec.history if seq.spec is not None else []
    decode_forwards = final.stats.target_forwards - 1
    widths = [d + 1 for d, _ in history] + [1] * (decode_forwards - len(history))
    spec = seq.spec
    # "auto": the proposers it drafted with (prompt lookup, a draft model or both)
    used = [p.name for p, (_, drafted, _) in zip(spec.proposers, spec.tallies) if drafted] if spec is not None else []
    proposer = "+".join(used) or "plain"
    draft_proposals = None  # a draft model's proposals (catch-ups and drafts); prompt lookup's cost nothing
    if spec is not None and any(hasattr(p, "proposals") for p in spec.proposers):
        draft_proposals = [x for p in spec.proposers for x in getattr(p, "proposals", [])]
    return {"stats": final.stats, "n": final.usage.completion_tokens, "widths": widths, "history": history,
            "proposer": proposer, "draft_proposals": draft_proposals,
            "from_draft": sum(d for e in events for d in e.from_draft), "wall": wall}


def draft_step_cost(engine: Engine, temperature: float, k: int = 8) -> float:
    """A draft model's cost per drafted token in T(1), as its proposals spend it: a forward and the sampling of
    each draft (`time_forward` times the forward alone), at the request's temperature, after a catch-up of one."""
    from mlx_engine.sampling import Sampler
    from mlx_engine.speculative.proposers import DraftInput, DraftModel

    runner = engine.diagnostics().runner
    sampler = Sampler(SamplingParams(temperature=temperature, seed=0), runner.vocab_size)
    best = float("inf")
    for _ in range(4):  # the first is a warm-up
        draft = DraftModel(runner.draft.forwards())
        draft.prefill([(7 * i) % 97 + 3 for i in range(64)])
        draft.propose(DraftInput(draft.tokens + [5], k, sampler, lambda a, b: []))
        best = min(best, draft.last_spent[0])
    return best / k / engine.diagnostics().scheduler.cost_curve.t1_s


def predicted(r: dict, curve: CostCurve, costs: dict[str, float],
              draft_curves: tuple[CostCurve, CostCurve] | None) -> float:
    """Decode tokens over the predicted cost of the forwards made, in plain decode steps: each target forward's
    width through the curve; a draft model's forwards through its own curves (catch-ups; the first draft's
    forward, over the rows it caught up and guessed, with logits at each where it guessed; one row a draft after)
    and each draft's sampling (its step cost in `costs`, forward and sampling, less the forward of one row); a
    self draft's drafted tokens at its cost per token (prompt lookup's cost nothing)."""
    if r["draft_proposals"] is not None:
        last, every = draft_curves
        drafting = 0.0
        for catch_ups, tail, guess, singles, k in r["draft_proposals"]:
            first = every.cost(tail + guess) if guess else last.cost(tail)
            drafting += sum(last.cost(w) for w in catch_ups) + first + singles * last.cost(1)
            drafting += k * (costs["draft"] - last.cost(1))
    else:
        drafting = sum(w - 1 for w in r["widths"]) * costs[r["proposer"]]
    cost = sum(curve.cost(w) for w in r["widths"]) + drafting
    return (r["n"] - 1) / cost if cost else 1.0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--backend", choices=("mlx", "torch"), default="mlx")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0, help="sampling seed of every request (temperature > 0)")
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7])
    ap.add_argument("--modes", nargs="+", default=MODES)
    ap.add_argument("--kinds", nargs="+", default=DEFAULT_KINDS, choices=list(PROMPTS))
    ap.add_argument("--draft-bits", type=int, choices=(4, 8), default=None,
                    help="the draft's bits (the same model; default 4 on MLX, 8 on torch on the CPU)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="runs of each mode, in rotation; tok/s and the measured speedup are medians (of each "
                         "rotation's ratio to plain)")
    ap.add_argument("--vary-seed", action="store_true",
                    help="repeat r samples with seed + r (at temperature > 0 another reply each repeat); a row "
                         "then counts over all repeats, and the measured speedup shows the mean beside the median")
    args = ap.parse_args()

    from mlx_engine.loading import resolve

    # a draft is loaded only with the "draft" mode: "auto" then drafts with it and by prompt lookup, else by prompt
    # lookup alone (so `--modes plain prompt-lookup auto` measures what the app and `serve` run, which load no draft)
    draft = str(resolve(args.model)[0]) if "draft" in args.modes else None
    torch_cuda = args.backend == "torch" and args.device != "cpu" and _cuda_available()
    bits = None if draft is None or torch_cuda else args.draft_bits or (8 if args.backend == "torch" else 4)
    engine = Engine.load(args.model, draft_model=draft, backend=args.backend, device=args.device, draft_bits=bits)
    diag = engine.diagnostics()
    if draft is not None and torch_cuda:
        diag.call(lambda: requantize_torch(diag.runner.draft.model))
    versions = f"mlx {mx.__version__}, Metal {mx.metal.is_available()}"
    if args.backend == "torch":
        import torch

        versions = f"torch {torch.__version__} on {engine.info.device}"
    print(f"# {engine.info.name}, backend {args.backend}, {platform.platform()}, nproc "
          f"{subprocess.getoutput('nproc')}, {versions}, {datetime.date.today()}")
    curve, self_cost, draft_curves = diag.call(lambda: cost_curve(engine))
    diag.scheduler.cost_curve = curve
    print(f"\nT(1) = {curve.t1_s * 1000:.1f} ms (one decode step, 64 tokens cached)\n")
    print("| k | k+1 | T(k+1)/T(1) | best case k+1 tokens / cost |")
    print("|---|---|---|---|")
    for k in range(1, 9):
        c = curve.cost(k + 1)
        print(f"| {k} | {k + 1} | {c:.2f} | {(k + 1) / c:.2f} |")
    step_costs = {t: float("nan") for t in args.temperatures}  # the draft model's, by temperature
    if draft_curves is not None:
        step_costs = {t: diag.call(lambda t=t: draft_step_cost(engine, t)) for t in args.temperatures}
    steps = ", ".join(f"{step_costs[t]:.2f} at temperature {t:g}" for t in args.temperatures)
    print(f"\nDrafting cost per token, in T(1): self ({diag.runner.forwards().self_draft_layers} of "
          f"{len(diag.runner.model.layers)} layers + head) {self_cost:.2f}, draft ({_draft_label(engine)}) "
          f"{steps} (forward and sampling), prompt lookup 0")
    if draft_curves is not None:
        print("The draft model's forward over w rows (a catch-up), in T(1): " + ", ".join(
            f"{w}: {draft_curves[0].cost(w):.2f}" for w in DRAFT_WIDTHS))
        print("... with logits at every row (a proposal's first forward, the guess of its drafts), in T(1): "
              + ", ".join(f"{w}: {draft_curves[1].cost(w):.2f}" for w in FIRST_WIDTHS))
    print()

    print("| prompt | temp | mode | tokens/forward | acceptance | mean accepted | decode tok/s | "
          "speedup measured | speedup predicted |")
    print("|---|---|---|---|---|---|---|---|---|")
    for kind in args.kinds:
        for temp in args.temperatures:
            runs: dict[str, list[dict]] = {mode: [] for mode in args.modes}
            for i in range(args.repeats):  # in rotation, so the machine's drift falls on every mode alike
                seed = args.seed + i if args.vary_seed else args.seed
                for mode in args.modes:
                    runs[mode].append(run(engine, PROMPTS[kind], mode, temp, args.tokens, seed))
            base = [r["stats"].decode_tps for r in runs["plain"]] if "plain" in runs else None
            costs = {"plain": 0.0, "prompt-lookup": 0.0, "self": self_cost, "draft": step_costs[temp]}
            for mode in args.modes:
                # without --vary-seed the same tokens every repeat (the curve, prompt and seed are fixed): the last
                rs = runs[mode] if args.vary_seed else runs[mode][-1:]
                tps = statistics.median(x["stats"].decode_tps for x in runs[mode])
                tpf = sum(r["n"] - 1 for r in rs) / max(sum(r["stats"].target_forwards - 1 for r in rs), 1)
                ratios = [x["stats"].decode_tps / b for x, b in zip(runs[mode], base)] if base else [float("nan")]
                measured = f"{statistics.median(ratios):.2f}x"
                if args.vary_seed:
                    measured += f" (mean {statistics.fmean(ratios):.2f}x)"
                pred = statistics.fmean(predicted(r, curve, costs, draft_curves) for r in rs)
                drafted = sum(d for r in rs for d, _ in r["history"])
                accepted = sum(a for r in rs for _, a in r["history"])
                verifies = sum(len(r["history"]) for r in rs)
                acc = f"{accepted / drafted:.2f}" if drafted else "-"
                mean = f"{accepted / verifies:.2f}" if verifies else "-"
                used = {p for r in rs for p in r["proposer"].split("+")} - {"plain"}
                label = f"{mode} ({'+'.join(sorted(used, reverse=True))})" if mode.startswith("auto") and used else mode
                print(f"| {kind} | {temp:g} | {label} | {tpf:.2f} | {acc} | {mean} | {tps:.2f} | "
                      f"{measured} | {pred:.2f}x |", flush=True)
    engine.close()


if __name__ == "__main__":
    main()
