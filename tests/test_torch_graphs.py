"""The torch backend's decode step as CUDA graphs (`backends/torch/graphs.py`), on the CPU: the graph's
static-buffer step run eagerly (`capture=False`) must give the tokens and log-probabilities of the eager step,
with its padding rows and table columns in the pool's scratch block, and its keys dropped when the pool grows.
The capture itself needs CUDA: `bench/device_check.sh` compares graphs on and off on a lent GPU.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.support.torch_support import require

torch = require("torch")

from mlx_engine import Engine, GenerationRequest, SamplingParams  # noqa: E402
from mlx_engine.api import RooflineError  # noqa: E402
from mlx_engine.backends.torch.graphs import DecodeGraphs, batch_bucket, width_bucket  # noqa: E402
from mlx_engine.backends.torch.kv import DecodeStep  # noqa: E402
from mlx_engine.speculative.timing import time_graph_forward  # noqa: E402
from tests.support.tiny_models import GOLDEN  # noqa: E402

PROMPTS = [[3, 17, 42, 99, 7], [(7 * i + 1) % 120 + 3 for i in range(21)], [(5 * i + 2) % 120 + 3 for i in range(40)]]


@pytest.fixture(scope="module")
def engine():
    with Engine.load(str(GOLDEN / "llama"), backend="torch", device="cpu", prefix_caching=False) as e:
        e.diagnostics().cache.storage.use_kernel = True  # decode reads KV through block tables, as on CUDA
        yield e


def batch(engine: Engine, n: int = 12) -> tuple[list[list[int]], list[list[float]]]:
    """The three prompts decoded together (greedy): tokens and their log-probabilities."""
    streams = [engine.generate(GenerationRequest(prompt_token_ids=p, sampling=SamplingParams(
        temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0))) for p in PROMPTS]
    events = [list(s) for s in streams]
    return ([[t for e in ev for t in e.token_ids] for ev in events],
            [[lp.logprob for e in ev for lp in e.logprobs] for ev in events])


def test_graph_steps_equal_eager_steps():
    """On a fresh pool, graphs first: the sequences hold block 0 and its neighbours, where a padding row
    that missed the scratch block would write."""
    with Engine.load(str(GOLDEN / "llama"), backend="torch", device="cpu", prefix_caching=False) as engine:
        runner = engine.diagnostics().runner
        assert runner.graphs is None  # on the CPU graphs are off unless asked for
        runner.cache.storage.use_kernel = True
        graphs = runner.graphs = DecodeGraphs(runner.model, runner.cache.storage, capture=False)
        got_tokens, got_logprobs = batch(engine)
        runner.graphs = None
        tokens, logprobs = batch(engine)
    assert got_tokens == tokens
    np.testing.assert_allclose(np.concatenate(got_logprobs), np.concatenate(logprobs), rtol=0, atol=1e-5)
    assert graphs.replays >= 10  # the batched decode steps went through the graph path
    # 3 sequences pad to the bucket of 4; tables of <= 4 blocks of 16 (40 + 12 tokens) to the width of 8
    assert {k[:2] for k in graphs.graphs} <= {(4, 8), (2, 8), (1, 8)} and (4, 8) in {k[:2] for k in graphs.graphs}
    assert graphs.captures == len(graphs.graphs)


def test_padding_rows_and_columns_go_to_the_scratch_block(engine):
    storage = engine.diagnostics().cache.storage
    graphs = DecodeGraphs(engine.diagnostics().runner.model, storage, capture=False)
    scratch, bs = storage.scratch_block, storage.block_size
    # on the CPU the pools map the whole context at once (kv._zero_pages); the scratch block follows the capacity
    assert scratch == storage.capacity < storage.num_blocks and storage.k[0].shape[0] == (storage.num_blocks + 1) * bs
    step = DecodeStep(storage, positions=[4, 20, 39], new_slots=[4, 36, 87], tables=[[0], [1, 2], [3, 4, 5]])
    buf = graphs.host_inputs(np.array([11, 12, 13]), step, bucket=4, width=8)
    assert buf[:4].tolist() == [11, 12, 13, 0]  # ids; the padding row decodes token 0
    assert buf[4:8].tolist() == [4, 20, 39, 0]  # positions
    assert buf[8:12].tolist() == [4, 36, 87, scratch * bs]  # new slots: the padding row's in the scratch block
    tables = buf[12:].reshape(4, 8)
    assert tables.tolist() == [[0] + [scratch] * 7, [1, 2] + [scratch] * 6, [3, 4, 5] + [scratch] * 5, [scratch] * 8]


def test_buckets():
    assert [batch_bucket(b) for b in (1, 2, 3, 5, 9, 13, 33, 64, 65, 256)] == [1, 2, 4, 8, 12, 16, 48, 64, 96, 256]
    assert batch_bucket(257) is None
    assert [width_bucket(n) for n in (1, 8, 9, 33, 512)] == [8, 8, 16, 64, 512]


def test_graphs_over_an_old_pool_are_dropped_when_it_grows():
    with Engine.load(str(GOLDEN / "llama"), backend="torch", device="cpu", prefix_caching=False,
                     kv_budget_bytes=1 << 22) as engine:
        runner = engine.diagnostics().runner
        storage = runner.cache.storage
        storage.use_kernel = True
        tokens, _ = batch(engine, 4)
        graphs = runner.graphs = DecodeGraphs(runner.model, storage, capture=False)
        batch(engine, 4)
        before = storage.capacity
        assert {k[2] for k in graphs.graphs} == {before} and storage.num_blocks >= 2 * before
        k0 = storage.k[0]
        storage.ensure_capacity(before + 1)  # the capacity doubles (the scratch block moves): the old graphs must go
        assert storage.capacity == 2 * before and storage.k[0] is k0  # a CPU pool maps the whole context already
        got, _ = batch(engine, 4)
        assert got == tokens
        assert {k[2] for k in graphs.graphs} == {2 * before}


def test_cuda_graphs_option_errors():
    with pytest.raises(RooflineError, match="cuda_graphs=True needs device='cuda'"):
        Engine.load(str(GOLDEN / "llama"), backend="torch", device="cpu", cuda_graphs=True)
    with pytest.raises(RooflineError, match="cuda_graphs needs backend='torch'"):
        Engine.load(str(GOLDEN / "llama"), backend="mlx", cuda_graphs=False)
    with pytest.raises(RooflineError, match="cuda_graphs='yes': expected True, False or None"):
        Engine.load(str(GOLDEN / "llama"), backend="torch", device="cpu", cuda_graphs="yes")


def test_a_gpus_default_kv_budget_is_capped_at_256_contexts():
    from mlx_engine.backends.torch.kv import gpu_default_budget

    # SmolLM2 on an H200: 8192-token context, 16-token blocks of 30 layers x 3 heads x 64 x 2 (K, V) x 2 bytes
    per_block = 30 * 16 * 3 * 64 * 2 * 2
    assert gpu_default_budget(140 << 30, 8192, 16, per_block) == 256 * 512 * per_block  # 48 GiB, not 70
    assert gpu_default_budget(8 << 30, 8192, 16, per_block) == 4 << 30  # a small GPU: half its free memory
    assert gpu_default_budget(140 << 30, 512, 16, 8192) == 256 * 32 * 8192  # a tiny model: 8192 blocks


def test_a_failed_capture_turns_graphs_off_and_the_step_runs_eagerly(monkeypatch):
    with Engine.load(str(GOLDEN / "llama"), backend="torch", device="cpu", prefix_caching=False) as engine:
        runner = engine.diagnostics().runner
        runner.cache.storage.use_kernel = True
        tokens, _ = batch(engine, 6)
        graphs = runner.graphs = DecodeGraphs(runner.model, runner.cache.storage, capture=False)

        def broken(*args):
            raise RuntimeError("operation not permitted when stream is capturing")

        monkeypatch.setattr(graphs, "_step", broken)
        with pytest.warns(RuntimeWarning, match="CUDA graphs are off for this model: capturing the decode step "
                                                "failed \\(operation not permitted"):
            got, _ = batch(engine, 6)
        assert got == tokens
        assert runner.graphs is None and runner.graphs_error.startswith("RuntimeError: operation not permitted")


def test_speculative_verification_through_graphs_equals_plain():
    """A verification of k + 1 tokens replays the graph of k + 1 decode rows sharing the sequence's block
    table (row i attends to positions <= offset + i): greedy output equals plain decoding. The draft is the
    model itself, so every draft is accepted and each verification is 5 rows."""
    prompt = [3, 17, 42, 99, 7, 64, 120, 5] * 3
    params = dict(temperature=0.0, max_tokens=20, ignore_eos=True)
    with Engine.load(str(GOLDEN / "llama"), backend="torch", device="cpu", prefix_caching=False,
                     draft_model=str(GOLDEN / "llama")) as engine:
        runner = engine.diagnostics().runner
        runner.cache.storage.use_kernel = True

        def run(**extra):
            events = list(engine.generate(GenerationRequest(prompt_token_ids=prompt, sampling=SamplingParams(
                **params, **extra))))
            return [t for e in events for t in e.token_ids], events[-1]

        plain, _ = run()
        graphs = runner.graphs = DecodeGraphs(runner.model, runner.cache.storage, capture=False)
        got, final = run(speculative="draft", num_draft_tokens=4)
    assert got == plain
    assert final.stats.acceptance_rate == 1.0 and final.stats.target_forwards <= 6
    assert 8 in {k[0] for k in graphs.graphs}  # 5 rows in the bucket of 8
    assert graphs.replays >= final.stats.target_forwards - 1  # all but the prompt's forward


def test_time_graph_forward_touches_only_the_scratch_block():
    with Engine.load(str(GOLDEN / "llama"), backend="torch", device="cpu") as engine:
        runner = engine.diagnostics().runner
        storage = runner.cache.storage
        storage.use_kernel = True
        run_tokens = list(engine.generate(GenerationRequest(prompt_token_ids=[3, 4, 5, 6, 7], sampling=SamplingParams(
            temperature=0.0, max_tokens=4, ignore_eos=True))))
        assert run_tokens[-1].finish_reason == "length"
        runner.graphs = DecodeGraphs(runner.model, storage, capture=False)
        bs, scratch = storage.block_size, storage.scratch_block
        before = [t[:scratch * bs].clone() for t in storage.k + storage.v]
        seconds = time_graph_forward(runner, 5, 40, 1)
        assert 0 < seconds < 10
        assert all(torch.equal(a, t[:scratch * bs]) for a, t in zip(before, storage.k + storage.v))
        assert (8, 8, storage.capacity) in runner.graphs.graphs  # 5 rows pad to 8; 45 tokens in 3 blocks: width 8
        from mlx_engine.speculative.cost import cost_curve_key
        from mlx_engine.speculative.timing import time_forward

        assert time_forward(runner, 5, 40, 1) > 0  # through the graph path
        assert cost_curve_key(runner).split("|")[1] == "torch-cpu-cuda-graphs"


def test_prefill_chunk_default_is_256_on_the_cpu(engine):
    """The torch runner's CPU chunk (runner.CPU_PREFILL_CHUNK); the step's token budget stays the scheduler's 512."""
    assert engine.diagnostics().runner.prefill_chunk_size == 256 and engine.diagnostics().scheduler.token_budget == 512


def test_greedy_tokens_taken_on_the_device_equal_the_samplers():
    """Plain greedy rows: the torch runner's device sampling (through the graph path too) gives the tokens of
    the shared sampler."""
    from mlx_engine.backends.torch import runner as torch_runner

    def run_all(engine, logprobs):
        streams = [engine.generate(GenerationRequest(prompt_token_ids=p, sampling=SamplingParams(
            temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=logprobs))) for p in PROMPTS]
        return [[t for e in s for t in e.token_ids] for s in streams]

    taken = []
    original = torch_runner.sample_rows
    with Engine.load(str(GOLDEN / "llama"), backend="torch", device="cpu", prefix_caching=False) as engine:
        runner = engine.diagnostics().runner
        runner.cache.storage.use_kernel = True
        with_sampler = run_all(engine, 0)
        torch_runner.sample_rows = lambda logits, samplers: taken.append(len(samplers)) or original(logits, samplers)
        try:
            on_device = run_all(engine, None)
            runner.graphs = DecodeGraphs(runner.model, runner.cache.storage, capture=False)
            through_graphs = run_all(engine, None)
        finally:
            torch_runner.sample_rows = original
            runner.graphs = None
    assert on_device == through_graphs == with_sampler
    assert 3 in taken  # batched decode steps of the three


@pytest.mark.parametrize("params", [dict(temperature=0.7), dict(temperature=0.9, top_p=0.9, min_p=0.05),
                                    dict(temperature=1.3, top_k=4)], ids=["t0.7", "top-p+min-p", "top-k"])
def test_device_draws_follow_the_samplers_distribution(params):
    """`backends.torch.sampling`: 40,000 draws of one row match the distribution the shared sampler draws
    from (`Sampler.probs`, chi-square at 99.9%), and never a filtered token; with the filters dropped they
    do not match."""
    import mlx.core as mx

    from mlx_engine.api import SamplingParams as SP
    from mlx_engine.backends.torch.sampling import filtered, gumbel_draw, sample_rows
    from mlx_engine.sampling import Sampler

    row = np.array([0.0, 0.5, 1.0, 1.5, 2.0, -1.0, 3.0, -3.0], dtype=np.float32)
    sampler = Sampler(SP(seed=5, **params), 8)
    probs = np.array(sampler.probs(mx.array(row[None])))[0].astype(np.float64)
    n = 40_000
    z = torch.from_numpy(row)[None].expand(n, 8) / sampler.temperature
    uniform = torch.rand(n, 8, generator=torch.Generator().manual_seed(1))
    counts = np.bincount(gumbel_draw(filtered(z, sampler.top_k, sampler.top_p, sampler.min_p), uniform).numpy(),
                         minlength=8)
    assert counts[probs == 0].sum() == 0
    keep = probs > 0
    expected = n * probs[keep]
    chi2 = float(((counts[keep] - expected) ** 2 / expected).sum())
    assert chi2 < {3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}[int(keep.sum()) - 1], chi2
    if keep.sum() < 8:  # a filter that matters: without it the draws fall outside the kept set
        assert np.bincount(gumbel_draw(z, uniform).numpy(), minlength=8)[~keep].sum() > 0
    # the per-request generator: seeded, reproducible, one row at a time through `sample_rows`
    a = [int(sample_rows(torch.from_numpy(row)[None], [sampler])[0]) for _ in range(20)]
    again = Sampler(SP(seed=5, **params), 8)
    assert a == [int(sample_rows(torch.from_numpy(row)[None], [again])[0]) for _ in range(20)]
    assert len(set(a)) > 1


@pytest.mark.parametrize("mapped", [True, False])
def test_pools_keep_their_slots_as_the_capacity_grows(mapped):
    """Both pool kinds: zeros where nothing was written, each written slot kept through the capacity's doubling
    (torch.zeros pools copy the used blocks into the grown ones; mapped pools hold the whole context from the start)."""
    from mlx_engine.backends.torch.kv import TorchKVStorage

    st = TorchKVStorage(2, 64, 16, 3, 8, torch.float16, torch.device("cpu"), mapped=mapped)
    assert st.capacity == 8 and st.nbytes == 2 * 2 * 9 * 16 * 3 * 8 * 2  # what capacity + 1 blocks address
    assert st.k[0].shape[0] == (65 if mapped else 9) * 16
    slots = torch.tensor([0, 17, 127])
    k, v = torch.randn(3, 3, 8), torch.randn(3, 3, 8)
    st.write(1, slots, k, v)
    st.ensure_capacity(9)
    assert st.capacity == 16 and st.k[1].shape[0] == (65 if mapped else 17) * 16
    assert torch.equal(st.k[1][slots], k.half()) and torch.equal(st.v[1][slots], v.half())
    assert not st.k[1][1:17].any() and not st.v[0].any()


def test_mapped_pools_are_host_memory():
    from mlx_engine.backends.torch.kv import TorchKVStorage

    with pytest.raises(RooflineError, match="mapped KV pools are host memory; this storage is on meta"):
        TorchKVStorage(1, 8, 16, 1, 8, torch.float16, torch.device("meta"), mapped=True)
