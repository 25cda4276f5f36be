"""Quantized weights held packed for torch's CPU kernels (`backends/torch/cpu_packed.py`): the kernels' semantics
and layout, what each format keeps exactly, logits per quantization type against the same weights dequantized
in float32, greedy tokens against the MLX backend, the portable path on a CPU without AVX2, threads and the
compiled decode step.

The kernels take bfloat16 rows (their only vectorized dtype) and return bfloat16, so the packed path's logits
differ from float32's by bfloat16 roundings: the tolerances below are the floors measured on the tiny models
here (AVX-512 EPYC) times 2.5, headroom for AVX2 and AMX, whose float32 partial sums differ in their last bits
and so flip other bfloat16 roundings.
"""

from __future__ import annotations

import json
import platform

import numpy as np
import pytest

from tests.support.torch_support import require

torch = require("torch")

from mlx_engine import Engine, GenerationRequest, SamplingParams  # noqa: E402
from mlx_engine.api import RooflineError  # noqa: E402
from mlx_engine.backends.torch import cpu_features, cpu_packed  # noqa: E402
from tests.support.tiny_models import GOLDEN  # noqa: E402
from tests.support.torch_cpu import (  # noqa: E402
    GGUF_KIND,
    PROMPT,
    greedy,
    greedy_agrees,
    quantized_files,  # noqa: F401  (a fixture)
)

# max |packed - float32 of the same weights| / max |float32 logit| on the tiny models; measured 2.7e-2 (Q4_0),
# 2.9e-2 (Q4_1), 2.1e-2 (Q8_0), 5.3e-2 (Q5_0), 2.9e-2 (Q5_1), 6.0e-2 (the k-quant file, whose Q2_K/Q3_K/Q6_K are
# int8 rows), 2.3e-2 (MLX 4-bit)
LOGITS_REL_TOL = {"Q4_0": 0.07, "Q4_1": 0.075, "Q8_0": 0.055, "Q5_0": 0.135, "Q5_1": 0.075, "kquants": 0.15,
                  "mlx4": 0.06}
# each GGUF type as the CPU kernels hold it: Q5_0 / Q5_1 arrive as MLX's affine 5-bit groups of 32 (exact), so
# two int4 planes with their codes exact
# greedy tokens shared with MLX before a near-tie parts them, where fewer than all 12 (measured): the golden MLX
# 4-bit folder's first token (a gap of 0.044 between its top two logits of 4.1), Q5_0's third (0.059 of 4.4)
GREEDY_AGREED = {"mlx4": 0, "Q5_0": 2}
BF16_EPS = 2.0**-7  # bfloat16's spacing at 1: a rounding moves a value by at most half of it, relatively

needs_kernels = pytest.mark.skipif(not cpu_features.cpu_support().packed,
                                   reason="this CPU has no AVX2 (or is not x86-64): the packed kernels are off here")


@pytest.fixture(autouse=True)
def torch_kernels(monkeypatch):
    """torch's int4/int8 kernels on every x86-64 CPU here, also an AVX2 one where the engine would take
    Roofline's own (tests/test_torch_cpu_native.py)."""
    monkeypatch.setenv("ROOFLINE_TORCH_CPU_NATIVE", "0")


# --- the kernels and the layout -----------------------------------------------------------------------


@needs_kernels
def test_pack_codes_is_the_kernels_layout():
    assert cpu_packed.layout_ok(cpu_features.cpu_support().block_n)


def _affine(rng: np.random.Generator, n: int, k: int, bits: int, group: int):
    """Random affine weights w = s * q + b per group, as GGUF and MLX store them (b about -s * 2**(bits-1))."""
    q = rng.integers(0, 2**bits, (n, k))
    s = (rng.random((n, k // group)) * 0.01 + 0.001).astype(np.float32)
    b = (-s * 2 ** (bits - 1) + rng.standard_normal((n, k // group)) * 0.002).astype(np.float32)
    w = (q.reshape(n, -1, group) * s[..., None] + b[..., None]).reshape(n, k).astype(np.float32)
    return q, s, b, torch.from_numpy(w)


@needs_kernels
@pytest.mark.parametrize("bits, group, n", [(4, 32, 192), (4, 64, 100), (2, 128, 64), (3, 32, 48), (5, 32, 130),
                                            (6, 64, 64), (8, 32, 80)])
def test_int4_planes_hold_the_codes_exactly_and_match_the_kernel_contract(bits, group, n):
    """Codes exact (one plane up to 4 bits, two beyond); a weight within the bfloat16 roundings of its scale
    (times its code) and its zero (8 scales from the bias, the kernel's offset); the matmul is x in bfloat16
    times those weights, rounded to bfloat16 once."""
    rng = np.random.default_rng(bits * 1000 + n)
    k = 256
    q, s, b, w = _affine(rng, n, k, bits, group)
    block_n = cpu_features.cpu_support().block_n
    packed = cpu_packed.Int4Weight.from_affine(q, s, b, bits, group, block_n)
    assert packed.planes == (1 if bits <= 4 else 2) and packed.packed.shape[0] % block_n == 0
    codes = cpu_packed.unpack_codes(packed.packed, block_n)[:n].long()
    got_q = codes[:, :k] + (16 * codes[:, k:] if packed.planes == 2 else 0)
    assert torch.equal(got_q, torch.from_numpy(q))
    own = packed.dequantized(dtype=torch.float32)[:n]
    scale = torch.from_numpy(s).repeat_interleave(group, 1)
    bias = torch.from_numpy(b).repeat_interleave(group, 1)
    zero = 8 * scale + bias  # the zero, 8 (rounded) scales from the bias, rounds too
    assert ((own - w).abs() <= BF16_EPS / 2 * (scale * torch.from_numpy(q) + zero.abs() + 8 * BF16_EPS * scale)).all()
    rows = torch.tensor([0, n // 2, n - 1])
    assert torch.equal(packed.rows(rows), own[rows])
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(1))
    want = (x.bfloat16().float() @ own.T).bfloat16().float()
    got = packed.matmul(x)
    assert got.shape == (3, n) and got.dtype == torch.float32
    assert (got - want).abs().max() <= BF16_EPS * want.abs().max()  # one bfloat16 rounding of the sums, at most
    if cpu_features.cpu_support().bf16_gemm:  # a prefill's rows: dequantized to bfloat16, oneDNN's GEMM
        xs = torch.randn(cpu_features.DEQUANT_MIN_ROWS, k, generator=torch.Generator().manual_seed(3))
        ref = xs @ own.T
        assert (packed.matmul(xs) - ref).abs().max() <= 4 * BF16_EPS * ref.abs().max()


def test_zeros_of_symmetric_formats_are_exact():
    """Q4_0 (bias -8d) and Q8_0 (bias -128d): the bias joins the plane where the kernel's zero comes out exact,
    so the dequantized weight is the bfloat16 scale times the signed code, to the last bit."""
    rng = np.random.default_rng(0)
    for bits in (4, 8):
        d = rng.random((64, 4)).astype(np.float32) * 0.01 + 1e-3
        d = d.astype(np.float16).astype(np.float32)  # GGUF's fp16 scales
        q = rng.integers(0, 2**bits, (64, 128))
        w = cpu_packed.Int4Weight.from_affine(q, d, -(2 ** (bits - 1)) * d, bits, 32, 64)
        sbf = torch.from_numpy(d).bfloat16().float().repeat_interleave(32, 1)
        exact = sbf * (torch.from_numpy(q) - 2 ** (bits - 1))
        got = w._apply(cpu_packed.unpack_codes(w.packed, 64), w.scale_zeros.float())
        assert (got - exact).abs().max() <= 1e-7 * exact.abs().max(), bits  # float32 arithmetic, no rounding


def test_int8_rows_and_fusion():
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(n, 64, generator=g) for n in (32, 16)]
    int8 = [cpu_packed.Int8Weight(w) for w in ws]
    for w, q in zip(ws, int8):
        step = w.abs().amax(1, keepdim=True) / 127
        assert (q.dequantized(torch.float32) - w).abs().le(step * (0.5 + BF16_EPS)).all()  # half a step per row
    fused, widths = cpu_packed.fuse(int8)
    x = torch.randn(2, 64, generator=g)
    assert widths == [32, 16]
    if cpu_features.cpu_support().packed:
        assert torch.equal(fused.matmul(x), torch.cat([q.matmul(x) for q in int8], 1))
    rng = np.random.default_rng(1)
    parts = [cpu_packed.Int4Weight.from_affine(*_affine(rng, n, 64, 4, 32)[:3], 4, 32, 64) for n in (48, 128)]
    fused, widths = cpu_packed.fuse(parts)
    assert fused.packed.shape == (192, 32) and widths == [64, 128]  # the first part padded to a whole block
    if cpu_features.cpu_support().packed:
        y = fused.matmul(x)
        assert torch.equal(y[:, :48], parts[0].matmul(x)) and torch.equal(y[:, 64:], parts[1].matmul(x))
    assert cpu_packed.fuse([parts[0], int8[0]]) is None  # different formats


@needs_kernels
def test_head_recomputes_its_top_logits_in_float32():
    rng = np.random.default_rng(2)
    q, s, b, _ = _affine(rng, 256, 128, 4, 32)
    w = cpu_packed.Int4Weight.from_affine(q, s, b, 4, 32, cpu_features.cpu_support().block_n)
    x = torch.randn(2, 128, generator=torch.Generator().manual_seed(2))
    exact = x @ w.dequantized(dtype=torch.float32).T
    got = cpu_packed.head_matmul(w, x, top=8)
    # the head recomputes the 8 its bfloat16 scores rank first; the float32 ranking's 8th can fall outside those
    # (18 of 300 inputs), its first 4 did in none of 1,000
    top = exact.topk(4, dim=-1).indices
    assert torch.allclose(got.gather(1, top), exact.gather(1, top), rtol=1e-5, atol=1e-5)
    assert torch.equal(got.argmax(-1), exact.argmax(-1))
    rest = torch.ones_like(got, dtype=torch.bool).scatter_(1, exact.topk(8, dim=-1).indices, False)
    assert (got - exact)[rest].abs().max() <= 2 * BF16_EPS * exact.abs().max()  # the kernel's bfloat16 elsewhere


# --- models: logits per quantization type, greedy tokens against MLX --------------------------------------


@needs_kernels
@pytest.mark.parametrize("kind", list(LOGITS_REL_TOL))
def test_packed_logits_and_greedy_tokens(quantized_files, kind):
    from mlx_engine.backends.torch.model import FusedLinear

    path, ref_folder = quantized_files[kind]
    with Engine.load(str(path), backend="torch", device="cpu") as packed, \
            Engine.load(str(ref_folder), backend="torch", device="cpu") as ref, \
                Engine.load(str(path), backend="mlx") as mlx:
        model = packed.diagnostics().runner.model
        assert isinstance(model.embed_tokens.weight, cpu_packed.CPUWeight)  # no float copy, the embedding too
        assert model.lm_head is None or isinstance(model.lm_head.weight, cpu_packed.CPUWeight)
        if kind in GGUF_KIND:
            assert {cpu_packed.kind(w) for w in (model.embed_tokens.weight, model.lm_head.weight,
                                                 model.layers[0].mlp.down_proj.weight)} == {GGUF_KIND[kind]}
        if kind != "kquants":  # q/k/v share a format: one matmul
            assert all(isinstance(b.self_attn.qkv, FusedLinear) for b in model.layers)
        assert packed.info.notes and "packed for the CPU kernels" in packed.info.notes[0]
        assert packed.info.weight_bytes < ref.info.weight_bytes / 2.5  # the bytes a token reads, as held
        ids = [i % packed.info.vocab_size for i in PROMPT]
        a, b = packed.forward_logits(ids), ref.forward_logits(ids)
        rel = float(np.abs(a - b).max() / np.abs(b).max())
        assert rel <= LOGITS_REL_TOL[kind], f"{kind}: {rel:.3e}"
        assert greedy(mlx, ids) == greedy(ref, ids)
        agreed = greedy_agrees(packed, mlx, ids, LOGITS_REL_TOL[kind] * float(np.abs(b).max()))
        assert agreed >= GREEDY_AGREED.get(kind, 12), agreed


def test_int8_rows_rounded_a_slice_at_a_time_are_the_whole_matrix(monkeypatch):
    """`Int8Weight.from_rows` (a k-quant head's float rows a slice at a time) rounds exactly as the whole matrix."""
    monkeypatch.setattr(cpu_packed, "INT8_ROWS_ELEMENTS", 3 * 96)  # three rows a slice: 70 rows in 24 slices
    w = torch.randn(70, 96, generator=torch.Generator().manual_seed(0)) * torch.linspace(0.01, 1, 70)[:, None]
    calls = []

    def rows(lo, hi):
        calls.append((lo, hi))
        return w[lo:hi]

    a, b = cpu_packed.Int8Weight.from_rows(rows, tuple(w.shape)), cpu_packed.Int8Weight(w)
    assert len(calls) == 24 and calls[-1] == (69, 70)
    assert torch.equal(a.q, b.q) and torch.equal(a.scale, b.scale) and (a.out_features, a.in_features) == (70, 96)


def test_kquant_formats(quantized_files):
    path, _ = quantized_files["kquants"]
    with Engine.load(str(path), backend="torch", device="cpu") as engine:
        if not cpu_features.cpu_support().packed:
            pytest.skip("the portable path here")
        layer = engine.diagnostics().runner.model.layers[0]
        a, m = layer.self_attn, layer.mlp
        kinds = {name: cpu_packed.kind(w.weight) for name, w in (
            ("Q4_K", a.q_proj), ("Q3_K", a.k_proj), ("Q5_K", a.v_proj), ("Q6_K", a.o_proj), ("Q2_K", m.gate_proj))}
        assert kinds == {"Q4_K": "int4", "Q3_K": "int8", "Q5_K": "int4x2", "Q6_K": "int8", "Q2_K": "int8"}
        note = engine.info.notes[0]
        assert "int4 groups (codes exact, scales and zeros rounded to bfloat16): 4-bit g32 x3, Q4_K x4;" in note
        assert "two int4 planes (codes exact, scales and zeros rounded to bfloat16): Q5_K x2;" in note
        assert note.endswith("int8 per output row (rounded: groups under 32 are not the int4 kernel's): Q2_K x2, "
                             "Q3_K x2, Q6_K x3")


# --- the portable path, threads, the compiled step ---------------------------------------------------------


@pytest.mark.parametrize("machine, capability, why", [
    ("x86_64", "DEFAULT", "this CPU has no AVX2"), ("aarch64", "DEFAULT", "x86-64 only"),
])
def test_a_cpu_without_avx2_gets_the_portable_path(monkeypatch, quantized_files, machine, capability, why):
    monkeypatch.setattr(platform, "machine", lambda: machine)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    cpu_features.cpu_support.cache_clear()
    try:
        support = cpu_features.cpu_support()
        assert not support.packed and why in support.reason
        path, ref = quantized_files["Q4_0"]
        with Engine.load(str(path), backend="torch", device="cpu") as e, \
                Engine.load(str(ref), backend="torch", device="cpu") as want:
            assert isinstance(e.diagnostics().runner.model.embed_tokens.weight, torch.Tensor)  # float32, dequantized
            assert len(e.info.warnings) == 1 and "the portable path" in e.info.warnings[0] and why in e.info.warnings[0]
            assert float(np.abs(e.forward_logits(PROMPT) - want.forward_logits(PROMPT)).max()) <= 1e-4
    finally:
        cpu_features.cpu_support.cache_clear()


def test_cpu_flags_pick_the_dequantizing_prefill(monkeypatch):
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    for capability, flags, want in (("AVX512", {"avx512f", "avx512_bf16"}, (True, True, 64)),
                                    ("AVX512", {"avx512f"}, (True, False, 64)),
                                    ("AVX2", {"avx2", "amx_bf16"}, (True, False, 32))):
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda c=capability: c)
        monkeypatch.setattr(cpu_features, "cpu_flags", lambda f=flags: f)
        cpu_features.cpu_support.cache_clear()
        s = cpu_features.cpu_support()
        assert (s.packed, s.bf16_gemm, s.block_n) == want
    cpu_features.cpu_support.cache_clear()


def test_the_exact_twin_by_environment(monkeypatch, quantized_files):
    monkeypatch.setenv("ROOFLINE_TORCH_CPU_PACKED", "0")
    path, ref = quantized_files["Q8_0"]
    with Engine.load(str(path), backend="torch", device="cpu") as e, \
            Engine.load(str(ref), backend="torch", device="cpu") as want:
        assert not e.info.warnings and isinstance(e.diagnostics().runner.model.embed_tokens.weight, torch.Tensor)
        assert float(np.abs(e.forward_logits(PROMPT) - want.forward_logits(PROMPT)).max()) <= 1e-4


@pytest.mark.parametrize("options, message", [
    ({"threads": 0}, "threads=0: expected an integer >= 1"),
    ({"threads": True}, "threads=True: expected an integer"),
    ({"compile": "yes"}, "compile='yes': expected True, False or None"),
    ({"backend": "mlx", "threads": 2}, "threads needs backend='torch'"),
    ({"backend": "mlx", "compile": True}, "compile needs backend='torch'"),
    ({"native_step": 1}, r"native_step=1: expected True, False or None \(default: on, unless ROOFLINE_TORCH_NATIVE"),
    ({"cpu_kernel": "off"}, "cpu_kernel='off': expected True, False or None"),
    ({"backend": "mlx", "native_step": False}, "native_step needs backend='torch'"),
    ({"backend": "mlx", "cpu_kernel": True}, "cpu_kernel needs backend='torch'"),
])
def test_bad_runner_options(options, message):
    options = {"backend": "torch", "device": "cpu", **options}
    with pytest.raises(RooflineError, match=message):
        Engine.load(str(GOLDEN / "llama"), **options)


def test_threads_are_the_runners(monkeypatch):
    from mlx_engine.backends.torch.model import Model

    seen = []
    real = Model.__call__
    monkeypatch.setattr(Model, "__call__", lambda self, *a, **k: seen.append(torch.get_num_threads()) or real(
        self, *a, **k))
    before = torch.get_num_threads()
    with Engine.load(str(GOLDEN / "llama"), backend="torch", device="cpu", threads=1) as e:
        assert "1 CPU threads" in e.info.notes
        greedy(e, PROMPT, 2)
    assert seen and set(seen) == {1} and torch.get_num_threads() == before


@needs_kernels
def test_compiled_decode_equals_eager(quantized_files):
    """The decode step through torch.compile (one row, and rows: a batched step, a speculative verification)
    gives the eager step's tokens, called directly and through dynamo, and after its warm-up at load needs no
    new graph."""
    path, _ = quantized_files["Q4_1"]
    prompts = [PROMPT, PROMPT[5:19], [9, 8, 7, 6, 5, 4, 3, 2, 1, 11]]

    def batch(e):
        streams = [e.generate(GenerationRequest(prompt_token_ids=p, sampling=SamplingParams(
            temperature=0.0, max_tokens=10, ignore_eos=True))) for p in prompts]
        return [[t for ev in s for t in ev.token_ids] for s in streams]

    long_prompt = PROMPT * 3  # 72 rows: a prefill's graphs, around the eager attention
    with Engine.load(str(path), backend="torch", device="cpu", compile=False) as eager:
        want_long, want_logits = greedy(eager, long_prompt, 8), eager.forward_logits(long_prompt)
        want_solo = greedy(eager, PROMPT, 16)
        want_batch = batch(eager)
        want_spec = [t for ev in eager.generate(GenerationRequest(prompt_token_ids=PROMPT * 2, sampling=SamplingParams(
            temperature=0.0, max_tokens=12, ignore_eos=True, speculative="prompt-lookup"))) for t in ev.token_ids]
    with Engine.load(str(path), backend="torch", device="cpu", compile=True) as compiled:
        assert any("compiled by torch.compile" in n for n in compiled.info.notes), compiled.info
        halves = compiled.diagnostics().runner.paths.compiled
        assert halves is not None and halves.warm
        # every part's one graph called directly, then the same through dynamo's calls with guards skipped,
        # whose tensor checks would recompile a call that needed another graph
        assert sorted(halves.direct) == [(rows, part, (0, 0) if part == 1 else () if part == 3 else (0,))
                                         for rows in (1, 2, 3) for part in range(4 if rows < 3 else 3)]
        for _ in range(2):
            # measured equal here; bfloat16 GEMM outputs round at 2**-8, so a fused float32 sum in another order
            # moves an output by at most about one such rounding
            got = compiled.forward_logits(long_prompt)
            assert float(np.abs(got - want_logits).max()) <= 2**-8 * float(np.abs(want_logits).max())
            assert greedy(compiled, long_prompt, 8) == want_long
            assert greedy(compiled, PROMPT, 16) == want_solo
            assert batch(compiled) == want_batch
            got_spec = [t for ev in compiled.generate(GenerationRequest(
                prompt_token_ids=PROMPT * 2, sampling=SamplingParams(
                    temperature=0.0, max_tokens=12, ignore_eos=True, speculative="prompt-lookup"))) for t in ev.token_ids]
            assert got_spec == want_spec
            halves.direct.clear()
        assert halves.recompiles == 0


@needs_kernels
def test_layers_of_mixed_formats_each_format_its_own_graphs(tmp_path):
    """A model whose layers mix quantizations (as Q4_K_M mixes Q5_0 and Q8_0) compiles each part once per
    format of the blocks it is given, so that every call is a direct one: one graph a function, where one
    function for all layers held two graphs for the layer pairs (0, 1) and (1, 2), chosen by guards every call."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from tests.support.tiny_models import random_llama_folder, write_gguf_from_folder

    src = random_llama_folder(tmp_path / "src", layers=4, hidden=64, head_dim=16)
    path = tmp_path / "mixed.gguf"
    write_gguf_from_folder(src, path, {"blk.1.": "Q8_0", "blk.3.": "Q8_0"}, default_type="Q4_0")
    ids = [5, 9, 17, 33, 2, 71, 8]
    with Engine.load(str(path), backend="torch", device="cpu", compile=False) as eager:
        want = greedy(eager, ids, 8)
    with Engine.load(str(path), backend="torch", device="cpu", compile=True) as compiled:
        halves = compiled.diagnostics().runner.paths.compiled
        assert {key[1:] for key in halves.direct if key[0] == 1} == {(0, (0,)), (1, (0, 1)), (1, (1, 0)), (2, (1,)),
                                                                    (3, ())}
        assert [len(_debug_get_cache_entry_list(fn.__code__)) for fn in halves.code.values()] == [1] * len(halves.code)
        assert sorted(halves.direct) == sorted(halves.code)
        assert greedy(compiled, ids, 8) == want
        assert halves.recompiles == 0


def test_cli_runner_options_on_every_command(monkeypatch, capsys):
    from app import cli

    for command in (["generate", "-p", "hi"], ["serve"], ["chat"], ["bench"], ["parity"]):
        args = cli._parser().parse_args([*command, "--device", "cpu", "--threads", "2", "--no-compile"])
        assert (args.device, args.threads, args.compile) == ("cpu", 2, False), command
        if command[0] != "parity":
            assert cli._parser().parse_args([*command, "--backend", "torch"]).backend == "torch"
    assert cli.main(["generate", "-p", "hi", "--backend", "mlx", "--threads", "2"]) == 2
    assert capsys.readouterr().err.strip() == ("roofline: error: --threads needs --backend torch or auto (it sets the "
                                               "torch backend's CPU work)")
    assert cli.main(["generate", "-p", "hi", "--backend", "torch", "--threads", "0"]) == 2
    assert "--threads 0: expected an integer >= 1" in capsys.readouterr().err
    assert cli._parser().parse_args(["generate", "-p", "hi", "--compile"]).compile is True
    assert cli.main(["generate", "-p", "hi", "--backend", "mlx", "--compile"]) == 2
    assert capsys.readouterr().err.strip() == ("roofline: error: --compile needs --backend torch or auto (it sets the "
                                               "torch backend's CPU work)")
    args = cli._parser().parse_args(["serve", "--backend", "torch", "--device", "cpu", "--threads", "1"])
    assert cli.runner_options(args) == {"backend": "torch", "device": "cpu", "threads": 1}
    assert json.loads(json.dumps(cli.runner_options(cli._parser().parse_args(["chat"])))) == {}


@needs_kernels
def test_smollm2_packed_greedy_against_mlx_and_batched_equals_solo():
    """The embedded SmolLM2 (Q4_1, a Q8_0 tied embedding): its greedy tokens are MLX's up to a near-tie, and so
    are batched decoding's (two rows a step: a masked attention, other float32 sums before the bfloat16 roundings,
    measured to part from the solo tokens at a tie 8 tokens in) and the prefix cache's against its solo ones."""
    gold = json.loads((GOLDEN / "smollm2_gguf.json").read_text())
    prompts = [p["prompt_ids"][-20:] for p in gold["prompts"][:2]]
    with Engine.load(None) as mlx, Engine.load(None, backend="torch", device="cpu") as packed:
        scale = float(np.abs(mlx.forward_logits(prompts[0])).max())
        for p in prompts:
            assert greedy_agrees(packed, mlx, p, LOGITS_REL_TOL["Q4_1"] * scale, 16) >= 8
        solo = [greedy(packed, p, 16) for p in prompts]
        streams = [packed.generate(GenerationRequest(prompt_token_ids=p, sampling=SamplingParams(
            temperature=0.0, max_tokens=16, ignore_eos=True))) for p in prompts]
        for p, s in zip(prompts, streams):
            batched = [t for e in s for t in e.token_ids]
            assert greedy_agrees(packed, packed, p, LOGITS_REL_TOL["Q4_1"] * scale, 16, got=batched) >= 8
        assert greedy(packed, prompts[0], 16) == solo[0]  # its first block from the prefix cache


def test_inductor_cache_under_the_app_cache_dir(monkeypatch, tmp_path):
    """Compiled graphs cache under ROOFLINE_CACHE_DIR (a later load skips inductor's code generation and C++
    builds); a TORCHINDUCTOR_CACHE_DIR the user set wins."""
    from mlx_engine.backends.torch.paths.compiled import CompiledHalves

    monkeypatch.setenv("ROOFLINE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    CompiledHalves(4)
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    assert cache_dir() == str(tmp_path / "torchinductor")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    CompiledHalves(4)
    assert cache_dir() == str(tmp_path / "mine")


def test_direct_call_only_of_a_single_graph():
    """`direct_call` runs a compiled function's one graph without dynamo's frame hook (on new inputs, not a
    remembered output), and is refused before the first graph and once there are two to choose between."""
    from mlx_engine.backends.torch.inductor import own_code
    from mlx_engine.backends.torch.paths.compiled import direct_call

    def scaled_sine(x: torch.Tensor, k: float = 2.0) -> torch.Tensor:
        return (x * k).sin()

    fn = own_code(scaled_sine, "direct_test")
    compiled = torch.compile(fn, backend="eager", fullgraph=True)
    assert direct_call(fn) is None
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    compiled(x)
    direct = direct_call(fn)
    assert direct is not None
    assert torch.equal(direct(y), (y * 2.0).sin())
    compiled(x.double())  # a second graph: dynamo's guards must choose
    assert direct_call(fn) is None
