"""Smoothed quantized KV (`kv.smoothing`): exact before quantization, smaller key error, saved files that match."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlx_engine import Engine, GenerationRequest, RooflineError, SamplingParams
from mlx_engine.kv.paged import PagedKVStorage
from mlx_engine.kv.smoothing import OFFSET_STEP, SCALE_STEPS, KVSmoothing, calibrate
from tests.support.kv_scores import stored_scores
from tests.support.tiny_models import random_llama_folder
from tests.support.tolerance import assert_f32_close

PROMPT = [(7 * i + 3) % 120 + 5 for i in range(45)]


def random_smoothing(layers: int, hkv: int, d: int, seed: int = 0) -> KVSmoothing:
    rng = np.random.default_rng(seed)
    grid = lambda x: (np.round(x / OFFSET_STEP) * OFFSET_STEP).astype(np.float32)  # noqa: E731
    return KVSmoothing(grid(rng.normal(0, 5, (layers, hkv, d))),
                       np.exp2(rng.integers(-2, 3, (layers, hkv, d))).astype(np.float32),
                       grid(rng.normal(0, 3, (layers, hkv, d))))


def softmax_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """q (Hq, L, D), k/v (Hkv, S, D), float64, no mask -> (Hq, L, D)."""
    g = q.shape[0] // k.shape[0]
    s = np.einsum("hld,hsd->hls", q, np.repeat(k, g, axis=0)) / np.sqrt(q.shape[-1])
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("hls,hsd->hld", p / p.sum(-1, keepdims=True), np.repeat(v, g, axis=0))


@pytest.mark.parametrize("d", [64, 96], ids=["hadamard", "no-rotation"])
def test_smoothing_changes_no_attention_output_before_quantization(d: int) -> None:
    """softmax((q / s) H . ((k - m_k) s) H) ((v - m_v) H) H.T + m_v == softmax(q . k) v: the transforms the
    storage applies around quantization, without the quantization, are exact up to float32 rounding."""
    rng = np.random.default_rng(1)
    hq, hkv, n, length = 6, 2, 40, 5
    st = PagedKVStorage(2, 8, 16, hkv, d, mx.float32, bits=8, group_size=32)
    st.set_smoothing(random_smoothing(2, hkv, d))
    assert (st.key_rotation is None) == (d == 96)
    k = rng.normal(0, 2, (n, hkv, d)).astype(np.float32) + 4.0
    v = rng.normal(0, 2, (n, hkv, d)).astype(np.float32) - 3.0
    q = rng.normal(0, 1, (1, hq, length, d)).astype(np.float32)
    want = softmax_attention(q[0].astype(np.float64), k.transpose(1, 0, 2), v.transpose(1, 0, 2))
    layer = 1
    keys = np.array(st.stored_keys(layer, mx.array(k))).transpose(1, 0, 2)  # (Hkv, n, D)
    values = np.array(st.stored_values(layer, mx.array(v))).transpose(1, 0, 2)
    qs = np.array(st.queries(layer, mx.array(q)))[0]
    out = softmax_attention(qs.astype(np.float64), keys, values).astype(np.float32)
    got = np.array(st.outputs(layer, mx.array(out)[None]))[0]
    # float32 floor: 10.1 units (tests/support/tolerance.py) on an AMD EPYC; x5 headroom
    assert_f32_close(got, want, 48, "smoothed float32 vs float64")
    assert np.abs(keys - k.transpose(1, 0, 2)).max() > 1  # (sanity: what is stored is not the keys)


def test_smoothing_cuts_4bit_key_error_on_a_planted_offset() -> None:
    """Keys sharing a large offset on a few channels (as SmolLM2's do: max |k| 11-17 against a median of 2-5)
    plus unit noise: stored with the offset taken off, the 4-bit scores q . k (up to q . m_k, which the
    softmax drops) are about 3x closer to the float scores than with the rotation alone."""
    rng = np.random.default_rng(0)
    n, hkv, d = 64, 2, 64
    offset = np.zeros((hkv, d), np.float32)
    offset[:, [3, 35]], offset[:, 20], offset[:, 51] = 14.0, -11.0, 9.0
    k = rng.normal(size=(n, hkv, d)).astype(np.float32) + offset
    v = rng.normal(size=(n, hkv, d)).astype(np.float32)
    q = rng.normal(size=(hkv, d)).astype(np.float32)
    exact = np.einsum("hd,nhd->hn", q, k)
    errors = {}
    for smooth in (False, True):
        st = PagedKVStorage(1, 8, 16, hkv, d, mx.float32, bits=4, group_size=32)
        m = k.mean(0) if smooth else np.zeros((hkv, d), np.float32)
        if smooth:
            st.set_smoothing(KVSmoothing(m[None], np.ones((1, hkv, d), np.float32), np.zeros((1, hkv, d), np.float32)))
        got, _ = stored_scores(st, k, v, q)
        diff = got + np.einsum("hd,hd->h", q, m)[:, None] - exact
        errors[smooth] = float(np.sqrt(np.mean(diff**2)))
    # measured: rms 1.78 rotated only, 0.58 with the offset off (3.1x: the keys' norm drops from ~26 to ~8)
    assert errors[True] < errors[False] / 2.5, errors


def calibrated(engine: Engine) -> KVSmoothing:
    """The engine's smoothing, which the runner measured at load (before anything was written)."""
    return engine.diagnostics().cache.storage.smoothing


def test_calibration_is_deterministic_and_on_its_grids(tmp_path: Path) -> None:
    folder = random_llama_folder(tmp_path / "m", head_dim=64, hidden=128)
    with Engine.load(str(folder), kv_bits=4, kv_group_size=32) as e:
        r = e.diagnostics().runner
        a = calibrated(e)
        b = e.diagnostics().call(lambda: calibrate(r.model, r.tokenizer, r.vocab_size))
    assert a.fingerprint() == b.fingerprint() and len(a.fingerprint()) == 16
    assert a.key_offset.shape == a.key_scale.shape == a.value_offset.shape == (2, 2, 64)
    for off in (a.key_offset, a.value_offset):
        assert np.array_equal(np.round(off / OFFSET_STEP) * OFFSET_STEP, off) and np.abs(off).max() > 0
    steps = np.log2(a.key_scale) * SCALE_STEPS
    assert np.allclose(steps, np.round(steps), atol=1e-3) and len(np.unique(a.key_scale)) > 3  # on the grid
    with Engine.load(str(folder)) as plain:  # unquantized KV: nothing to smooth
        r = plain.diagnostics().runner
        plain.diagnostics().call(lambda: r.cache.calibrate(r.model, r.tokenizer, r.vocab_size))
        assert r.cache.storage.smoothing is None


def logprob_errors(engine: Engine, prompts: list[list[int]], wanted: list) -> float:
    """Max |log-prob difference| over each step's top-10 tokens of the reference; greedy tokens must agree."""
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=20)
    errs = []
    for p, want in zip(prompts, wanted):
        events = list(engine.generate(GenerationRequest(prompt_token_ids=p, sampling=params)))
        got = np.array([[list(t) for t in lp.top] for e in events for lp in e.logprobs])
        assert np.array_equal(got[:, 0, 0], want[:, 0, 0])  # the same greedy tokens
        for g, w in zip(got, want):
            by_id = dict(zip(g[:, 0].astype(int), g[:, 1]))
            errs += [abs(by_id[int(t)] - lp) for t, lp in w[:10] if int(t) in by_id]
    return max(errs)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("head_major", [True, False], ids=["head-major", "token-major"])
def test_views_attend_as_over_the_dequantized_keys_and_values(head_major: bool, bits: int) -> None:
    """Prefill and decode views (CPU slice, gather, and the decode kernel's path) with smoothing: the output
    equals plain attention over the K and V the pool holds, mapped back to the model's basis by hand
    (K = stored @ H.T / s + m_k, V = stored @ H.T + m_v), to float32 rounding. So the quantization error
    is all there is."""
    from mlx_engine.kv.views import DecodeStep, PagedDecodeView, PagedPrefillView

    rng = np.random.default_rng(2)
    hq, hkv, d, n, scale = 4, 2, 64, 20, 0.125
    st = PagedKVStorage(1, 4, 16, hkv, d, mx.float32, bits=bits, group_size=32, head_major=head_major)
    sm = random_smoothing(1, hkv, d, seed=3)
    st.set_smoothing(sm)
    k = rng.normal(0, 2, (1, hkv, n + 1, d)).astype(np.float32) + sm.key_offset[0][None, :, None] * 0.5
    v = rng.normal(0, 2, (1, hkv, n + 1, d)).astype(np.float32)
    q = rng.normal(0, 1, (1, hq, n + 1, d)).astype(np.float32)
    h = np.array(st.key_rotation)

    def held(s: int) -> tuple[mx.array, mx.array]:  # (1, Hkv, s, D) each, in the model's basis
        keys, values = (np.array(x) for x in st.gather(0, mx.arange(s, dtype=mx.int32)))
        keys = (keys @ h.T) / sm.key_scale[0][:, None] + sm.key_offset[0][:, None]
        values = values @ h.T + sm.value_offset[0][:, None]
        return mx.array(keys[None]), mx.array(values[None])

    slots = mx.arange(n, dtype=mx.int32)
    out = PagedPrefillView(st, 0, 0, slots, slots).attention(mx.array(q[:, :, :n]), mx.array(k[:, :, :n]),
                                                             mx.array(v[:, :, :n]), scale)
    want = mx.fast.scaled_dot_product_attention(mx.array(q[:, :, :n]), *held(n), scale=scale, mask="causal")
    assert float(mx.abs(out - want).max()) < 1e-4
    last = [mx.array(x[:, :, n:]) for x in (q, k, v)]  # one decode token at position n
    for all_slots in (None, [slice(0, n + 1)], [slice(0, 7), slice(7, n + 1)], mx.arange(n + 1, dtype=mx.int32)):
        view = PagedDecodeView(DecodeStep(st, n, mx.array([n], dtype=mx.int32), mx.array([[0, 1]], dtype=mx.int32),
                                          mx.array([n + 1], dtype=mx.int32), n + 1, all_slots), 0)
        out = view.attention(*last, scale)
        want = mx.fast.scaled_dot_product_attention(last[0], *held(n + 1), scale=scale)
        assert float(mx.abs(out - want).max()) < 1e-4, all_slots


@pytest.mark.parametrize("head_major", [True, False], ids=["head-major", "token-major"])
def test_smoothed_8bit_engine_stays_close_to_unquantized(tmp_path: Path, monkeypatch, head_major: bool) -> None:
    """Through the engine (chunked prefill, decode, both pool layouts): 8-bit KV with smoothing gives the
    unquantized run's greedy tokens and log-probabilities about as close as without smoothing (this random
    model's keys have no outlier channels; what smoothing buys on SmolLM2 is bench/kv.py's figure 4)."""
    import mlx_engine.kv.paged as paged

    init = paged.PagedKVStorage.__init__
    monkeypatch.setattr(paged.PagedKVStorage, "__init__",
                        lambda self, *a, **kw: init(self, *a, **{**kw, "head_major": head_major}))
    folder = random_llama_folder(tmp_path / "m", head_dim=64, hidden=128)
    prompts = [PROMPT, [(11 * i + 1) % 120 + 5 for i in range(40)]]
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=20)
    with Engine.load(str(folder), paged_kv=False) as ref:
        wanted = [np.array([[list(t) for t in lp.top] for e in ref.generate(GenerationRequest(
            prompt_token_ids=p, sampling=params)) for lp in e.logprobs]) for p in prompts]
    err = {}
    for smooth in (False, True):
        with Engine.load(str(folder), kv_bits=8, kv_group_size=32, prefill_chunk_size=7) as e:
            if smooth:
                assert calibrated(e) is not None
            else:
                e.diagnostics().cache.storage.set_smoothing(None)
            err[smooth] = logprob_errors(e, prompts, wanted)
    # measured (both layouts): 0.176 without smoothing, 0.229 with it
    assert err[True] < 0.3 and err[False] < 0.3, err


def test_restore_refuses_other_smoothing(tmp_path: Path) -> None:
    """A saved file records the smoothing's fingerprint: an engine with other offsets (or none, or a file from
    before smoothing) refuses it with the reason; one with the same restores and continues."""
    folder = random_llama_folder(tmp_path / "m", head_dim=64, hidden=128)
    path, old = tmp_path / "chat.kv.safetensors", tmp_path / "old.kv.safetensors"
    opts = {"kv_bits": 4, "kv_group_size": 32, "kv_key_per_channel": False}  # keys per token: smoothed and rotated
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    with Engine.load(str(folder), **opts) as a:
        fp = calibrated(a).fingerprint()
        list(a.generate(GenerationRequest(prompt_token_ids=PROMPT, sampling=params)))
        assert a.save_kv(str(path), PROMPT) == 32
        want = [t for ev in a.generate(GenerationRequest(prompt_token_ids=PROMPT + [5], sampling=params))
                for t in ev.token_ids]
    arrays, meta = mx.load(str(path), return_metadata=True)
    assert (meta["kv_smoothing"], meta["key_rotation"], meta["value_rotation"]) == (fp, "hadamard", "hadamard")
    for key in ("kv_smoothing", "value_rotation"):  # as written before smoothing existed
        del meta[key]
    mx.save_safetensors(str(old), arrays, metadata=meta)
    with Engine.load(str(folder), **opts) as b:
        sm = calibrated(b)
        b.diagnostics().cache.storage.set_smoothing(KVSmoothing(sm.key_offset + OFFSET_STEP, sm.key_scale,
                                                                sm.value_offset))
        with pytest.raises(RooflineError, match=rf"saved KV refused: .* has kv_smoothing={fp}, this engine uses "
                                                r"[0-9a-f]{16} \(the quantized KV's offsets and key scales"):
            b.restore_kv(str(path))
        b.diagnostics().cache.storage.set_smoothing(None)
        with pytest.raises(RooflineError, match=rf"has kv_smoothing={fp}, this engine uses none"):
            b.restore_kv(str(path))
    with Engine.load(str(folder), **opts) as c:
        calibrated(c)
        with pytest.raises(RooflineError, match=r"saved KV refused: .* has value_rotation=none, this engine uses "
                                                r"hadamard"):
            c.restore_kv(str(old))
        assert c.restore_kv(str(path)) == 32
        events = list(c.generate(GenerationRequest(prompt_token_ids=PROMPT + [5], sampling=params)))
        assert events[-1].usage.cached_prompt_tokens == 32
        assert [t for ev in events for t in ev.token_ids] == want


@pytest.mark.parametrize("name,value_offset", [("phi3", True), ("gemma2", True), ("gpt_oss", False)])
def test_scored_layers_get_no_offsets_that_shift_their_softmax(name: str, value_offset: bool) -> None:
    """A soft cap (gemma2) or sinks (gpt-oss) make the softmax depend on a shift of every score, which the stored
    keys' offset is (q . m_k): such layers are measured with their soft cap and sinks and get no key offset; with
    sinks the weights sum to less than 1, so no value offset either. A plain family (phi3) gets both."""
    from mlx_engine.kv.smoothing import measure
    from mlx_engine.loading import load_checkpoint
    from mlx_engine.models import build_model
    from tests.support.tiny_models import GOLDEN

    ckpt = load_checkpoint(str(GOLDEN / name))
    built = build_model(ckpt.config, ckpt.weights, mx.float32, ckpt.quantization, name)
    assert built.views and not built.native  # mlx-lm's class on the engine's views
    sm = measure(built.model, PROMPT)
    scored = name != "phi3"
    assert (np.abs(sm.key_offset).max() == 0) == scored and np.abs(sm.key_scale - 1).max() > 0
    assert (np.abs(sm.value_offset).max() > 0) == value_offset
