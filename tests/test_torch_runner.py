"""The PyTorch backend on the CPU: the same logits and greedy tokens as the MLX engine and the transformers
goldens, batched decode, prefix caching, speculative decoding through the shared code, and clear errors.

The CUDA paths (packed quantized weights through `triton_kernels.dequant_matmul`, decode through
`triton_kernels.paged_decode_attention`) run here too, on a tiny GGUF through the kernels' torch references.
"""

from __future__ import annotations

import json
import shutil
import sys

import numpy as np
import pytest

from tests.support.torch_support import require

torch = require("torch")

from mlx_engine import Engine, GenerationRequest, SamplingParams  # noqa: E402
from mlx_engine.api import RequestError, RooflineError  # noqa: E402
from mlx_engine.backends.torch.runner import TORCH_MODEL_TYPES  # noqa: E402
from tests.support.tiny_models import GOLDEN, parity_goldens  # noqa: E402
from tests.support.tolerance import assert_f32_close  # noqa: E402

# the goldens of the families the torch backend runs (issue 23's others run on MLX only)
TINY = sorted(p.name for p in parity_goldens()
              if json.loads((p / "config.json").read_text())["model_type"] in TORCH_MODEL_TYPES)
LOGITS_TOL = 1e-4  # float32 torch vs transformers' float32 goldens (max |logit| ~5.3): measured <= 4.3e-6, 23x
# SmolLM2 in units of eps32 x max |logit| (tests/support/tolerance.py). Torch vs MLX over the whole vocabulary (max
# |logit| 36.8): 18.7 on an AMD EPYC (8.2e-5), 23.8 on an Intel Xeon with AVX-512 (1.04e-4), 20.7 against MLX's
# quantized matmuls (ROOFLINE_CPU_FP32_WEIGHTS=off); each engine alone is 15.4 (torch) and 18.7 (MLX) from a float64 run
# of the same weights (tests/golden/measure_float_floor.py), so up to ~34 apart is still rounding. HEADROOM x the
# worst seen: 96. The top 512 logits against transformers' float64 (max 25.3): 11.6 here (3.5e-5), x4: 48.
SMOLLM2_VS_MLX_UNITS = 96
SMOLLM2_VS_FLOAT64_UNITS = 48
PROMPT = [3, 17, 42, 99, 7, 64, 120, 5] * 3  # 24 tokens: one full block of 16


def run(engine: Engine, ids: list[int], max_tokens: int = 16, **sampling) -> tuple[list[int], object]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **sampling)
    events = list(engine.generate(GenerationRequest(prompt_token_ids=list(ids), sampling=params)))
    assert events[-1].finish_reason == "length", events[-1]
    return [t for e in events for t in e.token_ids], events[-1]


# --- the golden tiny models ------------------------------------------------------------------------


@pytest.fixture(scope="module", params=TINY)
def tiny(request):
    folder = GOLDEN / request.param
    with Engine.load(str(folder), backend="torch", device="cpu") as engine:
        yield folder.name, engine, dict(np.load(folder / "golden.npz"))


def test_tiny_logits_and_greedy_match_transformers(tiny):
    name, engine, gold = tiny
    assert (engine.info.backend, engine.info.device, engine.info.dtype) == ("torch", "cpu", "float32")
    ids = gold["input_ids"].tolist()
    logits = engine.forward_logits(ids)
    assert logits.shape == gold["logits"].shape and logits.dtype == np.float32
    maxdiff = float(np.abs(logits - gold["logits"]).max())
    assert maxdiff <= LOGITS_TOL, f"{name}: maxdiff {maxdiff:.3e}"
    expected = gold["greedy_tokens"].tolist()
    tokens, _ = run(engine, ids, len(expected))
    assert tokens == expected, name


@pytest.fixture(scope="module")
def llama():
    with Engine.load(str(GOLDEN / "llama"), backend="torch", device="cpu", draft_model=str(GOLDEN / "llama")) as e:
        yield e


@pytest.fixture(scope="module")
def mlx_llama():
    with Engine.load(str(GOLDEN / "llama"), backend="mlx") as e:
        yield e


def test_hidden_states_match_mlx(llama, mlx_llama):
    ids = PROMPT[:10]
    hs, ref = llama.hidden_states(ids), mlx_llama.hidden_states(ids)
    assert len(hs) == len(ref) == 3  # the embedding output and 2 layers
    for i, (a, b) in enumerate(zip(hs, ref)):
        assert a.shape == b.shape == (len(ids), 64) and a.dtype == np.float32
        assert float(np.abs(a - b).max()) <= LOGITS_TOL, f"hidden state {i}"


def test_score_matches_mlx(llama, mlx_llama):
    assert np.abs(llama.score(PROMPT) - mlx_llama.score(PROMPT)).max() <= LOGITS_TOL
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=4)
    got, want = (next(iter(e.generate(GenerationRequest(prompt_token_ids=PROMPT, sampling=params)))).prompt_logprobs
                 for e in (llama, mlx_llama))
    assert len(got) == len(PROMPT) - 1
    assert [[i for i, _ in lp.top] for lp in got] == [[i for i, _ in lp.top] for lp in want]
    assert max(abs(a - b) for g, w in zip(got, want) for (_, a), (_, b) in zip(g.top, w.top)) <= LOGITS_TOL


def test_batched_decode_of_different_lengths_equals_solo_runs(llama):
    a, b = PROMPT[:13], PROMPT[5:] + [9, 8]
    solo = [run(llama, a)[0], run(llama, b)[0]]
    scheduler = llama.diagnostics().scheduler
    scheduler.trace = []
    try:
        streams = [llama.generate(GenerationRequest(prompt_token_ids=ids, sampling=SamplingParams(
            temperature=0.0, max_tokens=16, ignore_eos=True))) for ids in (a, b)]
        got = [[t for e in s for t in e.token_ids] for s in streams]
        assert any(rows == 2 for rows, _ in scheduler.trace), scheduler.trace  # both decoded in one forward
    finally:
        scheduler.trace = None
    assert got == solo


def test_a_step_packs_decode_rows_and_prefill_chunks_into_one_forward(monkeypatch):
    """While one request decodes, two new prompts join: their step is one forward over (1, 1 + 16 + 16) rows
    (prefill chunks of 16), each row roped at its own position, and every request gets its solo tokens."""
    from mlx_engine.backends.torch.runner import TorchRunner

    prompts = [PROMPT[:9], PROMPT + [11, 12, 13], [(5 * i + 2) % 120 + 3 for i in range(40)]]
    with Engine.load(str(GOLDEN / "llama"), backend="torch", device="cpu", prefill_chunk_size=16,
                     prefix_caching=False) as e:
        solo = [run(e, p, n)[0] for p, n in zip(prompts, (12, 3, 4))]
        shapes: list[tuple[int, ...]] = []
        forward = TorchRunner.forward
        monkeypatch.setattr(TorchRunner, "forward", lambda self, inputs, layers: shapes.append(
            tuple(np.shape(inputs))) or forward(self, inputs, layers))
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (12, 3, 4)]
        a = e.generate(GenerationRequest(prompt_token_ids=prompts[0], sampling=params[0]))
        first = next(a)
        b, c = (e.generate(GenerationRequest(prompt_token_ids=p, sampling=q)) for p, q in zip(prompts[1:], params[1:]))
        got = [list(first.token_ids) + [t for ev in a for t in ev.token_ids]]
        got += [[t for ev in s for t in ev.token_ids] for s in (b, c)]
    assert (1, 33) in shapes, shapes
    assert got == solo


def test_prefix_cache_hit_and_copy_on_write(llama):
    first, _ = run(llama, PROMPT)
    again, final2 = run(llama, PROMPT)
    assert final2.usage.cached_prompt_tokens == 16 and again == first
    other = PROMPT[:20] + [1, 2]  # shares the cached block, diverges inside the next one
    tokens, final3 = run(llama, other)
    assert final3.usage.cached_prompt_tokens == 16
    with Engine.load(str(GOLDEN / "llama"), backend="torch", device="cpu", prefix_caching=False) as fresh:
        assert tokens == run(fresh, other)[0]
    assert llama.kv_stats()["kind"] == "paged"


def test_peak_memory_is_the_process_peak_on_cpu(llama):
    """A request's peak is the process's peak RSS since the engine went busy (VmHWM, reset then): more than the
    weights, and not a spike of 400 MB freed before it."""
    from mlx_engine.backends.torch.runner import peak_rss

    spike = np.ones(100_000_000, dtype=np.float32)  # 400 MB, touched
    del spike
    before = peak_rss()
    _, final = run(llama, PROMPT)
    assert llama.info.weight_bytes < final.stats.peak_memory_bytes <= before - 300_000_000


@pytest.mark.parametrize("mode", ["prompt-lookup", "self", "draft", "auto"])
def test_speculative_greedy_equals_plain(llama, mode):
    plain, _ = run(llama, PROMPT, 20)
    tokens, final = run(llama, PROMPT, 20, speculative=mode)
    assert tokens == plain
    if mode == "draft":  # the draft is the model itself: every draft token is accepted
        assert final.stats.acceptance_rate == 1.0


# --- an int8 draft (draft_bits=8): the CPU's int8 matmul ---------------------------------------------


def _int8_reference(w: "torch.Tensor", row: "torch.Tensor", reduce_range: bool) -> "torch.Tensor":
    """What the dynamic-quantized matmul computes for one row: weights rounded to int8 per output row
    (scale max|w| / 127), the row to unsigned 8 (or 7) bits with a zero point over [min(x, 0), max(x, 0)]."""
    sw = (w.abs().amax(1) / 127).clamp_min(1e-12)
    wq = torch.round(w / sw[:, None]).clamp(-128, 127)
    lo, hi = min(row.min().item(), 0.0), max(row.max().item(), 0.0)
    levels = 127 if reduce_range else 255
    sx = (hi - lo) / levels
    zp = round(-lo / sx)
    xq = torch.clamp(torch.round(row / sx) + zp, 0, levels)
    return ((xq - zp) * sx) @ (wq * sw[:, None]).T


def test_int8_weight_rows_through_the_int8_matmul_and_a_prefill_through_the_dequantized_weight():
    from mlx_engine.backends.torch.draft_int8 import INT8_MAX_ROW_CALLS, Int8Weight

    g = torch.Generator().manual_seed(0)
    assert INT8_MAX_ROW_CALLS == 32
    w, x = torch.randn(96, 64, generator=g), torch.randn(3, 11, 64, generator=g)
    iw = Int8Weight(w)
    scale = (w.abs().amax(1) / 127)[:, None]
    assert torch.equal(iw.dequantized(), torch.round(w / scale) * scale)
    # a prefill (33 rows > INT8_MAX_ROW_CALLS): float32 over the dequantized weight, exactly
    assert torch.equal(iw.matmul(x), torch.nn.functional.linear(x, iw.dequantized()))
    rows = x.reshape(33, 64)
    for i in range(6):  # one row: the int8 matmul, as its reference computes it
        row = rows[i : i + 1]
        got, exact = iw.matmul(row), row @ w.T
        ref = _int8_reference(w, row, iw.reduce_range)
        assert (got - ref).abs().max() <= 1e-5 * exact.abs().max()
        assert 1e-4 * exact.abs().max() < (got - exact).abs().max() < 3e-2 * exact.abs().max()  # int8: small
    few = rows[:INT8_MAX_ROW_CALLS]  # a catch-up: each row its own call, the same numbers as alone
    assert torch.equal(iw.matmul(few[None]), torch.cat([iw.matmul(r[None]) for r in few])[None])
    assert torch.equal(iw.rows(torch.tensor([[3, 7]])), iw.dequantized()[[3, 7]][None])


def test_fused_int8_splits_one_int8_matmul_into_each_projection():
    from mlx_engine.backends.torch.draft_int8 import FusedInt8, Int8Weight
    from mlx_engine.backends.torch.model import Linear

    g = torch.Generator().manual_seed(1)
    ws = [torch.randn(n, 64, generator=g) for n in (32, 16, 16)]
    bias = torch.randn(16, generator=g)
    fused = FusedInt8((Linear(ws[0]), Linear(ws[1], bias), Linear(ws[2])))
    for x in (torch.randn(1, 1, 64, generator=g), torch.randn(1, 9, 64, generator=g)):
        for got, w, b in zip(fused(x), ws, (None, bias, None)):
            alone = Int8Weight(w).matmul(x) + (b if b is not None else 0)  # its rows' scales are the same
            assert got.shape == (*x.shape[:-1], w.shape[0]) and torch.allclose(got, alone, rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def llama_int8_draft():
    folder = str(GOLDEN / "llama")
    with Engine.load(folder, backend="torch", device="cpu", draft_model=folder, draft_bits=8) as e:
        yield e


def test_int8_draft_greedy_equals_plain(llama_int8_draft, llama):
    from mlx_engine.backends.torch.draft_int8 import FusedInt8, Int8Weight

    draft = llama_int8_draft.diagnostics().runner.draft
    for b in draft.model.layers:
        assert isinstance(b.self_attn.qkv, FusedInt8) and isinstance(b.mlp.gate_up, FusedInt8)
        assert isinstance(b.self_attn.o_proj.weight, Int8Weight) and isinstance(b.mlp.down_proj.weight, Int8Weight)
        assert b.self_attn.q_proj is None and b.mlp.up_proj is None  # the float projections are gone
    assert isinstance(draft.model.lm_head.weight, Int8Weight) and draft.info.quantization.endswith("int8 draft")
    assert isinstance(draft.model.embed_tokens.weight, Int8Weight)  # untied here: its own int8 embedding
    float_bytes = llama.diagnostics().runner.draft.info.weight_bytes
    assert 0.25 * float_bytes < draft.info.weight_bytes < 0.6 * float_bytes  # int8 twice (packed, plain)
    plain, _ = run(llama, PROMPT, 20)
    tokens, final = run(llama_int8_draft, PROMPT, 20, speculative="draft")
    assert tokens == plain
    assert final.stats.target_forwards < 20  # the draft's tokens were accepted, some at least


# --- SmolLM2 (the embedded Q4_1 GGUF) against the MLX engine -----------------------------------------


@pytest.fixture(scope="module")
def smollm2():
    gold = json.loads((GOLDEN / "smollm2_gguf.json").read_text())
    prompts = [p["prompt_ids"][-20:] for p in gold["prompts"][:2]]  # short: two suffixes of chat prompts
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ROOFLINE_CPU_FP32_WEIGHTS", "on")  # what SMOLLM2_VS_MLX_UNITS was measured with (off: 20.7)
        with Engine.load(None, backend="mlx") as mlx_engine:
            ref = {"tokens": [run(mlx_engine, p)[0] for p in prompts],
                   "logits": mlx_engine.forward_logits(prompts[0])}
        # the float32 twin of the packed CPU path (tests/test_torch_cpu_packed.py tests the packed one)
        mp.setenv("ROOFLINE_TORCH_CPU_PACKED", "0")
        engine = Engine.load(None, backend="torch", device="cpu")
    with engine:
        yield engine, prompts, ref


def test_smollm2_logits(smollm2):
    engine, prompts, ref = smollm2
    gold = np.load(GOLDEN / "smollm2_gguf_logits.npz")
    last = engine.forward_logits(gold["prompt_ids"].tolist())[-1].astype(np.float64)
    top = gold["top_ids"]
    assert_f32_close(last[top], gold["top_logits_f64"], SMOLLM2_VS_FLOAT64_UNITS, "top logits vs transformers float64")
    assert_f32_close(engine.forward_logits(prompts[0]), ref["logits"], SMOLLM2_VS_MLX_UNITS, "vs MLX")


def test_smollm2_greedy_matches_mlx_batched_and_cached(smollm2):
    engine, prompts, ref = smollm2
    streams = [engine.generate(GenerationRequest(prompt_token_ids=p, sampling=SamplingParams(
        temperature=0.0, max_tokens=16, ignore_eos=True))) for p in prompts]
    events = [list(s) for s in streams]
    assert [[t for e in ev for t in e.token_ids] for ev in events] == ref["tokens"]
    tokens, final = run(engine, prompts[0])  # the prompt's first block is in the prefix cache now
    assert final.usage.cached_prompt_tokens == 16 and tokens == ref["tokens"][0]
    tokens, _ = run(engine, prompts[1], speculative="prompt-lookup")
    assert tokens == ref["tokens"][1]


def test_smollm2_int8_draft_greedy_matches_mlx(smollm2):
    """SmolLM2 drafting for itself at 8 bits: MLX's greedy tokens, and most drafts accepted."""
    from mlx_engine.loading import resolve

    _, prompts, ref = smollm2
    with Engine.load(None, backend="torch", device="cpu", draft_model=str(resolve(None)[0]), draft_bits=8) as e:
        tokens, final = run(e, prompts[0], speculative="draft", num_draft_tokens=4)
    assert tokens == ref["tokens"][0]
    # measured: every draft accepted, 16 tokens in 4 target forwards (prefill included)
    assert final.stats.acceptance_rate >= 0.75 and final.stats.target_forwards <= 8


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """The golden llama as a GGUF with Q4_0, Q4_1 and Q8_0 tensors (the embedding too), and the MLX
    engine's logits and greedy tokens on it."""
    pytest.importorskip("gguf")
    from tests.support.tiny_models import write_gguf_from_folder

    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_gguf_from_folder(GOLDEN / "llama", path, {"attn_q": "Q4_0", "ffn": "Q4_1"}, default_type="Q8_0")
    with Engine.load(str(path), backend="mlx") as mlx_engine:
        ref = {"logits": mlx_engine.forward_logits(PROMPT), "tokens": [run(mlx_engine, p, 8)[0] for p in
                                                                       (PROMPT, PROMPT[3:14])]}
    return str(path), ref


@pytest.mark.parametrize("kernels", [False, True], ids=["dequantized", "packed"])
def test_quantized_gguf_matches_mlx(tiny_gguf, kernels, monkeypatch):
    """Dequantized at load (the CPU's portable path, ROOFLINE_TORCH_CPU_PACKED=0), and packed (what CUDA runs:
    `dequant_matmul` on the packed words, `paged_decode_attention` for decode, here through the kernels' torch
    references). The packed CPU path: tests/test_torch_cpu_packed.py."""
    from mlx_engine.backends.torch import runner as torch_runner
    from mlx_engine.backends.torch.weights import QuantizedWeight

    path, ref = tiny_gguf
    monkeypatch.setattr(torch_runner, "use_kernels", lambda device: kernels)
    monkeypatch.setenv("ROOFLINE_TORCH_CPU_PACKED", "0")  # unpacked: the float32 twin of the packed CPU path
    with Engine.load(path, backend="torch", device="cpu") as engine:
        model = engine.diagnostics().runner.model
        for w in (model.embed_tokens.weight, model.layers[0].self_attn.q_proj.weight, model.lm_head.weight):
            assert isinstance(w, QuantizedWeight) == kernels
        assert engine.diagnostics().cache.storage.use_kernel == kernels
        assert float(np.abs(engine.forward_logits(PROMPT) - ref["logits"]).max()) <= LOGITS_TOL
        streams = [engine.generate(GenerationRequest(prompt_token_ids=p, sampling=SamplingParams(
            temperature=0.0, max_tokens=8, ignore_eos=True))) for p in (PROMPT, PROMPT[3:14])]
        assert [[t for e in s for t in e.token_ids] for s in streams] == ref["tokens"]


# --- bad input --------------------------------------------------------------------------------------


def test_cuda_without_cuda_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(RooflineError, match="sees no CUDA device"):
        Engine.load(str(GOLDEN / "llama"), backend="torch", device="cuda")


@pytest.mark.parametrize("options, message", [
    ({"backend": "jax"}, "backend='jax': expected one of 'auto', 'mlx', 'torch'"),
    ({"backend": "torch", "device": "tpu"}, "device='tpu': expected one of"),
    ({"backend": "mlx", "device": "cuda"}, "device='cuda' needs backend='torch'"),
    ({"backend": "torch", "kv_bits": 8}, "kv_bits is not supported on the torch backend"),
    ({"backend": "torch", "paged_kv": False}, "paged_kv=False is not supported on the torch backend"),
    ({"backend": "torch", "dtype": "float64"}, "dtype='float64': expected one of"),
    ({"backend": "torch", "draft_bits": 4, "draft_model": str(GOLDEN / "llama")},
     "draft_bits=4: the torch backend holds a draft at 8 bits only"),
    ({"backend": "torch", "draft_bits": 8}, "draft_bits=8 needs draft_model"),
    ({"backend": "torch", "draft_bits": 8, "draft_model": str(GOLDEN / "llama"), "dtype": "bfloat16"},
     "draft_bits=8 needs float32 activations on the CPU, not dtype='bfloat16'"),
    ({"backend": "mlx", "draft_bits": 3, "draft_model": str(GOLDEN / "llama")}, "draft_bits=3: expected 4 or 8"),
    ({"backend": "mlx", "draft_bits": 8}, "draft_bits=8 needs draft_model"),
])
def test_bad_options(options, message):
    with pytest.raises(RooflineError, match=message.replace("(", r"\(")):
        Engine.load(str(GOLDEN / "llama"), **options)


def _copy_with_config(tmp_path, name: str, **changes) -> str:
    dst = tmp_path / name
    shutil.copytree(GOLDEN / name, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(changes)
    (dst / "config.json").write_text(json.dumps(config))
    return str(dst)


def test_unsupported_model_type_is_named(tmp_path):
    folder = _copy_with_config(tmp_path, "llama", model_type="gemma2")
    with pytest.raises(RooflineError, match="model type 'gemma2' is not supported on the torch backend"):
        Engine.load(folder, backend="torch", device="cpu")


def test_sliding_window_is_refused(tmp_path):
    folder = _copy_with_config(tmp_path, "mistral", sliding_window=8)
    with pytest.raises(RooflineError, match="sliding-window attention .* not supported on the torch backend"):
        Engine.load(folder, backend="torch", device="cpu")


def test_missing_torch_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` now raises ImportError
    with pytest.raises(RooflineError, match=r"needs the optional extra: `uv sync --extra torch`") as e:
        Engine.load(str(GOLDEN / "llama"), backend="torch")
    # PyPI's Linux wheel is the 3 GB CUDA build: the hint names the CPU route too
    assert "CUDA build" in str(e.value) and "--index-url https://download.pytorch.org/whl/cpu" in str(e.value)


def test_save_kv_is_refused(llama, tmp_path):
    with pytest.raises(RooflineError, match="not supported on the torch backend"):
        llama.save_kv(str(tmp_path / "kv.safetensors"), PROMPT)


def test_long_prompt_is_a_request_error(llama):
    with pytest.raises(RequestError, match="context"):
        llama.generate(GenerationRequest(prompt_token_ids=[5] * 600))


@pytest.mark.parametrize("kernels", [False, True], ids=["dequantized", "packed"])
def test_kquant_gguf(tmp_path, kernels, monkeypatch):
    """GGUF k-quants on the torch backend. Packed (CUDA's path; here through the kernels' torch references):
    each sub-block an affine group of 32 (Q4_K, Q5_K) or 16 (Q2_K, Q3_K, Q6_K) with float32 scales, so the
    logits are those of the exact dequantized weights. Dequantized (the CPU's portable path): rounded to float16,
    as the MLX backend keeps them."""
    from mlx_engine.backends.torch import runner as torch_runner
    from mlx_engine.backends.torch.weights import QuantizedWeight
    from tests.support.tiny_models import folder_with_weights, gguf_to_hf_names, kquant_llama_gguf, kquants_as_float16

    path, src, deq = kquant_llama_gguf(tmp_path)
    ref = folder_with_weights(src, tmp_path / "ref", gguf_to_hf_names(deq if kernels else kquants_as_float16(deq)))
    monkeypatch.setattr(torch_runner, "use_kernels", lambda device: kernels)
    monkeypatch.setenv("ROOFLINE_TORCH_CPU_PACKED", "0")  # unpacked: the float32 twin of the packed CPU path
    with Engine.load(str(path), backend="torch", device="cpu") as engine, \
            Engine.load(str(ref), backend="torch", device="cpu") as want:  # the float folder on this backend
        layer = engine.diagnostics().runner.model.layers[0]
        attn, mlp = layer.self_attn, layer.mlp
        formats = {name: (w.bits, w.group_size) if isinstance(w, QuantizedWeight) else None for name, w in (
            ("Q4_K", attn.q_proj.weight), ("Q3_K", attn.k_proj.weight), ("Q5_K", attn.v_proj.weight),
            ("Q6_K", attn.o_proj.weight), ("Q2_K", mlp.gate_proj.weight))}
        if kernels:
            assert formats == {"Q4_K": (4, 32), "Q3_K": (4, 16), "Q5_K": (8, 32), "Q6_K": (8, 16), "Q2_K": (4, 16)}
            assert attn.q_proj.weight.scales.dtype == torch.float32
        else:
            assert set(formats.values()) == {None}
        a, b = engine.forward_logits(PROMPT), want.forward_logits(PROMPT)
        assert float(np.abs(a - b).max()) <= 2e-6 * float(np.abs(b).max())
        assert run(engine, PROMPT, 8)[0] == run(want, PROMPT, 8)[0]


def test_seeded_sampling_repeats_and_seeds_differ(llama):
    """A seed is a request's own stream (one torch.Generator per sampler): the same seed gives the same tokens,
    alone or beside another request (a solo prompt's first token is drawn where a packed step's is, by the
    runner), and another seed other tokens."""
    def start(seed: int):
        return llama.generate(GenerationRequest(prompt_token_ids=[5, 6, 7, 8], sampling=SamplingParams(
            temperature=1.0, max_tokens=24, ignore_eos=True, seed=seed)))

    def tokens(stream) -> list[int]:
        return [t for e in stream for t in e.token_ids]

    first, again, other = tokens(start(3)), tokens(start(3)), tokens(start(4))
    together = [tokens(s) for s in [start(3), start(9)]]
    assert first == again == together[0] and len(first) == 24
    assert other != first
