"""The torch backend on CUDA (skipped without a GPU; run on a lent machine by `bench/device_check.sh`): the
Triton kernels compiled for the GPU against their torch references, and batched decode replayed as CUDA
graphs against the same steps launched eagerly.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.support.torch_support import require

torch = require("torch")

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from mlx_engine import Engine, GenerationRequest, SamplingParams  # noqa: E402
from mlx_engine.backends.torch import triton_kernels as tk  # noqa: E402
from tests.support.tiny_models import GOLDEN  # noqa: E402

CUDA = torch.device("cuda")
BUDGET = 1 << 24  # the default is half the free GPU memory: millions of blocks of this tiny model


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
@pytest.mark.parametrize("B, Hq, Hkv, D, lens, partition", [
    (3, 8, 2, 64, [1, 37, 300], None),
    (2, 9, 3, 64, [2000, 700], 512),  # split over partitions (FlashDecoding), GQA of 3
    (5, 4, 4, 128, [16, 17, 64, 5, 129], 32),
])
def test_paged_decode_attention_on_cuda(dtype, tol, B, Hq, Hkv, D, lens, partition):
    g = torch.Generator(device="cpu").manual_seed(B * 100 + D)
    bs = 16
    tables = []
    next_block = 0
    for n in lens:
        blocks = -(-n // bs)
        tables.append(list(range(next_block, next_block + blocks))[::-1])  # not in order
        next_block += blocks
    width = max(map(len, tables))
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=CUDA)
    sl = torch.tensor(lens, dtype=torch.int32, device=CUDA)
    k = torch.randn(next_block * bs, Hkv, D, generator=g).to(CUDA, dtype)
    v = torch.randn(next_block * bs, Hkv, D, generator=g).to(CUDA, dtype)
    q = torch.randn(B, Hq, D, generator=g).to(CUDA, dtype)
    before = tk.launch_counts["paged_decode_attention"]
    out = tk.paged_decode_attention(q, k, v, bt, sl, D**-0.5, bs, partition_size=partition)
    assert tk.launch_counts["paged_decode_attention"] == before + 1  # the kernel, not the fallback
    ref = tk.paged_decode_attention_ref(q.cpu().float(), k.cpu().float(), v.cpu().float(), bt.cpu(), sl.cpu(),
                                        D**-0.5, bs)
    assert out.dtype == dtype
    assert float((out.float().cpu() - ref).abs().max()) <= tol


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.float16, 3e-2), (torch.bfloat16, 2e-1)])
@pytest.mark.parametrize("M, N, K, bits, group", [(1, 96, 256, 4, 64), (7, 200, 576, 4, 32), (64, 130, 512, 8, 128)])
def test_dequant_matmul_on_cuda(dtype, tol, M, N, K, bits, group):
    g = torch.Generator(device="cpu").manual_seed(M + N + K)
    words = torch.randint(-(2**31), 2**31 - 1, (N, K * bits // 32), generator=g, dtype=torch.int64).to(torch.int32)
    scales = (torch.rand(N, K // group, generator=g) * 0.02).to(dtype)
    biases = (torch.rand(N, K // group, generator=g) * 0.1 - 0.05).to(dtype)
    x = torch.randn(M, K, generator=g).to(dtype)
    before = tk.launch_counts["dequant_matmul"]
    y = tk.dequant_matmul(x.to(CUDA), words.to(CUDA), scales.to(CUDA), biases.to(CUDA), bits, group)
    assert tk.launch_counts["dequant_matmul"] == before + 1
    ref = tk._dequant_matmul_ref(x.float(), words, scales.float(), biases.float(), bits, group)
    assert y.shape == (M, N) and y.dtype == dtype
    assert float((y.float().cpu() - ref).abs().max()) <= tol * max(1.0, float(ref.abs().max()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_fused_elementwise_kernels_on_cuda(dtype):
    """rms_norm, rope and silu_mul on the GPU against their torch references (the same ops as before)."""
    from mlx_engine.backends.torch.model import RoPE

    g = torch.Generator(device="cpu").manual_seed(3)
    ulp = {torch.float32: 2e-6, torch.float16: 2 * 2**-10, torch.bfloat16: 2 * 2**-7}[dtype]

    def close(got, want):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert float(((got.float() - want.float()).abs() / want.float().abs().clamp_min(1.0)).max()) <= ulp

    x = (torch.randn(9, 576, generator=g) * 3).to(CUDA, dtype)
    w = (torch.rand(576, generator=g) + 0.5).to(CUDA, dtype)
    counts = dict(tk.launch_counts)
    close(tk.rms_norm(x, w, 1e-5), tk.rms_norm_ref(x, w, 1e-5))
    rope = RoPE(64, 10000.0, None, 8192).to(CUDA)
    cos, sin = rope.angles(torch.tensor([[5, 6, 7], [4000, 4001, 4002]], device=CUDA))
    q = torch.randn(2, 3, 9, 64, generator=g).to(CUDA, dtype).transpose(1, 2)
    close(tk.rope(q, cos, sin), tk.rope_ref(q, cos, sin, 1.0, False))
    gate = (torch.randn(7, 1536, generator=g) * 4).to(CUDA, dtype)
    up = torch.randn(7, 1536, generator=g).to(CUDA, dtype)
    close(tk.silu_mul(gate, up), tk.silu_mul_ref(gate, up))
    assert all(tk.launch_counts[k] == counts.get(k, 0) + 1 for k in ("rms_norm", "rope", "silu_mul"))


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    pytest.importorskip("gguf")
    from tests.support.tiny_models import write_gguf_from_folder

    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_gguf_from_folder(GOLDEN / "llama", path, {"attn_q": "Q4_0", "ffn": "Q4_1"}, default_type="Q8_0")
    return str(path)


PROMPTS = [[3, 17, 42, 99, 7], [(7 * i + 1) % 120 + 3 for i in range(21)], [(5 * i + 2) % 120 + 3 for i in range(40)]]


def decode_together(engine: Engine, n: int = 16) -> tuple[list[list[int]], np.ndarray]:
    streams = [engine.generate(GenerationRequest(prompt_token_ids=p, sampling=SamplingParams(
        temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0))) for p in PROMPTS]
    events = [list(s) for s in streams]
    return ([[t for e in ev for t in e.token_ids] for ev in events],
            np.array([lp.logprob for ev in events for e in ev for lp in e.logprobs]))


@pytest.mark.parametrize("dtype, tol", [("float32", 1e-4), ("float16", 2e-2)])
def test_cuda_graph_decode_equals_eager(tiny_gguf, dtype, tol):
    with Engine.load(tiny_gguf, backend="torch", device="cuda", dtype=dtype, cuda_graphs=False,
                     kv_budget_bytes=BUDGET) as eager:
        assert eager.diagnostics().runner.graphs is None
        want_tokens, want_lp = decode_together(eager)
        want_solo = decode_one(eager)
    with Engine.load(tiny_gguf, backend="torch", device="cuda", dtype=dtype, kv_budget_bytes=BUDGET) as graphed:
        graphs = graphed.diagnostics().runner.graphs
        assert graphs is not None and graphs.capture
        got_tokens, got_lp = decode_together(graphed)
        assert graphs.captures >= 1 and graphs.replays >= 14
        assert all(g.graph is not None for g in graphs.graphs.values())
        got_solo = decode_one(graphed)  # batch 1: another graph
        assert (1, 8) in {k[:2] for k in graphs.graphs}
    assert got_tokens == want_tokens and got_solo == want_solo
    assert float(np.abs(got_lp - want_lp).max()) <= tol


def decode_one(engine: Engine) -> list[int]:
    events = list(engine.generate(GenerationRequest(prompt_token_ids=PROMPTS[1], sampling=SamplingParams(
        temperature=0.0, max_tokens=12, ignore_eos=True))))
    return [t for e in events for t in e.token_ids]


def test_speculative_verification_in_graphs_on_cuda(tiny_gguf):
    """Verification of k + 1 tokens as a graph of k + 1 rows (the draft is the model itself: all accepted)."""
    params = dict(temperature=0.0, max_tokens=20, ignore_eos=True)
    with Engine.load(tiny_gguf, backend="torch", device="cuda", dtype="float32", kv_budget_bytes=BUDGET,
                     draft_model=tiny_gguf) as engine:
        def run(**extra):
            events = list(engine.generate(GenerationRequest(prompt_token_ids=PROMPTS[2], sampling=SamplingParams(
                **params, **extra))))
            return [t for e in events for t in e.token_ids], events[-1]

        plain, _ = run()
        got, final = run(speculative="draft", num_draft_tokens=4)
        keys = {k[0] for k in engine.diagnostics().runner.graphs.graphs}
    assert got == plain and final.stats.acceptance_rate == 1.0
    assert 8 in keys  # 5 verified rows in the bucket of 8


def test_prompt_logprobs_in_graphs_equal_eager_on_cuda(tiny_gguf):
    """Scoring prompts: the 5-token prompt's prefill replays a graph as 5 decode rows, the 40-token one runs
    eagerly; both equal the eager engine's, and its scores."""
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=3)

    def scores(engine: Engine) -> list[list[tuple]]:
        streams = [engine.generate(GenerationRequest(prompt_token_ids=p, sampling=params))
                   for p in (PROMPTS[0], PROMPTS[2])]
        return [[(lp.token_id, lp.logprob, [i for i, _ in lp.top]) for lp in next(iter(s)).prompt_logprobs]
                for s in streams]

    with Engine.load(tiny_gguf, backend="torch", device="cuda", dtype="float32", cuda_graphs=False,
                     kv_budget_bytes=BUDGET) as eager:
        want, score = scores(eager), eager.score(PROMPTS[2])
    with Engine.load(tiny_gguf, backend="torch", device="cuda", dtype="float32", kv_budget_bytes=BUDGET) as graphed:
        got = scores(graphed)
    for g, w in zip(got, want):
        assert [(x[0], x[2]) for x in g] == [(x[0], x[2]) for x in w]  # tokens and top ids
        assert max(abs(a[1] - b[1]) for a, b in zip(g, w)) <= 1e-4
    assert np.abs(np.array([x[1] for x in got[1]]) - score).max() <= 1e-4


def constrained_replies(engine: Engine) -> tuple[list[list[int]], list[int]]:
    """Two requests held to a regex beside a free one, then one speculating under the regex (prompt lookup)."""
    from mlx_engine import ResponseFormat

    fmt = ResponseFormat("regex", pattern=r"[a-f]{2,6}-[0-9]{1,3}")
    streams = [engine.generate(GenerationRequest(prompt_token_ids=p, sampling=SamplingParams(
        temperature=0.0, max_tokens=20, response_format=None if i == 1 else fmt, ignore_eos=i == 1)))
        for i, p in enumerate(PROMPTS)]
    batched = [[t for e in s for t in e.token_ids] for s in streams]
    spec = engine.generate(GenerationRequest(prompt_token_ids=[*PROMPTS[2], *b"abc-12 abc-1"], sampling=SamplingParams(
        temperature=0.0, max_tokens=20, response_format=fmt, speculative="prompt-lookup")))
    return batched, [t for e in spec for t in e.token_ids]


def test_structured_output_in_graphs_equals_eager_on_cuda(tiny_gguf):
    """A response format on CUDA: constrained rows (masked on the host) batched beside a free one in graphed
    steps, and a constrained request speculating; the same tokens as the eager engine, and in the grammar."""
    import re

    with Engine.load(tiny_gguf, backend="torch", device="cuda", dtype="float32", cuda_graphs=False,
                     kv_budget_bytes=BUDGET) as eager:
        want = constrained_replies(eager)
    with Engine.load(tiny_gguf, backend="torch", device="cuda", dtype="float32", kv_budget_bytes=BUDGET) as graphed:
        got = constrained_replies(graphed)
    assert got == want
    for tokens in (got[0][0], got[0][2], got[1]):
        assert re.fullmatch(r"[a-f]{2,6}-[0-9]{1,3}", bytes(tokens).decode())


def test_prefill_chunk_default_is_4096_on_cuda(tiny_gguf):
    with Engine.load(tiny_gguf, backend="torch", device="cuda", kv_budget_bytes=BUDGET) as engine:
        diag = engine.diagnostics()
        assert diag.runner.prefill_chunk_size == 4096 and diag.scheduler.token_budget == 4096


def test_kquant_gguf_packed_on_cuda(tmp_path, monkeypatch):
    """k-quants packed into affine groups (16 and 32, float32 scales) run by dequant_matmul on the GPU: the
    logits of the same packed model on the CPU (the kernels' torch references), float32 on both."""
    from mlx_engine.backends.torch import runner as torch_runner
    from mlx_engine.backends.torch.weights import QuantizedWeight
    from tests.support.tiny_models import kquant_llama_gguf

    path, _, _ = kquant_llama_gguf(tmp_path)
    ids = [3, 17, 42, 99, 7, 64, 120, 5, 9]
    with Engine.load(str(path), backend="torch", device="cuda", dtype="float32", kv_budget_bytes=BUDGET) as gpu:
        o_proj = gpu.diagnostics().runner.model.layers[0].self_attn.o_proj
        assert isinstance(o_proj.weight, QuantizedWeight)  # Q6_K, group 16
        a = gpu.forward_logits(ids)
    monkeypatch.setattr(torch_runner, "use_kernels", lambda device: True)  # packed on the CPU too
    with Engine.load(str(path), backend="torch", device="cpu") as cpu:
        b = cpu.forward_logits(ids)
    assert float(np.abs(a - b).max()) <= 1e-4 * float(np.abs(b).max())


def test_sampling_on_the_device(tiny_gguf):
    """Plain rows are drawn on the GPU: a seeded temperature request repeats; greedy rows equal the host's."""
    def run(engine, **extra):
        streams = [engine.generate(GenerationRequest(prompt_token_ids=p, sampling=SamplingParams(
            max_tokens=10, ignore_eos=True, **extra))) for p in PROMPTS]
        return [[t for e in s for t in e.token_ids] for s in streams]

    with Engine.load(tiny_gguf, backend="torch", device="cuda", dtype="float32", kv_budget_bytes=BUDGET) as engine:
        seeded = run(engine, temperature=0.8, top_p=0.95, seed=3)
        assert seeded == run(engine, temperature=0.8, top_p=0.95, seed=3)
        assert run(engine, temperature=0.0) == run(engine, temperature=0.0, logprobs=0)  # device vs host argmax
