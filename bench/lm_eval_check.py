"""lm-evaluation-harness against `roofline serve`: are its scores the engine's own?

lm-eval is not a dependency of this project (it pulls in torch and datasets). Install it in a venv of its own
(`uv venv /tmp/lmeval && VIRTUAL_ENV=/tmp/lmeval uv pip install "lm_eval[api]"`, with a CPU torch), start the
server, run the two small tasks in bench/lm_eval/ from the repo root, then this script on its output:

    uv run roofline serve --port 8095 &
    HF_DATASETS_OFFLINE=1 /tmp/lmeval/bin/lm_eval --model local-completions \\
        --model_args base_url=http://127.0.0.1:8095/v1/completions,model=default,num_concurrent=2 \\
        --batch_size 8 --tasks roofline_mc,roofline_gen --include_path bench/lm_eval --output_path OUT --log_samples
    uv run python bench/lm_eval_check.py OUT [OUT2]

lm-eval finds the server's /tokenizer_info and /tokenize and tokenizes through them (no tokenizer download); it
scores each choice with one /v1/completions request per batch of prompts (echo, logprobs 1, max_tokens 1).
For every (context, continuation) pair in the samples this script recomputes, in process, the continuation's
log-likelihood with `Engine.score` over lm-eval's own token split, and its is-greedy flag from the forward's
argmax, and prints the largest difference. With a second output folder (say batch size 1 against 8) it also
compares the two runs' log-likelihoods and generations.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mlx_engine import Engine


def samples(out: Path, task: str) -> list[dict]:
    files = sorted(out.rglob(f"samples_{task}_*.jsonl"))
    if not files:
        sys.exit(f"{out}: no samples_{task}_*.jsonl (run lm_eval with --log_samples --output_path {out})")
    return [json.loads(line) for line in files[-1].read_text().splitlines()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("outputs", nargs="+", type=Path, help="lm_eval --output_path folders (one or two)")
    ap.add_argument("--model", default=None, help="the model the server ran (default: the embedded one)")
    args = ap.parse_args()
    runs = [samples(out, "roofline_mc") for out in args.outputs]
    worst_ll, greedy_agree, n = 0.0, 0, 0
    with Engine.load(args.model) as engine:
        for s in runs[0]:
            for k, resp in enumerate(s["resps"]):
                context, continuation = (s["arguments"][f"gen_args_{k}"][a] for a in ("arg_0", "arg_1"))
                whole = engine.encode(context + continuation, add_special_tokens=False)  # lm-eval's encode_pair
                ctx = engine.encode(context, add_special_tokens=False)
                ids = ctx + whole[len(ctx):]
                ll = float(engine.score(ids)[len(ctx) - 1:].sum())
                logits = engine.forward_logits(ids)
                greedy = all(int(logits[len(ctx) - 1 + j].argmax()) == t for j, t in enumerate(ids[len(ctx):]))
                got_ll, got_greedy = resp[0]
                worst_ll = max(worst_ll, abs(ll - float(got_ll)))
                greedy_agree += greedy == (str(got_greedy) == "True")
                n += 1
    acc = sum(s["acc"] for s in runs[0]) / len(runs[0])
    print(f"roofline_mc: {len(runs[0])} questions, acc {acc:.4f}; {n} log-likelihoods, max |lm-eval - Engine.score| "
          f"{worst_ll:.2e}; is_greedy agrees on {greedy_agree}/{n}")
    if len(runs) == 2:
        diff = max(abs(float(a[0][0]) - float(b[0][0])) for x, y in zip(*runs) for a, b in zip(x["resps"], y["resps"]))
        gens = [[s["resps"] for s in samples(out, "roofline_gen")] for out in args.outputs]
        print(f"{args.outputs[0]} vs {args.outputs[1]}: log-likelihoods max difference {diff:.2e}; "
              f"generations {'identical' if gens[0] == gens[1] else 'differ'}")


if __name__ == "__main__":
    main()
