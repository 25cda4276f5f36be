"""A decode-sized forward's layers as one call of Roofline's CPU kernel library (`native_step.NativeStep`,
`roofline_cpu::forward_layers`): its layers against the Python model's on the same paged rows (K/V written, the
output), the engine's tokens and their logprobs with it against without it on each family the torch backend
runs (llama, mistral, qwen2's q/k/v biases, qwen3's q/k norms; solo, batched, a speculative verification's rows,
the self-draft's first layers), which models it takes, and what the op refuses."""

from __future__ import annotations

import json
import math
import platform
from pathlib import Path

import numpy as np
import pytest

from tests.support.torch_support import require

torch = require("torch")
mx = pytest.importorskip("mlx.core")

from mlx_engine import Engine, GenerationRequest, SamplingParams  # noqa: E402
from mlx_engine.backends.torch import cpu_features, cpu_native  # noqa: E402
from mlx_engine.backends.torch.paths import native_step  # noqa: E402
from mlx_engine.backends.torch import model as tm  # noqa: E402

pytestmark = pytest.mark.skipif(
    platform.machine().lower() not in ("x86_64", "amd64") or not cpu_features.cpu_support().packed,
    reason="Roofline's kernel is AVX2 code for x86-64")

GOLDEN = Path(__file__).parent / "data" / "golden"
PROMPTS = [[(7 * i + 3) % 120 + 5 for i in range(24)], [(11 * i + 5) % 120 + 5 for i in range(9)],
           [9, 8, 7, 6, 5, 4, 3, 2, 1, 11]]


def quantized(family: str, dst: Path) -> Path:
    """The golden `family` folder with every matrix MLX-quantized to 4 bits in groups of 32 (the kernel's
    4-bit codes), the rest as it is."""
    from safetensors.numpy import load_file, save_file

    src = GOLDEN / family
    config = json.loads((src / "config.json").read_text())
    out = {}
    for name, value in load_file(str(src / "model.safetensors")).items():
        if value.ndim == 2 and name.endswith(".weight"):
            path = name.removesuffix(".weight")
            wq, s, b = mx.quantize(mx.array(value), group_size=32, bits=4)
            out[name], out[f"{path}.scales"], out[f"{path}.biases"] = np.array(wq), np.array(s), np.array(b)
        else:
            out[name] = value
    config["quantization"] = {"group_size": 32, "bits": 4}
    dst.mkdir(parents=True)
    (dst / "config.json").write_text(json.dumps(config))
    for extra in src.iterdir():
        if extra.name not in ("config.json", "model.safetensors"):
            (dst / extra.name).write_bytes(extra.read_bytes())
    save_file(out, str(dst / "model.safetensors"))
    return dst


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    assert cpu_native.build_error() == "", cpu_native.build_error()
    tmp = tmp_path_factory.mktemp("native-step")
    return {f: quantized(f, tmp / f) for f in ("llama", "mistral", "qwen2", "qwen3")}


def _load(path: Path, native: bool, monkeypatch, **options) -> Engine:
    """Without the native step, its pools' float16 all the same: the two differ in the layers' code only."""
    from mlx_engine.backends.torch.kv import TorchPagedCache

    create = TorchPagedCache.create_torch.__func__
    monkeypatch.setattr(TorchPagedCache, "create_torch", classmethod(
        lambda cls, **kw: create(cls, **{**kw, "dtype": native_step.KV_DTYPE})))
    compile = options.pop("compile_", False)
    return Engine.load(str(path), backend="torch", device="cpu", compile=compile, prefix_caching=False,
                       native_step=native, **options)


def _run(engine: Engine, prompts: list[list[int]], n: int, **sampling) -> list[tuple[list[int], list[float]]]:
    """Each prompt's greedy tokens and their logprobs, the prompts decoding side by side (batched steps)."""
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0, **sampling)
    streams = [engine.generate(GenerationRequest(prompt_token_ids=p, sampling=params)) for p in prompts]
    out = []
    for events in streams:
        events = list(events)
        out.append(([t for e in events for t in e.token_ids], [lp.logprob for e in events for lp in e.logprobs]))
    return out


# max |logprob with the native step - without| over each family's tokens below (both with float16 pools),
# measured on a 2-core Intel Xeon (AMX): qwen2 0.012, mistral 0.022, qwen3 0.036 (float32 pools: llama, mistral,
# qwen2 2e-6, qwen3 0.020). The same matmuls; the norms' and softmax's float32 sums in another order, whose last
# bits can move a K/V to the next float16 or flip an activation's int8 rounding (one prefill row of qwen3's: its
# layer output 0.0127 off at a scale of 20, every other row 1e-5), as torch.compile's fused norms could. Headroom
# about 3x
LOGPROB_ATOL = 0.1


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_native_step_is_the_python_layers(folders, family, monkeypatch):
    with _load(folders[family], False, monkeypatch) as ref:
        assert ref.diagnostics().runner.paths.native is None
        want_solo = _run(ref, PROMPTS[:1], 16)
        want_batch = _run(ref, PROMPTS, 10)
        want_spec = _run(ref, [PROMPTS[2] * 3], 12, speculative="prompt-lookup")
        want_self = _run(ref, [PROMPTS[0]], 12, speculative="self")
    with _load(folders[family], True, monkeypatch) as engine:
        assert engine.diagnostics().runner.paths.native is not None
        assert native_step.NOTE in engine.info.notes
        assert engine.diagnostics().runner.cache.storage.dtype == torch.float16
        for got, want in ((_run(engine, PROMPTS[:1], 16), want_solo), (_run(engine, PROMPTS, 10), want_batch),
                          (_run(engine, [PROMPTS[2] * 3], 12, speculative="prompt-lookup"), want_spec),
                          (_run(engine, [PROMPTS[0]], 12, speculative="self"), want_self)):
            for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, want):
                assert tokens == want_tokens
                assert np.abs(np.array(logprobs) - np.array(want_logprobs)).max() <= LOGPROB_ATOL


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_native_prefill_is_the_python_layers(folders, family, monkeypatch):
    """A 150-token prompt in chunks of 64: two chunks through the op's prefill path (the second at an offset, its
    mask past the chunk's own rows), the last 22 rows through its row-by-row attention, then decode."""
    prompt = [(13 * i + 1) % 120 + 5 for i in range(150)]
    got = {}
    for native in (False, True):
        with _load(folders[family], native, monkeypatch, prefill_chunk_size=64) as engine:
            assert (engine.diagnostics().runner.paths.native is not None) == native
            got[native] = _run(engine, [prompt], 8)
    (tokens, logprobs), (want_tokens, want_logprobs) = got[True][0], got[False][0]
    assert tokens == want_tokens
    assert np.abs(np.array(logprobs) - np.array(want_logprobs)).max() <= LOGPROB_ATOL


def test_head_in_one_call_is_its_torch_ops(folders, monkeypatch):
    """`head_logits` (a decode step's head in one call) gives `head_ops`' logits bit for bit: the same kernel,
    the same exact recomputation of each row's top logits."""
    from mlx_engine.backends.torch import cpu_packed

    with _load(folders["qwen3"], True, monkeypatch) as engine:
        head = engine.diagnostics().runner.model.embed_tokens.weight
        assert isinstance(head, cpu_native.NativeWeight)
        g = torch.Generator().manual_seed(3)
        for rows in (1, 5, 47):
            x = torch.randn(1, rows, head.in_features, generator=g)
            got, want = cpu_packed.head_matmul(head, x, top=16), cpu_packed.head_ops(head, x, top=16)
            assert got.shape == want.shape == (1, rows, head.out_features)
            assert torch.equal(got, want)


def test_compile_asked_for_beside_the_native_step(folders, monkeypatch):
    """compile=True with the step native: the prefills and the head (its one-call op inside the graph) compile,
    decode stays native, and the tokens are the uncompiled engine's."""
    prompt = [(13 * i + 1) % 120 + 5 for i in range(70)]
    with _load(folders["qwen3"], True, monkeypatch) as plain:
        want = _run(plain, [prompt], 8)
    with _load(folders["qwen3"], True, monkeypatch, compile_=True) as engine:
        paths = engine.diagnostics().runner.paths
        assert paths.native is not None and paths.compiled is not None, engine.info.warnings
        assert any("compiled by torch.compile" in n for n in engine.info.notes)
        (tokens, logprobs), ((want_tokens, want_logprobs),) = _run(engine, [prompt], 8)[0], want
        assert tokens == want_tokens
        assert np.abs(np.array(logprobs) - np.array(want_logprobs)).max() <= LOGPROB_ATOL


def test_no_compile_by_default_where_the_step_is_native(folders, monkeypatch):
    """torch.compile would serve only prefills there (docs/benchmarks/torch-cpu.md): by default the load compiles
    nothing; compiled graphs stay the default where the step cannot be native, and ROOFLINE_TORCH_COMPILE=0 still
    rules."""
    from mlx_engine.backends.torch.runner import default_compile
    from mlx_engine.backends.torch.switches import COMPILE

    monkeypatch.delenv(COMPILE.name, raising=False)
    assert [default_compile(packed, native) for packed, native in ((True, True), (True, False), (False, False))] \
        == [False, True, False]
    with Engine.load(str(folders["llama"]), backend="torch", device="cpu") as engine:
        paths = engine.diagnostics().runner.paths
        assert paths.native is not None and paths.compiled is None
        assert not any("torch.compile" in n for n in (*engine.info.notes, *engine.info.warnings))
    monkeypatch.setenv(COMPILE.name, "0")
    assert not default_compile(True, False)


def test_nothing_compiled_imports_no_compiler(folders):
    """A load and a reply with nothing compiled (the CPU default) never import torch's compiler, torch._dynamo
    (seconds and tens of MB at every start), nor threadpoolctl (the MLX runner's host BLAS cap: this runner
    declares `host_blas=False`). In a process of its own: this one's tests compile."""
    import subprocess
    import sys

    code = ("import sys\n"
            "from mlx_engine import Engine, GenerationRequest, SamplingParams\n"
            f"with Engine.load({str(folders['llama'])!r}, backend='torch', device='cpu') as e:\n"
            "    assert e.diagnostics().runner.paths.native is not None\n"
            "    p = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)\n"
            "    out = list(e.generate(GenerationRequest(prompt_token_ids=[3, 17, 42] * 20, sampling=p)))\n"
            "    assert out[-1].usage.completion_tokens == 4, out[-1]\n"
            "print(sorted(m for m in sys.modules if m.startswith(('torch._dynamo', 'threadpoolctl'))))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout


def _rows(n: int, s: int, slots: int, hkv: int, d: int, seed: int, dtype=torch.float32) -> tm.PagedRows:
    """Pools of random K/V; n new rows written to the last n of s slots (spread over the pool), each seeing the
    slots up to its own."""
    g = torch.Generator().manual_seed(seed)
    where = torch.randperm(slots, generator=g)[:s]
    visible = torch.arange(s)[None, :] <= torch.arange(s - n, s)[:, None]
    bias = torch.zeros(n, s).masked_fill_(~visible, -math.inf)
    k, v = (torch.randn(slots, hkv, d, generator=g).to(dtype) for _ in range(2))
    gather = where[None].expand(n, s)  # a prefill chunk's as `chunk_rows` gives it: one row expanded
    return tm.PagedRows(k, v, where[s - n:].contiguous(), gather.contiguous() if n <= tm.GRAPH_ROWS else gather, bias)


# max |native - Python| / max |Python| over a layer's output and the K it wrote, measured on a 2-core Intel Xeon
# (AMX): outputs 3.2e-6 or less in 47 of the 48 cases (the prefill-sized ones 2.5e-5 or less, mostly 0: the same
# bfloat16 GEMM, whose input rounding absorbs the attention's last bits), the K 5.2e-7 (float32 pools) and 1.8e-4 (float16: a last bit
# of float32 can move the value to the next float16, 4.9e-4 of the largest). One case, 40 rows over float16 pools,
# 2.9e-3: such a K moved a row's attention output enough to flip one int8 rounding of the o projection's input
# (a step of 1/127 of its block's largest value). Headroom: about 3x each
LAYER_RTOL = 1e-2
POOL_RTOL = 1e-3


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n,s", [(1, 1), (1, 37), (3, 20), (7, 7), (24, 24), (40, 47), (64, 64), (100, 160)])
def test_one_layer_against_the_python_halves(folders, family, dtype, n, s, monkeypatch):
    """A layer of each family through the op against `attention_inputs`, `paged_attention` and
    `attention_outputs` (the compiled step's math, eagerly) on copies of the same pools, float32 or float16 (both
    round the new K/V once, as written); from 48 rows (prefill chunks: the dequantizing GEMM, where the CPU has
    bfloat16 dot products, and SDPA) the op's prefill path."""
    with _load(folders[family], True, monkeypatch) as engine:
        model = engine.diagnostics().runner.model
        a = model.args
        step = native_step.NativeStep.layout(model)
        assert isinstance(step, native_step.NativeStep), step
        g = torch.Generator().manual_seed(n * 100 + s)
        h = torch.randn(1, n, a.hidden_size, generator=g) * 2
        cos, sin = model.rope.angles(torch.arange(s - n, s)[None])
        slots = max(64, 2 * s)
        mine, theirs = (_rows(n, s, slots, a.num_key_value_heads, a.head_dim, s, dtype) for _ in range(2))
        block = model.layers[0]
        q, k, v = tm.attention_inputs(block, h, cos, sin)
        want = tm.attention_outputs(block, h, tm.paged_attention(q, k, v, theirs, block.self_attn.scale))[0]
        got = step(h[0], [mine], cos.reshape(n, -1), sin.reshape(n, -1))
        assert float((got - want).abs().max()) <= LAYER_RTOL * float(want.abs().max())
        for pool, ref in ((mine.pool_k, theirs.pool_k), (mine.pool_v, theirs.pool_v)):
            assert pool.dtype == dtype
            assert float((pool - ref).float().abs().max()) <= POOL_RTOL * float(ref.float().abs().max())
            untouched = torch.ones(slots, dtype=torch.bool)
            untouched[mine.write] = False
            assert torch.equal(pool[untouched], ref[untouched])  # nothing written but the new rows' slots


def test_models_it_cannot_take_run_as_before(folders, monkeypatch):
    """torch's own int4 kernel's weights (the kernel library turned off) are not the op's: no native step, no note
    (the load's warning is the library's)."""
    with _load(folders["llama"], True, monkeypatch, cpu_kernel=False) as engine:
        assert engine.diagnostics().runner.paths.native is None
        assert native_step.NOTE not in engine.info.notes


def test_a_model_the_step_cannot_take_says_why(folders, monkeypatch):
    """Weights the kernel holds in a model its one-call step cannot run: the layers run in Python, and the load
    says why in a warning (never a silent slower path)."""
    import dataclasses

    with _load(folders["llama"], True, monkeypatch) as engine:
        model = engine.diagnostics().runner.model
        assert isinstance(native_step.NativeStep.layout(model), native_step.NativeStep)
        args = model.args
        monkeypatch.setattr(model, "args", dataclasses.replace(args, head_dim=12))
        assert native_step.NativeStep.layout(model) == "head_dim 12 is not a multiple of 8"
        monkeypatch.setattr(model, "args", args)
        down = model.layers[1].mlp.down_proj
        monkeypatch.setattr(down, "bias", torch.zeros(down.weight.out_features))
        assert native_step.NativeStep.layout(model) == "layer 1 has biases past q/k/v, or ones not float32 vectors"
    why = "head_dim 12 is not a multiple of 8"
    monkeypatch.setattr(native_step.NativeStep, "layout", classmethod(lambda cls, m: why))
    with _load(folders["llama"], True, monkeypatch) as engine:
        assert engine.diagnostics().runner.paths.native is None and native_step.NOTE not in engine.info.notes
        said = [w for w in engine.info.warnings if "Python layers" in w]
        assert said == ["decode steps run as Python layers around the kernel, not in one call of it (head_dim 12 "
                        "is not a multiple of 8): slower decode (docs/benchmarks.md, issue 27)"], engine.info.warnings


def test_the_op_refuses_what_it_cannot_read(folders, monkeypatch):
    with _load(folders["llama"], True, monkeypatch) as engine:
        runner = engine.diagnostics().runner
        step, a = runner.paths.native, runner.model.args
        h = torch.zeros(1, a.hidden_size)
        cos = sin = torch.zeros(1, a.head_dim // 2)
        rows = _rows(1, 4, 16, a.num_key_value_heads, a.head_dim, 0)
        bf16 = tm.PagedRows(rows.pool_k.bfloat16(), rows.pool_v.bfloat16(), rows.write, rows.gather, rows.bias)
        with pytest.raises(RuntimeError, match="pools .* float32 or float16"):
            step(h, [bf16], cos, sin)
        outside = tm.PagedRows(rows.pool_k, rows.pool_v, torch.tensor([16]), rows.gather[:1], rows.bias[:1])
        with pytest.raises(RuntimeError, match="write slot 16 outside the pool's 16"):
            step(h, [outside], cos, sin)
        with pytest.raises(RuntimeError, match="fewer tensors"):
            torch.ops.roofline_cpu.forward_layers(
                h, step.tensors[:3], step.ints, [rows.pool_k], [rows.pool_v], [rows.write], [rows.gather], [rows.bias],
                cos, sin, a.num_attention_heads, a.num_key_value_heads, a.head_dim, 1e-5, 0.25, 1.0, False, 48, 2**21,
                48)
