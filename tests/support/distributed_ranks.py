"""What every rank runs in tests/test_distributed.py, under `mlx.launch --backend ring -n 2 --hosts 127.0.0.1`.

argv: a JSON scenario file and an output file. The scenario: {"mode": "pipeline" | "tensor", "runs": [{"model":
path | null, "options": {...}, "model_by_rank": {rank: path}, "batches": [[request, ...], ...]}]}, a request being
{"ids": [...], "sampling": {SamplingParams fields}, "cancel_after": n (optional: read n events, then cancel)};
"env": variables set on every rank for that run;
"started_file": a file rank 0 creates once the first batch's first token is out. Each batch's requests are
submitted together (they run as one continuous batch); rank 0 writes, per run, each request's tokens, finish
reason, error and usage, then the engine's kv_stats. The other ranks serve rank 0's plans, once per run.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from typing import Any


def read_events(stream: Any, cancel_after: int | None = None) -> list[Any]:
    """A request's events; with `cancel_after`, its first that many, and then the request is cancelled."""
    if cancel_after is None:
        return list(stream)
    events = [next(stream) for _ in range(cancel_after)]
    stream.close()
    return events


def main() -> int:
    from mlx_engine import Engine, GenerationRequest, SamplingParams, distributed

    scenario = json.loads(open(sys.argv[1]).read())
    rank = distributed.launched_rank()
    mode = scenario["mode"]
    if rank == 0:
        distributed.stop_on_sigterm(0)  # as the CLI's rank 0: a lost rank ends it with EXIT_RANK_LOST and its line
    results = []
    restore: dict[str, str | None] = {}
    for run in scenario["runs"]:
        model = run.get("model_by_rank", {}).get(str(rank), run["model"])
        options = run.get("options", {})
        for key, value in restore.items():  # what the run before set, as it was
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        restore = {key: os.environ.get(key) for key in run.get("env", {})}
        os.environ.update(run.get("env", {}))
        if rank != 0:
            code = distributed.serve_rank(model, mode, **options)
            if code:
                return code
            continue
        try:
            engine = Engine.load(model, distributed=mode, **options)
        except Exception as e:  # noqa: BLE001 - the test reads it
            results.append({"load_error": f"{type(e).__name__}: {e}"})
            break
        out = []
        for batch in run.get("batches", []):
            streams = [engine.generate(GenerationRequest(prompt_token_ids=r["ids"],
                                                         sampling=SamplingParams(**r["sampling"]))) for r in batch]
            if run.get("started_file"):  # the test acts on the ranks mid-generation
                next(streams[0])
                open(run["started_file"], "w").close()
            for r, stream in zip(batch, streams):
                events = read_events(stream, r.get("cancel_after"))
                last = events[-1]
                out.append({"tokens": [t for e in events for t in e.token_ids], "finish": last.finish_reason,
                            "error": last.error, "cached": last.usage.cached_prompt_tokens if last.usage else None})
        results.append({"requests": out, "kv": engine.kv_stats(), "info": {"weight_bytes": engine.info.weight_bytes}})
        engine.close()
    if rank == 0:
        with open(sys.argv[2], "w") as f:
            json.dump(results, f)
    return 0


if __name__ == "__main__":
    try:
        code = main()
    except SystemExit:
        raise
    except BaseException:  # noqa: BLE001 - shown in the test's failure
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    os._exit(code)
