"""The two prompts the simulated-Mac tests run, and how their results are compared."""

from __future__ import annotations

import numpy as np

from mlx_engine import Engine, GenerationRequest, SamplingParams
from tests.support.tolerance import assert_f32_close

PROMPTS = [[(7 * i + 3) % 120 + 5 for i in range(45)], [(11 * i + 5) % 120 + 5 for i in range(21)]]


def together(engine: Engine, params: SamplingParams) -> list[tuple[list[int], np.ndarray, int]]:
    """Both prompts submitted at once (their decode steps batch), each: (tokens, top-5 (id, logprob) per step,
    tokens that came from drafts)."""
    streams = [engine.generate(GenerationRequest(prompt_token_ids=p, sampling=params)) for p in PROMPTS]
    out = []
    for s in streams:
        events = list(s)
        assert events[-1].finish_reason == "length", events[-1].error
        lps = [lp for ev in events for lp in ev.logprobs]
        out.append(([lp.token_id for lp in lps], np.array([[list(t) for t in lp.top] for lp in lps]),
                    sum(d for ev in events for d in ev.from_draft)))
    assert engine.kv_stats()["used"] == 0
    return out


def assert_same(got: list, want: list, atol: float | None = None, units: float | None = None) -> None:
    """Same tokens and top ids; log-probabilities within `atol` (half precision) or `units` (float32 both, in
    tests/support/tolerance.py's units)."""
    for (tokens, top, _), (want_tokens, want_top, _) in zip(got, want, strict=True):
        assert tokens == want_tokens
        assert np.array_equal(top[..., 0], want_top[..., 0])
        if units is not None:
            assert_f32_close(top[..., 1], want_top[..., 1], units, "log-probabilities")
        else:
            assert float(np.abs(top[..., 1] - want_top[..., 1]).max()) <= atol
