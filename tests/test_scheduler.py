"""Continuous batching: concurrent requests get exactly the tokens they get alone, join and leave between
steps, respect the token budget, wait for KV blocks, and free everything on cancel."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from mlx_engine import Engine, GenerationRequest, SamplingParams
from tests.tiny_models import random_llama_folder
from tests.tolerance import assert_f32_close

PROMPTS = [[(5 * i + 7 * k) % 120 + 4 for i in range(n)] for k, n in enumerate([9, 40, 17, 70, 3, 33])]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return random_llama_folder(tmp_path_factory.mktemp("m") / "m", num_heads=8, num_kv_heads=2)


def collect(stream) -> tuple[list[int], list, object]:
    events = list(stream)
    return [t for e in events for t in e.token_ids], [lp for e in events for lp in e.logprobs], events[-1]


def params(**kw) -> SamplingParams:
    kw.setdefault("temperature", 0.0)
    kw.setdefault("ignore_eos", True)
    kw.setdefault("max_tokens", 12)
    kw.setdefault("logprobs", 5)
    return SamplingParams(**kw)


def alone(folder: Path, prompt: list[int], p: SamplingParams) -> tuple[list[int], list]:
    with Engine.load(str(folder), prefix_caching=False) as e:
        tokens, lps, _ = collect(e.generate(GenerationRequest(prompt_token_ids=prompt, sampling=p)))
        return tokens, lps


@pytest.mark.parametrize("head_major", [True, False], ids=["head-major", "token-major"])
def test_concurrent_requests_equal_sequential_runs(folder: Path, head_major: bool, monkeypatch) -> None:
    """Six requests submitted at once (greedy and seeded sampling, different lengths) are batched; each gets
    the tokens and log-probabilities it gets alone."""
    ps = [params(), params(max_tokens=5), params(temperature=1.0, seed=3), params(), params(max_tokens=20),
          params(temperature=0.8, top_k=20, seed=11)]
    want = [alone(folder, pr, p) for pr, p in zip(PROMPTS, ps)]
    import mlx_engine.kv.paged as paged

    init = paged.PagedKVStorage.__init__
    monkeypatch.setattr(paged.PagedKVStorage, "__init__",
                        lambda self, *a, **kw: init(self, *a, **{**kw, "head_major": head_major}))
    with Engine.load(str(folder), prefix_caching=False, prefill_chunk_size=16) as e:
        streams = [e.generate(GenerationRequest(prompt_token_ids=pr, sampling=p)) for pr, p in zip(PROMPTS, ps)]
        got = [collect(s) for s in streams]
        sched = e.diagnostics().scheduler
        assert sched.num_steps < sum(len(t) for t, _ in want)  # batched: fewer steps than tokens
        assert e.kv_stats()["used"] == 0
    for (tokens, lps, final), (want_tokens, want_lps), p in zip(got, want, ps):
        assert tokens == want_tokens
        assert final.finish_reason == "length" and final.usage.completion_tokens == p.max_tokens
        # float32 floor: 9.8 units (tests/tolerance.py) on an AMD EPYC; x4 headroom
        assert_f32_close([a.logprob for a in lps], [b.logprob for b in want_lps[:len(lps)]], 40, "batched vs alone")


def test_request_joins_while_others_decode(folder: Path) -> None:
    with Engine.load(str(folder), prefix_caching=False) as e:
        long = e.generate(GenerationRequest(prompt_token_ids=PROMPTS[1], sampling=params(max_tokens=30)))
        first = next(long)  # the long request is decoding
        late = e.generate(GenerationRequest(prompt_token_ids=PROMPTS[3], sampling=params(max_tokens=4)))
        late_tokens, _, late_final = collect(late)
        rest, _, final = collect(long)
        assert final.finish_reason == "length" and late_final.finish_reason == "length"
        # the late request finished while the long one was still running
        assert late_final.usage.completion_tokens == 4
    assert late_tokens == alone(folder, PROMPTS[3], params(max_tokens=4))[0]
    assert list(first.token_ids) + rest == alone(folder, PROMPTS[1], params(max_tokens=30))[0]


def test_token_budget_chunks_a_long_prompt_between_decode_steps(folder: Path) -> None:
    """With a budget of 16 tokens per step, a 70-token prompt is prefilled over several steps, in the same
    steps as the other request's decode, which never pauses."""
    with Engine.load(str(folder), prefix_caching=False) as e:
        e.diagnostics().scheduler.token_budget = 16
        e.diagnostics().scheduler.trace = trace = []
        a = e.generate(GenerationRequest(prompt_token_ids=PROMPTS[0], sampling=params(max_tokens=30)))
        next(a)
        b = e.generate(GenerationRequest(prompt_token_ids=PROMPTS[3], sampling=params(max_tokens=2)))
        a_tokens, _, _ = collect(a)
        b_tokens, _, _ = collect(b)
    assert all(d + p <= 16 for d, p in trace)
    mixed = [(d, p) for d, p in trace if d >= 1 and p > 0]
    assert sum(p for _, p in mixed) >= 60 and len(mixed) >= 5  # b's prompt went in chunks beside a's decode
    assert b_tokens == alone(folder, PROMPTS[3], params(max_tokens=2))[0]
    assert a_tokens == alone(folder, PROMPTS[0], params(max_tokens=30))[0][1:]


def test_a_step_is_one_forward_over_decode_rows_and_prefill_chunks(folder: Path, monkeypatch) -> None:
    """A decoding request and two new prompts: their step packs the decode row and both prompts' chunks
    into one forward of (1, 1 + 16 + 16) rows (the chunk size is 16), every step is one forward, and each
    request gets the tokens and log-probabilities it gets alone."""
    from mlx_engine.backends.mlx.runner import Runner

    shapes: list[tuple[int, ...]] = []
    forward = Runner.forward
    monkeypatch.setattr(Runner, "forward", lambda self, inputs, layers: shapes.append(inputs.shape)
                        or forward(self, inputs, layers))
    ps = [params(max_tokens=10), params(max_tokens=3), params(temperature=1.0, seed=5, max_tokens=4)]
    with Engine.load(str(folder), prefix_caching=False, prefill_chunk_size=16) as e:
        a = e.generate(GenerationRequest(prompt_token_ids=PROMPTS[0], sampling=ps[0]))
        first = next(a)  # a is decoding
        shapes.clear()
        steps0 = e.diagnostics().scheduler.num_steps
        b = e.generate(GenerationRequest(prompt_token_ids=PROMPTS[1], sampling=ps[1]))  # 40 tokens: 3 chunks
        c = e.generate(GenerationRequest(prompt_token_ids=PROMPTS[3], sampling=ps[2]))  # 70 tokens: 5 chunks
        got = [collect(s) for s in (a, b, c)]
        steps = e.diagnostics().scheduler.num_steps - steps0
    assert (1, 33) in shapes  # a's decode row, then 16 rows of b's prompt and 16 of c's
    assert len(shapes) <= steps  # one forward per step (or none, on a step with only reading to do)
    for (tokens, lps, _), prompt, p, skip in zip(got, (PROMPTS[0], PROMPTS[1], PROMPTS[3]), ps, (1, 0, 0)):
        want_tokens, want_lps = alone(folder, prompt, p)
        assert tokens == want_tokens[skip:]
        # float32 floor: 7.7 units (tests/tolerance.py) on an AMD EPYC; x4 headroom
        want = [y.logprob for y in want_lps[skip:][:len(lps)]]
        assert_f32_close([x.logprob for x in lps], want, 32, "packed vs alone")
    assert list(first.token_ids) == alone(folder, PROMPTS[0], ps[0])[0][:1]


def test_admission_waits_for_blocks_then_runs(folder: Path) -> None:
    # 8 blocks of 16 tokens; each request needs 4 blocks (40 + 20 tokens): two fit at once, the third waits
    per_block = 2 * 2 * 16 * 2 * 16 * 4
    with Engine.load(str(folder), kv_budget_bytes=8 * per_block, prefix_caching=False) as e:
        streams = [e.generate(GenerationRequest(prompt_token_ids=PROMPTS[1], sampling=params(max_tokens=20)))
                   for _ in range(3)]
        results = [collect(s) for s in streams]
        assert all(r[2].finish_reason == "length" for r in results)
        assert results[0][0] == results[1][0] == results[2][0]
        assert e.kv_stats()["used"] == 0


def test_cancel_frees_blocks_and_others_continue(folder: Path) -> None:
    with Engine.load(str(folder), prefix_caching=False) as e:
        a = e.generate(GenerationRequest(prompt_token_ids=PROMPTS[1], sampling=params(max_tokens=40)))
        b = e.generate(GenerationRequest(prompt_token_ids=PROMPTS[2], sampling=params(max_tokens=8)))
        next(a)
        a.cancel()
        a_events = list(a)
        assert a_events[-1].finish_reason == "cancelled"
        b_tokens, _, b_final = collect(b)
        assert b_final.finish_reason == "length"
        assert e.kv_stats()["used"] == 0
    assert b_tokens == alone(folder, PROMPTS[2], params(max_tokens=8))[0]


def test_many_threads_submit_concurrently(folder: Path) -> None:
    with Engine.load(str(folder)) as e:
        results: dict[int, list[int]] = {}

        def worker(i: int) -> None:
            results[i] = collect(e.generate(GenerationRequest(prompt_token_ids=PROMPTS[i % 6],
                                                              sampling=params(max_tokens=6))))[0]

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert len(results) == 12
        for i in range(6):
            assert results[i] == results[i + 6]
        assert e.kv_stats()["used"] == 0


def test_a_request_that_raises_fails_alone(folder: Path) -> None:
    """A failure inside one request's processing (here its detokenizer) ends that request with "error";
    the others in the same batch finish normally and no blocks leak."""
    with Engine.load(str(folder), prefix_caching=False) as e:
        runner = e.diagnostics().runner
        real = runner.tokenizer.detokenizer
        calls = {"n": 0}

        class Exploding:
            def add_token(self, token: int) -> str:
                raise RuntimeError("detokenizer broke")

            def finalize(self) -> str:
                return ""

        def detokenizer():
            calls["n"] += 1
            return Exploding() if calls["n"] == 2 else real()

        runner.tokenizer.detokenizer = detokenizer
        try:
            streams = [e.generate(GenerationRequest(prompt_token_ids=PROMPTS[i], sampling=params(max_tokens=6)))
                       for i in range(3)]
            results = [collect(s) for s in streams]
        finally:
            runner.tokenizer.detokenizer = real
        assert [r[2].finish_reason for r in results] == ["length", "error", "length"]
        assert "detokenizer broke" in results[1][2].error
        assert e.kv_stats()["used"] == 0


def test_cancelled_waiting_requests_leave_the_queue(folder: Path) -> None:
    """Requests cancelled while queued behind one that waits for KV blocks end at once as "cancelled"."""
    per_block = 2 * 2 * 16 * 2 * 16 * 4
    with Engine.load(str(folder), kv_budget_bytes=4 * per_block, prefix_caching=False) as e:
        first = e.generate(GenerationRequest(prompt_token_ids=PROMPTS[1], sampling=params(max_tokens=20)))
        queued = [e.generate(GenerationRequest(prompt_token_ids=PROMPTS[1], sampling=params(max_tokens=20)))
                  for _ in range(3)]
        next(first)
        for q in queued[1:]:
            q.cancel()
        assert [list(q)[-1].finish_reason for q in queued[1:]] == ["cancelled", "cancelled"]
        assert collect(first)[2].finish_reason == "length"
        assert collect(queued[0])[2].finish_reason == "length"
        assert e.kv_stats()["used"] == 0


def test_prompt_ids_is_what_generate_runs(folder: Path) -> None:
    with Engine.load(str(folder)) as e:
        assert e.prompt_ids(GenerationRequest(prompt_token_ids=[5, 6, 7])) == [5, 6, 7]


def test_a_prefill_chunk_above_the_default_budget_goes_in_one_step(tmp_path: Path) -> None:
    """prefill_chunk_size=1024: the step's token budget holds the whole chunk (it was capped at 512)."""
    folder = random_llama_folder(tmp_path / "long", context=2048)
    prompt = [(7 * i) % 120 + 3 for i in range(1500)]
    with Engine.load(str(folder), prefix_caching=False, prefill_chunk_size=1024) as e:
        assert e.diagnostics().scheduler.token_budget == 1024
        e.diagnostics().scheduler.trace = trace = []
        tokens, _, _ = collect(e.generate(GenerationRequest(prompt_token_ids=prompt, sampling=params(max_tokens=2))))
    assert [p for _, p in trace if p > 0] == [1024, 476]
    with Engine.load(str(folder), prefix_caching=False) as e:
        assert e.diagnostics().scheduler.token_budget == 512
        assert collect(e.generate(GenerationRequest(prompt_token_ids=prompt, sampling=params(max_tokens=2))))[0] \
            == tokens


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=0.7, top_p=0.9, seed=11)],
                         ids=["greedy", "temperature"])
def test_plain_rows_are_sampled_by_the_runner(folder: Path, monkeypatch, sampling: dict) -> None:
    """Requests without bias, penalties or log-probabilities get their tokens from the runner's `packed_sample`
    (where a GPU runner keeps its logits); asking for log-probabilities takes every row through its sampler in the
    plan executor (`backends.phases`). On the MLX runner the tokens are the same, seeded draws included."""
    from mlx_engine.backends.mlx.runner import Runner
    from mlx_engine.backends.phases import PhaseExecutor

    calls = {"runner": 0, "scheduler": 0}
    for cls, name, kind in ((Runner, "packed_sample", "runner"), (Runner, "decode_sample", "runner"),
                            (PhaseExecutor, "_sample", "scheduler")):
        original = getattr(cls, name)

        def counted(self, *args, _original=original, _kind=kind):
            calls[_kind] += 1
            return _original(self, *args)

        monkeypatch.setattr(cls, name, counted)

    def run_all(**extra) -> list[list[int]]:
        with Engine.load(str(folder), prefix_caching=False) as e:
            streams = [e.generate(GenerationRequest(prompt_token_ids=p, sampling=params(
                max_tokens=6, **sampling, **extra))) for p in PROMPTS[:3]]
            return [collect(s)[0] for s in streams]

    by_runner = run_all(logprobs=None)
    assert calls["runner"] >= 5 and calls["scheduler"] == 0
    calls.update(runner=0, scheduler=0)
    by_scheduler = run_all(logprobs=0)
    assert calls["runner"] == 0 and calls["scheduler"] == 3 * 6  # every token through its sampler
    assert by_runner == by_scheduler


@pytest.mark.parametrize("backend", ["mlx", "torch"])
def test_decode_step_timer_leaves_the_cache_as_it_found_it(folder: Path, backend: str) -> None:
    """bench/server.py times B-sequence decode steps on a live engine: its sequences' blocks and prefix hashes
    are gone afterwards, and the next request decodes exactly as before."""
    from mlx_engine.speculative.timing import time_decode_step

    opts: dict = {}
    if backend == "torch":
        from tests.torch_support import require

        require()
        opts = {"backend": "torch", "device": "cpu"}
    req = GenerationRequest(prompt_token_ids=PROMPTS[1], sampling=params(max_tokens=6))
    with Engine.load(str(folder), **opts) as e:
        first, lps, _ = collect(e.generate(req))
        before = e.kv_stats()
        seconds = e.diagnostics().call(lambda: time_decode_step(e.diagnostics().runner, 3, context=20, repeats=2))
        after = e.kv_stats()
        again, lps_again, final = collect(e.generate(req))
    assert 0 < seconds < 60
    for key in ("used", "cached", "free", "num_sequences"):
        assert after[key] == before[key], key
    assert again == first  # (its prompt now comes from the prefix cache: logprobs equal within float noise)
    assert [lp.logprob for lp in lps_again] == pytest.approx([lp.logprob for lp in lps], abs=1e-4)
    assert final.usage.cached_prompt_tokens == 32  # the first request's full blocks (40 tokens, blocks of 16)
