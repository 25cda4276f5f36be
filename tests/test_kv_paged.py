"""The paged KV cache in the engine: same numbers as the contiguous cache, prefix hits, budgets, quantized KV."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from mlx_engine import Engine, GenerationRequest, RequestError, RooflineError, SamplingParams
from tests.support.kv_scores import stored_scores
from tests.support.tiny_models import random_llama_folder
from tests.support.tolerance import assert_f32_close

PROMPT = [(7 * i + 3) % 120 + 5 for i in range(45)]  # 45 tokens: crosses block boundaries of 16 and 32


def steps(engine: Engine, ids: list[int], n: int = 10) -> tuple[list[int], np.ndarray]:
    """Greedy tokens and, per step, the top-20 (token id, logprob) pairs as an array (n, 20, 2)."""
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=20)
    events = list(engine.generate(GenerationRequest(prompt_token_ids=ids, sampling=params)))
    lps = [lp for e in events for lp in e.logprobs]
    return [lp.token_id for lp in lps], np.array([[list(t) for t in lp.top] for lp in lps])


@pytest.fixture(params=["head-major", "token-major"])
def layout(request, monkeypatch) -> str:
    """The CPU pools are head-major; Metal's kernel reads token-major: run both layouts here."""
    if request.param == "token-major":
        import mlx_engine.kv.paged as paged

        init = paged.PagedKVStorage.__init__

        def token_major(self, *args, **kwargs):
            init(self, *args, **{**kwargs, "head_major": False})

        monkeypatch.setattr(paged.PagedKVStorage, "__init__", token_major)
    return request.param


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (8, 1)], ids=["mha", "gqa2", "gqa8"])
def test_paged_equals_contiguous_across_chunked_prefill_and_decode(tmp_path: Path, block_size: int,
                                                                     heads: tuple[int, int], layout: str) -> None:
    folder = random_llama_folder(tmp_path / "m", num_heads=heads[0], num_kv_heads=heads[1])
    with Engine.load(str(folder), paged_kv=False) as ref:
        want_tokens, want = steps(ref, PROMPT)
    with Engine.load(str(folder), block_size=block_size, prefill_chunk_size=7) as got:
        assert got.kv_stats()["kind"] == "paged"
        tokens, lps = steps(got, PROMPT)
    assert tokens == want_tokens
    assert np.array_equal(lps[..., 0], want[..., 0])  # same top-20 token ids in the same order
    # float32 floor: 11.0 units (tests/support/tolerance.py) on an AMD EPYC; x4 headroom
    assert_f32_close(lps[..., 1], want[..., 1], 48, "paged vs contiguous")


def test_prefix_hit_reuses_blocks_and_counts_them(tmp_path: Path) -> None:
    folder = random_llama_folder(tmp_path / "m")
    with Engine.load(str(folder), block_size=16) as e:
        first, _ = steps(e, PROMPT, 4)
        s1 = e.kv_stats()
        assert s1["used"] == 0 and s1["cached"] == 3  # 45 prompt + 3 fed reply tokens = 48: three full blocks
        events = list(e.generate(GenerationRequest(prompt_token_ids=PROMPT + first + [9, 9], sampling=SamplingParams(
            temperature=0.0, max_tokens=2, ignore_eos=True))))
        assert events[-1].usage.cached_prompt_tokens == 48
        s2 = e.kv_stats()
        assert s2["num_hit_tokens"] == 48 and 0 < s2["hit_rate"] < 1


def test_quantized_kv_error_shrinks_with_bits(tmp_path: Path, layout: str) -> None:
    """The kernels' own tests prove the quantized attention exact against its reference; here the engine
    wiring: 8-bit KV moves the first step's log-probabilities less than 4-bit, both a little. A random
    model's attention is sharp, so one prompt's error is noisy: the mean over four prompts is compared."""
    folder = random_llama_folder(tmp_path / "m", head_dim=64, hidden=128)
    prompts = [PROMPT] + [[(11 * i + 5 * s + 1) % 120 + 5 for i in range(40)] for s in range(3)]
    with Engine.load(str(folder), paged_kv=False) as ref:
        wanted = [steps(ref, p, 1) for p in prompts]
    err = {}
    for bits in (8, 4):
        errs = []
        with Engine.load(str(folder), kv_bits=bits, kv_group_size=32) as e:
            assert e.kv_stats()["kv_bits"] == bits
            for p, (want_tokens, want) in zip(prompts, wanted):
                tokens, lps = steps(e, p, 1)
                got = dict(zip(lps[0, :, 0].astype(int), lps[0, :, 1]))
                ref_lp = dict(zip(want[0, :, 0].astype(int), want[0, :, 1]))
                errs.append(max(abs(got[t] - ref_lp[t]) for t in want[0, :5, 0].astype(int) if t in got))
                if bits == 8:
                    assert tokens == want_tokens
        err[bits] = float(np.mean(errs))
    # measured (both layouts): 8-bit 0.11, 4-bit 1.58 as rotated; 0.23 and 1.88 smoothed as well (`kv.smoothing`,
    # once the runner calibrates at load: this random model's K/V have no offsets for it to take off)
    assert 0 < err[8] < err[4] / 3, err
    assert err[8] < 0.3 and err[4] < 2.5, err


def test_budget_smaller_than_one_block_is_refused(tmp_path: Path) -> None:
    folder = random_llama_folder(tmp_path / "m")
    with pytest.raises(RooflineError, match=r"kv_budget_bytes=1000: smaller than one KV block \(8192 bytes"):
        Engine.load(str(folder), kv_budget_bytes=1000)


@pytest.mark.parametrize("opts, message", [
    ({"kv_bits": 3}, r"kv_bits=3: expected 4, 8 or None"),
    ({"block_size": 24}, r"block_size=24: expected one of \(16, 32\)"),
    ({"kv_bits": 4, "kv_group_size": 48}, r"kv_group_size=48: expected 32 or 64"),
])
def test_bad_kv_options(tmp_path: Path, opts: dict, message: str) -> None:
    with pytest.raises(RooflineError, match=message):
        Engine.load(str(random_llama_folder(tmp_path / "m")), **opts)


def test_request_that_cannot_fit_the_budget_states_bytes(tmp_path: Path) -> None:
    folder = random_llama_folder(tmp_path / "m")
    with Engine.load(str(folder), kv_budget_bytes=4 * 8192) as e:  # 4 blocks = 64 tokens
        with pytest.raises(RequestError, match=r"needs KV for 75 tokens \(40,960 bytes\) but the KV budget holds "
                                                r"64 tokens \(32,768 bytes\)"):
            list(e.generate(GenerationRequest(prompt_token_ids=PROMPT, sampling=SamplingParams(max_tokens=30))))
        # a request that fits still runs on the same engine
        events = list(e.generate(GenerationRequest(prompt_token_ids=PROMPT[:20], sampling=SamplingParams(
            temperature=0.0, max_tokens=4, ignore_eos=True))))
        assert events[-1].finish_reason == "length"


def test_save_kv_writes_the_name_asked_for(tmp_path: Path) -> None:
    """A name without ".safetensors" is the file written (MLX's writer appends the suffix), and restores."""
    folder = random_llama_folder(tmp_path / "m")
    path = tmp_path / "chat.kv"
    with Engine.load(str(folder)) as a:
        reply, _ = steps(a, PROMPT, 6)
        assert a.save_kv(str(path), PROMPT + reply) == 48
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chat.kv", "m"]
    with Engine.load(str(folder)) as b:
        assert b.restore_kv(str(path)) == 48


def test_save_restore_round_trips_bit_exactly(tmp_path: Path, layout: str) -> None:
    folder = random_llama_folder(tmp_path / "m")
    path = str(tmp_path / "chat.kv.safetensors")
    with Engine.load(str(folder)) as a:
        reply, want = steps(a, PROMPT, 6)
        history = PROMPT + reply
        assert a.save_kv(path, history) == 48
        storage = a.diagnostics().cache.storage
        saved_slots = None
    with Engine.load(str(folder)) as b:
        assert b.restore_kv(path) == 48
        events = list(b.generate(GenerationRequest(prompt_token_ids=history + [5], sampling=SamplingParams(
            temperature=0.0, max_tokens=3, ignore_eos=True))))
        assert events[-1].usage.cached_prompt_tokens == 48
        # the restored K/V are the saved ones, bit for bit
        import mlx.core as mx

        got = mx.load(path)
        mgr = b.diagnostics().cache.manager
        from mlx_engine.kv.block_pool import hash_block_tokens

        parent, ids = None, []
        for i in range(3):
            parent = hash_block_tokens(parent, history[i * 16:(i + 1) * 16], mgr.extra_key)
            ids.append(mgr.pool.get_cached_block(parent, history[i * 16:(i + 1) * 16]).block_id)
        slots = mx.array([i * 16 + j for i in ids for j in range(16)])
        for layer in range(2):
            st = b.diagnostics().cache.storage
            assert mx.array_equal(st.read_slots(st.k[layer], slots), got[f"k.{layer}"]).item()
            assert mx.array_equal(st.read_slots(st.v[layer], slots), got[f"v.{layer}"]).item()
    del storage, saved_slots
    with Engine.load(str(folder), paged_kv=False) as ref:
        want_tokens, _ = steps(ref, history + [5], 3)
    assert [t for e in events for t in e.token_ids] == want_tokens


def test_restore_refuses_other_model_and_corrupt_files(tmp_path: Path) -> None:
    path = tmp_path / "chat.kv.safetensors"
    with Engine.load(str(random_llama_folder(tmp_path / "a", seed=1))) as a:
        steps(a, PROMPT, 4)
        a.save_kv(str(path), PROMPT)
    with Engine.load(str(random_llama_folder(tmp_path / "b", seed=2))) as b:  # same config, other weights
        with pytest.raises(RooflineError, match="made by another model"):
            b.restore_kv(str(path))
    with Engine.load(str(tmp_path / "a")) as a2:
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
        with pytest.raises(RooflineError, match=r"saved KV refused: .*truncated"):
            a2.restore_kv(str(path))
        path.write_bytes(b"not a kv file at all")
        with pytest.raises(RooflineError, match="saved KV refused"):
            a2.restore_kv(str(path))
        # the engine still serves
        tokens, _ = steps(a2, PROMPT, 2)
        assert len(tokens) == 2


def test_score_matches_forward_logits_paged_and_contiguous(tmp_path: Path) -> None:
    folder = random_llama_folder(tmp_path / "m")
    ids = PROMPT + PROMPT[:10]
    with Engine.load(str(folder), paged_kv=False) as ref:
        logits = ref.forward_logits(ids).astype(np.float64)
        want = (logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
                - logits.max(-1, keepdims=True))[np.arange(len(ids) - 1), ids[1:]]
        assert np.abs(ref.score(ids) - want).max() <= 1e-4
    with Engine.load(str(folder), prefill_chunk_size=13) as paged:
        got = paged.score(ids)
        assert got.shape == (len(ids) - 1,) and np.abs(got - want).max() <= 1e-4
        assert paged.kv_stats()["used"] == 0  # the scoring sequence freed its blocks


@pytest.mark.parametrize("paged", [True, False], ids=["paged", "contiguous"])
def test_prompt_logprobs_come_with_the_first_event(tmp_path: Path, paged: bool) -> None:
    """`SamplingParams.prompt_logprobs`: each prompt token but the first, its log-probability (`score`'s) and the
    top-k of the forward's distribution there, best first, on the first event; scored in the batch's prefill
    chunks, alone or packed beside a decoding request, and computed whole (no prefix hits), its blocks then
    cached for others. A reply that ends at once (EOS first) carries them on its final event."""
    folder = random_llama_folder(tmp_path / "m")
    ids = PROMPT + PROMPT[:10]
    with Engine.load(str(folder), paged_kv=False) as ref:
        logits = ref.forward_logits(ids).astype(np.float64)
        scores = ref.score(ids)
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=5)

    def check(lps) -> None:
        assert [lp.token_id for lp in lps] == ids[1:]
        # float32 floor: 3.2 units (tests/support/tolerance.py) on an AMD EPYC; x5 headroom
        assert_f32_close([lp.logprob for lp in lps], scores, 16, "prompt logprobs vs score")
        for t, lp in enumerate(lps):
            assert [i for i, _ in lp.top] == list(np.argsort(-logp[t])[:5])
            assert np.abs(np.array([v for _, v in lp.top]) - logp[t][[i for i, _ in lp.top]]).max() <= 1e-4

    with Engine.load(str(folder), prefill_chunk_size=13, block_size=16, paged_kv=paged) as e:
        for _ in range(2):  # the second time the prompt's blocks are cached, and still scored whole
            events = list(e.generate(GenerationRequest(prompt_token_ids=ids, sampling=params)))
            check(events[0].prompt_logprobs)
            assert all(ev.prompt_logprobs == () for ev in events[1:]) and events[-1].usage.cached_prompt_tokens == 0
        plain = list(e.generate(GenerationRequest(prompt_token_ids=ids, sampling=SamplingParams(max_tokens=1))))
        assert plain[0].prompt_logprobs == ()
        if paged:
            assert plain[-1].usage.cached_prompt_tokens == 48  # the scored prompt's 3 full blocks
            other = e.generate(GenerationRequest(prompt_token_ids=PROMPT[5:30], sampling=SamplingParams(
                temperature=0.0, max_tokens=20, ignore_eos=True)))
            next(other)  # decoding: the scored prompt's chunks pack beside its decode rows
            e.diagnostics().scheduler.trace = []
            events = list(e.generate(GenerationRequest(prompt_token_ids=ids, sampling=params)))
            list(other)
            assert any(rows and prefill for rows, prefill in e.diagnostics().scheduler.trace)
            check(events[0].prompt_logprobs)
            assert e.kv_stats()["used"] == 0
        eos = SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=0,
                             logit_bias={2: 100.0})  # token 2 is the tiny model's EOS
        events = list(e.generate(GenerationRequest(prompt_token_ids=ids, sampling=eos)))
        assert len(events) == 1 and events[0].finish_reason == "stop"
        assert [lp.token_id for lp in events[0].prompt_logprobs] == ids[1:]
        assert all(lp.top == () for lp in events[0].prompt_logprobs)
        # max_tokens=0: the prompt scored and nothing generated (legacy OpenAI scoring), alone or beside a decode
        only = SamplingParams(temperature=0.0, max_tokens=0, prompt_logprobs=5)
        other = e.generate(GenerationRequest(prompt_token_ids=PROMPT[3:20], sampling=SamplingParams(
            temperature=0.0, max_tokens=30, ignore_eos=True)))
        next(other)  # decoding
        e.diagnostics().scheduler.trace = []
        for _ in range(2):
            events = list(e.generate(GenerationRequest(prompt_token_ids=ids, sampling=only)))
            assert len(events) == 1 and events[0].finish_reason == "length" and events[0].token_ids == ()
            assert events[0].usage.completion_tokens == 0 and events[0].usage.prompt_tokens == len(ids)
            check(events[0].prompt_logprobs)
        assert len([t for ev in other for t in ev.token_ids]) == 29
        trace = e.diagnostics().scheduler.trace
        assert not paged or (e.kv_stats()["used"] == 0 and any(rows and prefill for rows, prefill in trace))


def test_pool_memory_grows_with_use_and_numbers_stay_exact(tmp_path: Path, monkeypatch) -> None:
    """The pool commits memory as blocks are first used (doubling), not the whole budget at load."""
    import mlx_engine.kv.paged as paged

    monkeypatch.setattr(paged, "INITIAL_BLOCKS", 1)
    folder = random_llama_folder(tmp_path / "m")
    with Engine.load(str(folder), paged_kv=False) as ref:
        want_tokens, want = steps(ref, PROMPT, 30)
    with Engine.load(str(folder)) as e:
        s0 = e.kv_stats()
        assert s0["bytes_total"] == s0["bytes_per_block"] < s0["bytes_budget"]
        tokens, lps = steps(e, PROMPT, 30)  # 75 tokens in 5 blocks: capacity 1, then 3 (prompt), then 6
        s1 = e.kv_stats()
        assert s1["bytes_total"] == 6 * s1["bytes_per_block"]
    assert tokens == want_tokens and float(np.abs(lps[..., 1] - want[..., 1]).max()) <= 1e-5


def test_hadamard_is_orthonormal() -> None:
    import mlx.core as mx

    from mlx_engine.kv.paged import hadamard

    for n in (1, 2, 16, 64, 128):
        h = np.array(hadamard(n))
        np.testing.assert_allclose(h @ h.T, np.eye(n), atol=1e-6)
        assert set(np.unique(np.abs(h) * np.sqrt(n)).round(6)) == {1.0}
    assert mx.array(hadamard(4)).shape == (4, 4)


@pytest.mark.parametrize("bits", [4, 8])
def test_rotated_quantized_keys_keep_scores_and_beat_plain_on_outlier_channels(bits: int) -> None:
    """Keys with one outlier RoPE pair (channels 5 and 37 of a 64-dim head: a large, steady norm whose phase
    turns with the position, as in SmolLM2's keys): the rotated storage's scores q . k are
    closer (about 2x here) to the float scores than the same keys quantized unrotated."""
    import mlx.core as mx

    from mlx_engine.kv.paged import PagedKVStorage

    rng = np.random.default_rng(0)
    n, hkv, d = 64, 2, 64
    k = rng.normal(size=(n, hkv, d)).astype(np.float32)
    phase = 0.3 * np.arange(n)[:, None]
    k[:, :, 5] += 30.0 * np.cos(phase)
    k[:, :, 37] += 30.0 * np.sin(phase)
    v = rng.normal(size=(n, hkv, d)).astype(np.float32)
    q = rng.normal(size=(hkv, d)).astype(np.float32)
    exact = np.einsum("hd,nhd->hn", q, k)
    errors = {}
    for rotated in (True, False):
        st = PagedKVStorage(1, 8, 16, hkv, d, mx.float32, bits=bits, group_size=32, rotation=rotated)
        got, values = stored_scores(st, k, v, q)
        errors[rotated] = np.abs(got - exact).max()
        # values come back rotated too; `outputs` maps them back (here each "output" is one value)
        back = np.array(st.outputs(0, values[None]))[0]  # (Hkv, n, D)
        np.testing.assert_allclose(back.transpose(1, 0, 2), v, atol=0.5 if bits == 4 else 0.03)
    # measured: 4-bit 3.76 vs 8.78, 8-bit 0.26 vs 0.47, on scores up to 64
    assert errors[True] < errors[False] / 1.7, errors
    assert errors[True] < (0.07 if bits == 4 else 0.005) * np.abs(exact).max(), errors


# --- keys at other bits than values (kv_key_bits) ---

MIXED = {"kv_bits": 4, "kv_key_bits": 8, "kv_group_size": 32}


def saved_arrays(engine: Engine, path: Path, ids: list[int]) -> dict:
    """The token-major K/V (and scales, biases) of the cached full blocks of `ids`, as save_kv writes them."""
    import mlx.core as mx

    engine.save_kv(str(path), ids)
    return mx.load(str(path))


def test_key_bits_store_keys_and_values_at_their_own_bits(tmp_path: Path, layout: str) -> None:
    """Layer 0's K and V depend on the prompt only, not on the cache: with 8-bit keys and 4-bit values they are
    bit for bit the 8-bit run's keys and the 4-bit run's values."""
    import mlx.core as mx

    folder = random_llama_folder(tmp_path / "m", head_dim=64, hidden=128)
    got = {}
    for name, opts in (("mixed", MIXED), ("8", {"kv_bits": 8, "kv_group_size": 32}),
                       ("4", {"kv_bits": 4, "kv_group_size": 32, "kv_key_per_channel": False})):
        with Engine.load(str(folder), **opts) as e:
            steps(e, PROMPT, 1)
            got[name] = saved_arrays(e, tmp_path / f"{name}.kv.safetensors", PROMPT)
    mixed = got["mixed"]
    assert mixed["k.1"].shape == (32, 2, 64 * 8 // 32) and mixed["v.1"].shape == (32, 2, 64 * 4 // 32)
    for field in ("k", "k_scales", "k_biases"):
        assert mx.array_equal(mixed[f"{field}.0"], got["8"][f"{field}.0"]).item(), field
    for field in ("v", "v_scales", "v_biases"):
        assert mx.array_equal(mixed[f"{field}.0"], got["4"][f"{field}.0"]).item(), field


def test_key_bits_logits_lie_between_8bit_and_4bit(tmp_path: Path, layout: str) -> None:
    """8-bit keys with 4-bit values against the all-8-bit run: closer than all-4-bit. On SmolLM2 the keys are
    the sensitive half (bench/kv.py, figure 4); a random tiny model's values matter about as much, so here
    only the order is asserted. The mean over four prompts' first-step top-5 log-probabilities."""
    folder = random_llama_folder(tmp_path / "m", head_dim=64, hidden=128)
    prompts = [PROMPT] + [[(11 * i + 5 * s + 1) % 120 + 5 for i in range(40)] for s in range(3)]
    runs = {}
    for name, opts in (("8", {"kv_bits": 8, "kv_group_size": 32}), ("mixed", MIXED),
                       ("4", {"kv_bits": 4, "kv_group_size": 32, "kv_key_per_channel": False})):
        with Engine.load(str(folder), **opts) as e:
            runs[name] = [steps(e, p, 1)[1][0] for p in prompts]  # (20, 2) per prompt

    def err(name: str) -> float:
        errs = []
        for got, want in zip(runs[name], runs["8"]):
            lp = dict(zip(got[:, 0].astype(int), got[:, 1]))
            errs.append(max(abs(lp[t] - w) for t, w in zip(want[:5, 0].astype(int), want[:5, 1]) if t in lp))
        return float(np.mean(errs))

    # measured (both layouts): mixed 1.07, 4-bit 1.43
    assert 0 < err("mixed") < 0.85 * err("4"), (err("mixed"), err("4"))


def test_kv_stats_and_bytes_per_block_with_key_bits(tmp_path: Path) -> None:
    from mlx_engine.kv.paged import bytes_per_block
    from mlx_engine.memory import KVShape, kv_bytes

    folder = random_llama_folder(tmp_path / "m", head_dim=64, hidden=128)  # 2 layers, 2 KV heads, float32
    # a block: 16 tokens x 2 layers x 2 heads x (K: 64 bytes + 2 x 2 groups x 4 bytes; V: 32 + 16)
    assert bytes_per_block(2, 16, 2, 64, 4, 4, 32, key_bits=8) == 16 * 2 * 2 * ((64 + 16) + (32 + 16)) == 8192
    assert kv_bytes(KVShape(2, 2, 64, 0), 16, 1, 4, 4, 32, key_bits=8) == 8192
    assert kv_bytes(KVShape(2, 2, 64, 0), 16, 1, 4, 4, 32, key_bits=4) == kv_bytes(KVShape(2, 2, 64, 0), 16, 1, 4, 4,
                                                                                   32) == 6144
    with Engine.load(str(folder), **MIXED) as e:
        s = e.kv_stats()
        assert (s["kv_bits"], s["kv_key_bits"], s["bytes_per_block"]) == (4, 8, 8192)
        storage = e.diagnostics().cache.storage
        assert s["bytes_total"] == storage.nbytes == storage.capacity * 8192  # the formula is what is stored
    with Engine.load(str(folder), kv_bits=8, kv_group_size=32) as e:
        s = e.kv_stats()
        assert (s["kv_bits"], s["kv_key_bits"], s["bytes_per_block"]) == (8, 8, 10240)
    with Engine.load(str(folder)) as e:
        assert (e.kv_stats()["kv_bits"], e.kv_stats()["kv_key_bits"]) == (None, None)


def test_save_restore_round_trips_bit_exactly_with_key_bits(tmp_path: Path, layout: str) -> None:
    import mlx.core as mx

    from mlx_engine.kv.block_pool import hash_block_tokens

    folder = random_llama_folder(tmp_path / "m", head_dim=64, hidden=128)
    path = str(tmp_path / "chat.kv.safetensors")
    with Engine.load(str(folder), **MIXED) as a:
        reply, _ = steps(a, PROMPT, 6)
        history = PROMPT + reply
        assert a.save_kv(path, history) == 48
    saved, meta = mx.load(path, return_metadata=True)
    assert (meta["kv_bits"], meta["kv_key_bits"]) == ("4", "8")
    with Engine.load(str(folder), **MIXED) as b:
        assert b.restore_kv(path) == 48
        events = list(b.generate(GenerationRequest(prompt_token_ids=history + [5], sampling=SamplingParams(
            temperature=0.0, max_tokens=3, ignore_eos=True))))
        assert events[-1].usage.cached_prompt_tokens == 48
        mgr, st = b.diagnostics().cache.manager, b.diagnostics().cache.storage
        parent, ids = None, []
        for i in range(3):
            parent = hash_block_tokens(parent, history[i * 16:(i + 1) * 16], mgr.extra_key)
            ids.append(mgr.pool.get_cached_block(parent, history[i * 16:(i + 1) * 16]).block_id)
        slots = mx.array([i * 16 + j for i in ids for j in range(16)])
        for name in ("k", "v", "k_scales", "k_biases", "v_scales", "v_biases"):
            for layer in range(2):
                assert mx.array_equal(st.read_slots(getattr(st, name)[layer], slots), saved[f"{name}.{layer}"]).item()


def test_restore_refuses_other_key_bits(tmp_path: Path) -> None:
    """A file with other key bits is refused; a file from before kv_key_bits (no such field) has key bits ==
    kv_bits."""
    import mlx.core as mx

    folder = random_llama_folder(tmp_path / "m", head_dim=64, hidden=128)
    mixed_path, plain_path = tmp_path / "mixed.kv.safetensors", tmp_path / "plain.kv.safetensors"
    with Engine.load(str(folder), **MIXED) as a:
        steps(a, PROMPT, 4)
        a.save_kv(str(mixed_path), PROMPT)
    with Engine.load(str(folder), kv_bits=4, kv_group_size=32, kv_key_per_channel=False) as a:
        steps(a, PROMPT, 4)
        a.save_kv(str(plain_path), PROMPT)
    arrays, meta = mx.load(str(plain_path), return_metadata=True)
    del meta["kv_key_bits"]  # as written before the field existed
    mx.save_safetensors(str(plain_path), arrays, metadata=meta)
    with Engine.load(str(folder), kv_bits=4, kv_group_size=32, kv_key_per_channel=False) as plain:
        with pytest.raises(RooflineError, match=r"saved KV refused: .* has kv_key_bits=8, this engine uses 4"):
            plain.restore_kv(str(mixed_path))
        assert plain.restore_kv(str(plain_path)) == 32
    with Engine.load(str(folder), **MIXED) as mixed:
        with pytest.raises(RooflineError, match=r"saved KV refused: .* has kv_key_bits=4, this engine uses 8"):
            mixed.restore_kv(str(plain_path))
        tokens, _ = steps(mixed, PROMPT, 2)  # the engine still serves
        assert len(tokens) == 2


@pytest.mark.parametrize("opts, message", [
    ({"kv_bits": 4, "kv_key_bits": 3}, r"kv_key_bits=3: expected 4, 8 or None \(the keys take kv_bits\)"),
    ({"kv_key_bits": 8}, r"kv_key_bits=8: only valid with kv_bits set \(4 or 8\)"),
    ({"kv_key_bits": 3}, r"kv_key_bits=3: expected 4, 8 or None"),
    ({"kv_key_bits": 8, "paged_kv": False}, r"kv_key_bits needs the paged KV cache, which is off here"),
])
def test_bad_kv_key_bits(tmp_path: Path, opts: dict, message: str) -> None:
    with pytest.raises(RooflineError, match=message):
        Engine.load(str(random_llama_folder(tmp_path / "m", head_dim=64, hidden=128)), kv_group_size=32, **opts)


def test_torch_backend_refuses_kv_key_bits(tmp_path: Path) -> None:
    from tests.support.torch_support import require

    require("torch")
    with pytest.raises(RooflineError, match=r"kv_key_bits is not supported on the torch backend .*unquantized"):
        Engine.load(str(random_llama_folder(tmp_path / "m")), backend="torch", kv_key_bits=8)


def test_a_next_turn_in_two_runs_of_blocks_is_read_in_place_and_equals_contiguous(
        tmp_path: Path, layout: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A next turn reuses its cached prefix's blocks and gets new blocks from the free queue's head, which do
    not follow them where the last turn's next block is cached: the CPU path attends to each run of blocks as a
    slice of the pool (no gather), with the same numbers as a contiguous cache."""
    import mlx_engine.kv.cache as kv_cache
    from mlx_engine.attention import host

    monkeypatch.setattr(host, "HOST_ATTENTION_MIN_PAIRS", 1)  # the numpy path even for this tiny model
    seen: list = []
    slots = kv_cache.PagedCache._slots
    monkeypatch.setattr(kv_cache.PagedCache, "_slots",
                        lambda self, r, n, start=0: seen.append(slots(self, r, n, start)) or seen[-1])
    folder = random_llama_folder(tmp_path / "m")
    with Engine.load(str(folder), block_size=16, prefill_chunk_size=7) as e:
        first, _ = steps(e, PROMPT, 20)  # 64 tokens fed: blocks 0-3 full and cached
        turn2 = PROMPT + first[:3] + [(5 * i + 1) % 120 + 5 for i in range(20)]  # 68 tokens, 48 cached
        seen.clear()
        tokens, lps = steps(e, turn2, 6)
    with Engine.load(str(folder), paged_kv=False) as ref:
        want_tokens, want = steps(ref, turn2, 6)
    assert tokens == want_tokens
    assert np.array_equal(lps[..., 0], want[..., 0])
    # float32 floor: 10.5 units (tests/support/tolerance.py) on an AMD EPYC; x5 headroom
    assert_f32_close(lps[..., 1], want[..., 1], 48, "next turn in place vs contiguous")
    # prefill chunks of 7 from position 48, then decode; blocks 0-2 hold the cached 48 tokens, the first
    # request's block 3 (other tokens from 48) is cached at the free queue's tail, so the new tokens are in
    # blocks 4 and 5
    assert seen[0] == [slice(0, 48), slice(64, 71)]
    assert seen[-1] == [slice(0, 48), slice(64, 64 + 73 - 48)]  # the last step's query at position 72


@pytest.mark.parametrize("bits", [None, 8])
def test_cpu_batched_decode_attention_equals_per_sequence_attention(bits: int | None) -> None:
    """Three sequences of different lengths over scattered blocks, GQA 6 over 2 heads: the CPU decode path
    (numpy over the head-major pool, padded tables masked by length) equals plain attention of each
    sequence's own K/V as the pool holds them."""
    import mlx.core as mx

    from mlx_engine.kv.paged import PagedKVStorage
    from mlx_engine.kv.views import DecodeStep

    rng = np.random.default_rng(4)
    hq, hkv, d, bs = 6, 2, 32, 16
    st = PagedKVStorage(1, 8, bs, hkv, d, mx.float32, bits=bits, group_size=32, head_major=True)
    slots = mx.arange(8 * bs, dtype=mx.int32)
    st.write(0, slots, mx.array(rng.normal(size=(8 * bs, hkv, d)).astype(np.float32)),
             mx.array(rng.normal(size=(8 * bs, hkv, d)).astype(np.float32)))
    tables, lens = [[5, 1, 6], [2, 0, 0], [7, 3, 4]], [40, 9, 33]  # padded with block 0
    q = rng.normal(size=(3, hq, d)).astype(np.float32)
    step = DecodeStep(st, mx.array(lens) - 1, mx.zeros(3, mx.int32), mx.array(tables, dtype=mx.int32),
                      mx.array(lens, dtype=mx.int32), max(lens))
    assert step.path.name == "decode-host"
    got = np.array(step.path.run(step, 0, mx.array(q)[:, :, None], 0.2))[:, :, 0]
    for b, (table, n) in enumerate(zip(tables, lens)):
        ids = np.array([blk * bs + i for blk in table for i in range(bs)][:n])
        k, v = (np.array(x) for x in st.gather(0, mx.array(ids, dtype=mx.int32)))  # (Hkv, n, D)
        s = np.einsum("hgd,hnd->hgn", q[b].reshape(hkv, hq // hkv, d), k) * 0.2
        p = np.exp(s - s.max(-1, keepdims=True))
        want = np.einsum("hgn,hnd->hgd", p / p.sum(-1, keepdims=True), v).reshape(hq, d)
        np.testing.assert_allclose(got[b], want, rtol=1e-5, atol=1e-6)


# --- keys quantized per channel (kv_key_per_channel) ---

CHANNEL = {"kv_bits": 4, "kv_group_size": 32, "kv_key_per_channel": True}


def check_channel_blocks(keys: np.ndarray, scales: np.ndarray, biases: np.ndarray, want: np.ndarray, bits: int,
                         bs: int) -> None:
    """keys: dequantized (n, Hkv, D) of whole blocks; scales/biases per (block, head, channel) (nb, Hkv, D); want:
    the true keys of the blocks' valid tokens (m <= n, the last block may be partial). Each block's bias is its
    channel's minimum over the block's valid tokens and its scale the range / (2^bits - 1), to float32 rounding,
    and every key lies within half a step of the truth."""
    for blk in range(-(-want.shape[0] // bs)):
        w = want[blk * bs:(blk + 1) * bs]  # (valid, Hkv, D)
        # float32 floor: 2.9 units (tests/support/tolerance.py) on an AMD EPYC; x6 headroom
        assert_f32_close(biases[blk], w.min(0), 16, "channel biases")
        # float32 floor: 2.8 units (tests/support/tolerance.py) on an AMD EPYC; x6 headroom
        assert_f32_close(scales[blk], (w.max(0) - w.min(0)) / (2**bits - 1), 16, "channel scales")
        err = np.abs(keys[blk * bs:blk * bs + len(w)] - w)
        assert (err <= scales[blk] / 2 + 1e-5).all(), float(err.max())


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("head_major", [True, False])
def test_channel_keys_are_quantized_per_channel_over_each_block_as_it_fills(bits: int, head_major: bool) -> None:
    """45 tokens over scattered blocks 3, 5, 1, written in prefill chunks of 7, then one token a step: after every
    write each block's scales and biases are its channels' range over the tokens it holds (a partial block's too),
    every read path gives the same keys, and the float staging of a block is released once its sequence writes past
    it."""
    import mlx.core as mx

    from kernels_metal.reference import channel_params
    from mlx_engine.kv.paged import PagedKVStorage

    rng = np.random.default_rng(5)
    hkv, d, bs = 2, 32, 16
    st = PagedKVStorage(1, 8, bs, hkv, d, mx.float32, bits=bits, group_size=32, head_major=head_major,
                        key_per_channel=True)
    keys = (rng.normal(size=(45, hkv, d)) * rng.uniform(0.1, 8, size=(1, hkv, d))).astype(np.float32)
    table = [3, 5, 1]
    slot = [table[p // bs] * bs + p % bs for p in range(45)]
    bounds = [(a, min(a + 7, 40)) for a in range(0, 40, 7)] + [(p, p + 1) for p in range(40, 45)]
    for a, b in bounds:
        plan = st.plan_key_writes([("r", s) for s in slot[a:b]])
        st.write(0, mx.array(slot[a:b], dtype=mx.int32), mx.array(keys[a:b]), mx.zeros((b - a, hkv, d)), plan)
        nb = -(-b // bs)
        whole = mx.array([table[i] * bs + j for i in range(nb) for j in range(bs)], dtype=mx.int32)
        s, z = (np.array(channel_params(st.read_slots(x[0], whole).reshape(nb, bs, hkv, -1)))
                for x in (st.k_scales, st.k_biases))
        got = np.array(st.gather(0, whole, whole_blocks=True)[0]).swapaxes(0, 1)  # (nb * bs, Hkv, D)
        check_channel_blocks(got, s, z, keys[:b], bits, bs)
        ids = np.array(st.gather(0, mx.array(slot[:b], dtype=mx.int32))[0]).swapaxes(0, 1)  # any ids
        np.testing.assert_array_equal(ids, got[[i for i in range(nb * bs) if i % bs + i // bs * bs < b]])
        assert set(st._stages) == {table[(b - 1) // bs]} | ({table[(a - 1) // bs]} if a % bs and a // bs < (b - 1) // bs
                                                           else set())
    if head_major:  # the in-place runs the CPU decode reads
        runs = [slice(48, 64), slice(80, 96), slice(16, 29)]
        pieces = [np.array(st.gather(0, r)[0]).swapaxes(0, 1) for r in runs]
        np.testing.assert_array_equal(np.concatenate(pieces), ids)
    assert len(st._stages) == 1 and st._stage_capacity == 4
    st.release_key_stages("r")
    assert st._stages == {} and sorted(st._free_stages) == [0, 1, 2, 3]


def test_channel_keys_through_the_engine_match_the_model_keys(tmp_path: Path, layout: str) -> None:
    """Layer 0's keys depend on the tokens only: after prefill chunks of 7 and 12 decode steps with 4-bit
    per-channel keys (block size 32), every saved block is the per-channel quantization of a contiguous run's
    keys over the same tokens; the values are per-token 4-bit as before (the same bytes as a per-token run's)."""
    import mlx.core as mx

    from kernels_metal.reference import channel_params, unpack_codes

    folder = random_llama_folder(tmp_path / "m", head_dim=64, hidden=128)
    with Engine.load(str(folder), block_size=32, prefill_chunk_size=7, **CHANNEL) as e:
        assert e.kv_stats()["kv_key_per_channel"] is True
        reply, _ = steps(e, PROMPT + [9] * 8, 12)
        history = PROMPT + [9] * 8 + reply  # 65 tokens: two full blocks saved
        saved = saved_arrays(e, tmp_path / "c.kv.safetensors", history)
        assert e.kv_stats()["used"] == 0 and e.diagnostics().cache.storage._stages == {}
    with Engine.load(str(folder), block_size=32, prefill_chunk_size=7, kv_bits=4, kv_group_size=32,
                     kv_key_per_channel=False) as e:
        steps(e, PROMPT + [9] * 8, 1)
        per_token = saved_arrays(e, tmp_path / "t.kv.safetensors", PROMPT + [9] * 8)
    with Engine.load(str(folder), paged_kv=False) as ref:
        steps(ref, history[:-1], 1)
        diag = ref.diagnostics()
        want = diag.call(lambda: np.array(diag.cache._layers[0].keys[0, :, :64]))  # (Hkv, 64, D)
    s, z = (np.array(channel_params(saved[f"{n}.0"].reshape(2, 32, 2, -1))) for n in ("k_scales", "k_biases"))
    got = np.array(unpack_codes(saved["k.0"], 4).reshape(2, 32, 2, 64) * mx.array(s)[:, None]
                   + mx.array(z)[:, None]).reshape(64, 2, 64)
    check_channel_blocks(got, s, z, want.swapaxes(0, 1), 4, 32)
    for field in ("v", "v_scales", "v_biases"):
        assert mx.array_equal(saved[f"{field}.0"][:32], per_token[f"{field}.0"][:32]).item(), field


def test_channel_keys_read_alike_on_both_layouts_and_beat_per_token_at_8_bits(tmp_path: Path) -> None:
    """The CPU's head-major pools (in-place runs, numpy decode) and the kernel's token-major ones (its reference
    path) read the same per-channel keys: equal log-probabilities. 8-bit keys per channel stay close to
    unquantized KV (measured max 0.04 on the first step's top 5)."""
    import mlx_engine.kv.paged as paged

    folder = random_llama_folder(tmp_path / "m", head_dim=64, hidden=128)
    with Engine.load(str(folder), paged_kv=False) as ref:
        _, want = steps(ref, PROMPT, 1)
    runs = {}
    for head_major in (True, False):
        init = paged.PagedKVStorage.__init__
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(paged.PagedKVStorage, "__init__",
                       lambda self, *a, **k: init(self, *a, **{**k, "head_major": head_major}))
            with Engine.load(str(folder), block_size=16, prefill_chunk_size=7, kv_bits=8, kv_group_size=32,
                             kv_key_per_channel=True) as e:
                runs[head_major] = steps(e, PROMPT, 6)
    assert runs[True][0] == runs[False][0]
    assert float(np.abs(runs[True][1][..., 1] - runs[False][1][..., 1]).max()) <= 1e-5
    first = dict(zip(runs[True][1][0, :, 0].astype(int), runs[True][1][0, :, 1]))
    assert max(abs(first[int(t)] - w) for t, w in want[0, :5]) < 0.1


def test_channel_keys_prefix_hits_read_the_same(tmp_path: Path) -> None:
    """A prompt of exactly three full blocks asked twice: the second request takes two from the cache and
    recomputes the third into a fresh block (staged afresh). Same tokens and log-probabilities as the first
    request, and a next turn reuses the blocks as well."""
    folder = random_llama_folder(tmp_path / "m", head_dim=64, hidden=128)
    prompt = PROMPT + [9, 10, 11]  # 48 tokens
    with Engine.load(str(folder), block_size=16, **CHANNEL) as e:
        first = steps(e, prompt, 5)
        events = list(e.generate(GenerationRequest(prompt_token_ids=prompt, sampling=SamplingParams(
            temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=20))))
        assert events[-1].usage.cached_prompt_tokens == 32
        second = steps(e, prompt, 5)
        assert first[0] == second[0]
        # float32 floor: 30.8 units (tests/support/tolerance.py) on an AMD EPYC; x4 headroom
        assert_f32_close(second[1][..., 1], first[1][..., 1], 128, "prefix hit vs first")
        longer = prompt + first[0] + [12]
        events = list(e.generate(GenerationRequest(prompt_token_ids=longer, sampling=SamplingParams(
            temperature=0.0, max_tokens=2, ignore_eos=True))))
        assert events[-1].usage.cached_prompt_tokens == 48
        assert e.kv_stats()["used"] == 0 and e.diagnostics().cache.storage._stages == {}


def test_channel_keys_save_restore_round_trip_and_refuse_per_token_files(tmp_path: Path) -> None:
    import mlx.core as mx

    folder = random_llama_folder(tmp_path / "m", head_dim=64, hidden=128)
    path, token_path = str(tmp_path / "c.kv.safetensors"), str(tmp_path / "t.kv.safetensors")
    with Engine.load(str(folder), **CHANNEL) as a:
        reply, lps = steps(a, PROMPT, 6)
        history = PROMPT + reply
        assert a.save_kv(path, history) == 48
        _, again = steps(a, history + [5], 3)
    with Engine.load(str(folder), kv_bits=4, kv_group_size=32, kv_key_per_channel=False) as t:
        steps(t, PROMPT, 4)
        t.save_kv(token_path, PROMPT)
        with pytest.raises(RooflineError, match=r"saved KV refused: .* has kv_key_grouping=channel, this engine uses "
                                                r"token"):
            t.restore_kv(path)
    saved, meta = mx.load(path, return_metadata=True)
    assert (meta["kv_key_grouping"], meta["key_rotation"], meta["value_rotation"]) == ("channel", "none", "hadamard")
    assert saved["k_scales.0"].shape == (48, 2, 64 // 16)  # D channel scales of a block over its 16 slots
    with Engine.load(str(folder), **CHANNEL) as b:
        with pytest.raises(RooflineError, match=r"saved KV refused: .* has kv_key_grouping=token, this engine uses "
                                                r"channel"):
            b.restore_kv(token_path)
        assert b.restore_kv(path) == 48
        events = list(b.generate(GenerationRequest(prompt_token_ids=history + [5], sampling=SamplingParams(
            temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=20))))
        assert events[-1].usage.cached_prompt_tokens == 48
        got = np.array([[list(t) for t in lp.top] for e in events for lp in e.logprobs])
        assert np.array_equal(got[..., 0], again[..., 0])
        # float32 floor: 4.5 units (tests/support/tolerance.py) on an AMD EPYC; x5 headroom
        assert_f32_close(got[..., 1], again[..., 1], 24, "restored vs before")


def test_kv_bytes_of_channel_keys(tmp_path: Path) -> None:
    from mlx_engine.kv.paged import bytes_per_block
    from mlx_engine.memory import KVShape, kv_bytes

    folder = random_llama_folder(tmp_path / "m", head_dim=64, hidden=128)  # 2 layers, 2 KV heads, float32
    # a block of 32 tokens x 2 layers x 2 heads: K 32 bytes + 2 x (64 / 32) x 4 (a scale and bias per channel per
    # 32 tokens), V 32 + 2 x 2 x 4
    assert bytes_per_block(2, 32, 2, 64, 4, 4, 32, key_per_channel=True) == 32 * 2 * 2 * (48 + 48) == 12288
    assert kv_bytes(KVShape(2, 2, 64, 0), 32, 1, 4, 4, 64, key_group_size=16) == 32 * 2 * 2 * ((32 + 32) + (32 + 8))
    with Engine.load(str(folder), block_size=32, **CHANNEL) as e:
        s = e.kv_stats()
        assert (s["kv_bits"], s["kv_key_per_channel"], s["bytes_per_block"]) == (4, True, 12288)
        storage = e.diagnostics().cache.storage
        assert s["bytes_total"] == storage.nbytes == storage.capacity * 12288
        assert s["bytes_staging"] == 0
        steps(e, PROMPT, 2)
        # one sequence's staging: 4 stages (the first allocation) x 32 tokens x 2 layers x 2 heads x 64 x 4 bytes
        assert e.kv_stats()["bytes_staging"] == 4 * 32 * 2 * 2 * 64 * 4


@pytest.mark.parametrize("opts, message", [
    ({"kv_key_per_channel": True}, r"kv_key_per_channel=True: only valid with kv_bits set"),
    ({"kv_bits": 4, "kv_key_per_channel": "yes"}, r"kv_key_per_channel='yes': expected True, False or None \(auto\)"),
    ({"kv_key_per_channel": True, "paged_kv": False},
     r"kv_key_per_channel needs the paged KV cache, which is off here"),
])
def test_bad_kv_key_per_channel(tmp_path: Path, opts: dict, message: str) -> None:
    with pytest.raises(RooflineError, match=message):
        Engine.load(str(random_llama_folder(tmp_path / "m", head_dim=64, hidden=128)), kv_group_size=32, **opts)


def test_channel_keys_need_a_block_size_dividing_the_head_dim(tmp_path: Path) -> None:
    folder = random_llama_folder(tmp_path / "m", head_dim=16)
    with pytest.raises(RooflineError, match=r"kv_key_per_channel=True: .* block size must divide the head dim 16; "
                                            r"got block_size=32"):
        Engine.load(str(folder), block_size=32, kv_bits=4, kv_group_size=32, kv_key_per_channel=True)


def test_channel_keys_read_the_same_whatever_the_prefill_chunks(tmp_path: Path) -> None:
    """A query reads its own block quantized over the keys up to it, never over later keys of its chunk: prefill
    chunks of 1 (as decode steps), 7 and the whole prompt give the same log-probabilities (to float32 rounding of
    the different matrix shapes)."""
    folder = random_llama_folder(tmp_path / "m", head_dim=64, hidden=128)
    runs = {}
    for chunk in (1, 7, 512):
        with Engine.load(str(folder), prefill_chunk_size=chunk, block_size=16, **CHANNEL) as e:
            runs[chunk] = steps(e, PROMPT, 6)
    for chunk in (7, 512):
        assert runs[chunk][0] == runs[1][0]
        # float32 floor: 30.8 units (tests/support/tolerance.py) on an AMD EPYC; x4 headroom
        assert_f32_close(runs[chunk][1][..., 1], runs[1][1][..., 1], 128, f"chunk {chunk} vs 1")


def test_attention_with_own_block_keys_host_and_mlx_paths_agree() -> None:
    """`sdpa(..., own=...)`: the numpy path (MLX's CPU backend, float32) and the MLX-ops path (Metal, half
    precision) compute the same attention, and it equals attention over the keys with each query's own
    columns replaced, computed naively."""
    import mlx.core as mx

    from mlx_engine.attention.host import _sdpa_own_mlx, sdpa

    rng = np.random.default_rng(2)
    hq, hkv, d, L, S, bs = 6, 2, 32, 9, 21, 8  # queries at positions 12..20; own blocks of 8 columns
    q = rng.normal(size=(1, hq, L, d)).astype(np.float32)
    k, v = (rng.normal(size=(1, hkv, S, d)).astype(np.float32) for _ in range(2))
    pos = np.arange(S - L, S)
    cols = (pos // bs * bs)[:, None] + np.arange(bs)[None, :]  # the last block reaches column 23 > S - 1
    own_keys = rng.normal(size=(hkv, L, bs, d)).astype(np.float32)
    segments = ([mx.array(k[:, :, :10]), mx.array(k[:, :, 10:])], [mx.array(v[:, :, :10]), mx.array(v[:, :, 10:])])
    own = (mx.array(cols.astype(np.int32)), mx.array(own_keys), int(cols.max()) + 1)
    host = np.array(sdpa(mx.array(q), *segments, 0.3, causal=True, own=own))
    via_mlx = np.array(_sdpa_own_mlx(mx.array(q), *segments, 0.3, own))
    want = np.zeros_like(host)
    for h in range(hq):
        g = h // (hq // hkv)
        for i in range(L):
            keys = k[0, g].copy()
            for w in range(bs):
                if cols[i, w] < S:
                    keys[cols[i, w]] = own_keys[g, i, w]
            sc = keys[:pos[i] + 1] @ q[0, h, i] * 0.3
            p = np.exp(sc - sc.max())
            want[0, h, i] = (p / p.sum()) @ v[0, g, :pos[i] + 1]
    np.testing.assert_allclose(host, want, atol=1e-5)
    np.testing.assert_allclose(via_mlx, want, atol=1e-5)


@pytest.mark.parametrize("opts, per_channel", [
    ({"kv_bits": 4}, True), ({"kv_bits": 4, "block_size": 32}, True), ({"kv_bits": 8}, False),
    ({"kv_bits": 4, "kv_key_bits": 8}, False), ({"kv_bits": 8, "kv_key_bits": 4}, True),
    ({"kv_bits": 4, "kv_key_per_channel": False}, False), ({"kv_bits": 8, "kv_key_per_channel": True}, True),
    ({}, False),
])
def test_keys_are_quantized_per_channel_by_default_at_4_bits(tmp_path: Path, opts: dict, per_channel: bool) -> None:
    folder = random_llama_folder(tmp_path / "m", head_dim=64, hidden=128)
    with Engine.load(str(folder), **opts) as e:
        assert e.kv_stats()["kv_key_per_channel"] is per_channel
        assert e.diagnostics().cache.storage.key_per_channel is per_channel


def test_channel_keys_decode_through_the_metal_kernel_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Token-major pools (a Mac's layout) with per-channel keys, two sequences decoding together: steps through the
    Metal kernel's own source, run by the interpreter, give the log-probabilities of its MLX-ops reference (the
    same engine wiring)."""
    import kernels_metal.paged_attention as pa
    import mlx_engine.kv.paged as paged
    from kernels_metal import _backend

    if not _backend.interpret_available():
        pytest.skip("the Metal interpreter is not importable")
    init = paged.PagedKVStorage.__init__
    monkeypatch.setattr(paged.PagedKVStorage, "__init__", lambda self, *a, **k: init(self, *a, **{**k, "head_major": False}))
    launches = []
    kernels = pa._interpret_kernels

    def counted():
        launches.append(1)
        return kernels()

    monkeypatch.setattr(pa, "_interpret_kernels", counted)
    folder = random_llama_folder(tmp_path / "m", head_dim=64, hidden=128)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=20)
    runs = {}
    for env in ("0", "1"):
        monkeypatch.setenv(_backend.INTERPRET_ENV, env)
        with Engine.load(str(folder), block_size=16, **CHANNEL) as e:
            streams = [e.generate(GenerationRequest(prompt_token_ids=p, sampling=params)) for p in (PROMPT, PROMPT[5:])]
            runs[env] = [np.array([[list(t) for t in lp.top] for ev in s for lp in ev.logprobs]) for s in streams]
        assert (len(launches) > 0) == (env == "1")  # batched decode steps ran the kernel source
    for got, want in zip(runs["1"], runs["0"]):
        assert np.array_equal(got[..., 0], want[..., 0])
        assert float(np.abs(got[..., 1] - want[..., 1]).max()) <= 1e-4


def test_channel_keys_in_packed_steps_equal_solo_runs(tmp_path: Path) -> None:
    """One request decoding while two others join: their steps pack its decode row with the new prompts' chunks
    (one staging plan per part), and each request gets the tokens and log-probabilities it gets alone."""
    folder = random_llama_folder(tmp_path / "m", head_dim=64, hidden=128)
    prompts = [PROMPT, [(11 * i + 5) % 120 + 5 for i in range(40)], [(13 * i + 2) % 120 + 5 for i in range(70)]]
    p = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=20)

    def tops(stream) -> np.ndarray:
        return np.array([[list(t) for t in lp.top] for ev in stream for lp in ev.logprobs])

    with Engine.load(str(folder), prefix_caching=False, prefill_chunk_size=16, **CHANNEL) as e:
        solo = [tops(e.generate(GenerationRequest(prompt_token_ids=q, sampling=p))) for q in prompts]
        a = e.generate(GenerationRequest(prompt_token_ids=prompts[0], sampling=p))
        first = next(a)  # a is decoding
        b, c = (e.generate(GenerationRequest(prompt_token_ids=q, sampling=p)) for q in prompts[1:])
        together = [np.concatenate([np.array([[list(t) for t in lp.top] for lp in first.logprobs]), tops(a)]),
                    tops(b), tops(c)]
        assert e.kv_stats()["used"] == 0 and e.diagnostics().cache.storage._stages == {}
    for got, want in zip(together, solo):
        assert np.array_equal(got[..., 0], want[..., 0])
        assert float(np.abs(got[..., 1] - want[..., 1]).max()) <= 1e-4


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_single_sequence_decode_reads_codes_in_place(bits: int) -> None:
    """The decode path `attention.paged.decode_runs_quantized` (quantized matmuls over the codes, per KV head and
    run of blocks) equals attention
    over the dequantized runs: per-token keys, GQA 9 over 3 heads, three runs out of order with a partial last
    block."""
    import mlx.core as mx

    from mlx_engine.attention.host import sdpa
    from mlx_engine.kv.paged import PagedKVStorage
    from mlx_engine.kv.views import DecodeStep

    rng = np.random.default_rng(bits)
    st = PagedKVStorage(1, 16, 16, 3, 64, mx.float32, bits=bits, group_size=64, head_major=True)
    st.ensure_capacity(16)
    table, n = [3, 4, 5, 10, 1, 2, 6], 100
    slots = [table[p // 16] * 16 + p % 16 for p in range(n)]
    k, v = (mx.array(rng.normal(size=(n, 3, 64)).astype(np.float32)) for _ in range(2))
    st.write(0, mx.array(slots, dtype=mx.int32), k, v)
    runs = [slice(48, 96), slice(160, 176), slice(16, 16 + n - 64)]
    q = mx.array(rng.normal(size=(1, 9, 1, 64)).astype(np.float32))
    keys, values = st.gather_runs(0, runs, mx.float32)
    want = np.array(sdpa(q, keys, values, 0.125, causal=False))
    step = DecodeStep(st, n - 1, mx.zeros(1, mx.int32), mx.array([table], dtype=mx.int32), mx.array([n]), n, runs)
    assert step.path.name == "decode-runs-quantized"
    np.testing.assert_allclose(np.array(step.path.run(step, 0, q, 0.125)), want, atol=1e-6)
