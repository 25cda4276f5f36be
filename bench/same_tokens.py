"""Whether two checkouts of the engine generate the same: a refactor's check that behaviour did not move.

    uv run python bench/same_tokens.py --before /path/to/other/checkout

Each checkout runs in a fresh process, on a tiny random llama (tests.tiny_models) and the embedded SmolLM2: a mixed
batch (greedy, seeded temperature, log-probabilities, penalties, logit bias, prompt log-probabilities, max_tokens=0,
prompt-lookup and self speculation, min-p/top-k) at once and one by one, with and without prefix caching, and a JSON
response format. It records every token id, log-probability entry, prompt score, finish reason and each request's
KV block ids after every scheduler step, and prints whether the two records are identical (exit status 1 if not).
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
from pathlib import Path
from mlx_engine import Engine, GenerationRequest, SamplingParams
from mlx_engine.api import ResponseFormat
from mlx_engine.scheduler import Scheduler
from tests.tiny_models import random_llama_folder

folder = random_llama_folder(Path(sys.argv[2]) / "m", num_heads=8, num_kv_heads=2)
PROMPTS = [[(5 * i + 7 * k) % 120 + 4 for i in range(n)] for k, n in enumerate([9, 40, 17, 70, 3, 33, 200])]
CASES = [dict(logprobs=None), dict(temperature=0.7, top_p=0.9, seed=11), dict(logprobs=3),
         dict(temperature=0.8, seed=5, repetition_penalty=1.3, logprobs=2),
         dict(logit_bias={7: 3.0}, frequency_penalty=0.5), dict(prompt_logprobs=2, logprobs=1),
         dict(max_tokens=0, prompt_logprobs=1),
         dict(speculative="prompt-lookup", logprobs=2), dict(temperature=0.6, seed=3, speculative="self"),
         dict(temperature=0.9, seed=9, min_p=0.05, top_k=20)]
BLOCKS = []
step = Scheduler.step

def recorded_step(self):  # every request's block ids after each step (the engine's own bookkeeping, read only)
    step(self)
    manager = getattr(self.runner.cache, "manager", None)
    if manager is not None:
        BLOCKS.append({r: [b.block_id for b in bs] for r, bs in manager.req_to_blocks.items()})

Scheduler.step = recorded_step

def run(e, reqs):
    out = []
    for s in [e.generate(r) for r in reqs]:
        ev = list(s)
        out.append({"tokens": [t for x in ev for t in x.token_ids], "draft": [d for x in ev for d in x.from_draft],
                    "lps": [(lp.token_id, lp.logprob, lp.top) for x in ev for lp in x.logprobs],
                    "plp": [(lp.token_id, lp.logprob, lp.top) for x in ev for lp in x.prompt_logprobs],
                    "fin": ev[-1].finish_reason, "err": ev[-1].error})
    return out

res = {}
for opts in ({}, {"prefix_caching": False}):
    with Engine.load(str(folder), backend="mlx", **opts) as e:
        reqs = [GenerationRequest(prompt_token_ids=PROMPTS[i % len(PROMPTS)], sampling=SamplingParams(
            **{"temperature": 0.0, "max_tokens": 14, "ignore_eos": True, **c})) for i, c in enumerate(CASES)]
        res[f"{opts} at once"] = run(e, reqs)
        res[f"{opts} one by one"] = [run(e, [r])[0] for r in reqs]
        res[f"{opts} blocks"], BLOCKS[:] = list(BLOCKS), []
with Engine.load(None, backend="mlx") as e:
    res["embedded"] = run(e, [
        GenerationRequest(prompt="Name three colors as JSON.", sampling=SamplingParams(
            temperature=0.0, max_tokens=24, response_format=ResponseFormat(type="json_object"))),
        GenerationRequest(prompt="Hello there", sampling=SamplingParams(temperature=0.5, seed=1, max_tokens=20,
                                                                      logprobs=2))])
print(json.dumps(res, sort_keys=True, default=repr))
"""


def record(checkout: Path) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        r = subprocess.run([sys.executable, "-c", CHILD, str(checkout), tmp], capture_output=True, text=True,
                           cwd=checkout)
    if r.returncode != 0:
        sys.exit(f"{checkout}: {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else r.returncode}")
    return r.stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", type=Path, required=True, help="the other checkout (e.g. a git worktree of main)")
    args = ap.parse_args()
    before, after = record(args.before.resolve()), record(HERE)
    for name, out in (("before", before), ("after", after)):
        print(f"{name}: sha256 {hashlib.sha256(out.encode()).hexdigest()}, {len(out)} bytes")
    print("identical" if before == after else "DIFFERENT")
    sys.exit(0 if before == after else 1)


if __name__ == "__main__":
    main()
