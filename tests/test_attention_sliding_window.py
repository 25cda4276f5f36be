"""Sliding-window attention on the paged path: the decode kernel (Metal source run by the interpreter), its
reference, the attention table's windowed paths, and the engine's KV freeing blocks that left every window.

A window of W: the query at position p reads keys at positions p - W + 1 .. p (mlx-lm's and transformers'
sliding mask). Kernel tolerances are tests/test_kernels_metal_paged_attention.py's (the kernel's outputs are O(1)).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from kernels_metal import KVPool, _backend, reference
from kernels_metal import paged_decode_attention
from mlx_engine import Engine, GenerationRequest, SamplingParams
from tests.support.tiny_models import GOLDEN, random_llama_folder
from tests.support.tolerance import assert_f32_close

KERNEL_ATOL = {mx.float32: 1e-5, mx.float16: 2e-3}

needs_interpreter = pytest.mark.skipif(not _backend.interpret_available(),
                                       reason="kernels_metal.interpret (the Metal interpreter) is not importable")


def dense_window(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, lens: list[int],
                 window: int) -> np.ndarray:
    """Dense masked softmax in float64: q (B, Hq, D), k/v (B, T, Hkv, D) each sequence's keys in order."""
    B, Hq, D = q.shape
    Hkv = k.shape[2]
    out = np.zeros((B, Hq, D))
    for b, n in enumerate(lens):
        pos = np.arange(k.shape[1])
        seen = (pos < n) & (pos >= n - window)  # the query sits at n - 1
        for h in range(Hq):
            s = (k[b, :, h // (Hq // Hkv)] @ q[b, h]) * scale
            s = np.where(seen, s, -np.inf)
            p = np.exp(s - s.max())
            out[b, h] = (p / p.sum()) @ v[b, :, h // (Hq // Hkv)]
    return out


def window_case(rng: np.random.Generator, lens: list[int], window: int, block_size: int, D: int, dtype: mx.Dtype,
                freed: int | None):
    """Sequences over scattered blocks; table entries of blocks wholly before the window point at block `freed`
    (None: their own block). Returns q, pool, tables, lens and the dense keys/values per sequence."""
    Hkv, Hq = 2, 4
    nbs = [-(-n // block_size) for n in lens]
    num_blocks = sum(nbs) + 1
    ids = rng.permutation(num_blocks - 1)
    k = rng.standard_normal((num_blocks, block_size, Hkv, D)).astype(np.float32)
    v = rng.standard_normal((num_blocks, block_size, Hkv, D)).astype(np.float32)
    k[-1], v[-1] = 0.0, 1e3  # the last block: what a freed entry points at in the test that proves it unread
    width = max(nbs)
    tables = np.zeros((len(lens), width), np.int32)
    dk = np.zeros((len(lens), width * block_size, Hkv, D), np.float32)
    dv = np.zeros_like(dk)
    at = 0
    for b, (n, nb) in enumerate(zip(lens, nbs)):
        tables[b, :nb] = ids[at:at + nb]
        at += nb
        dk[b] = k[tables[b]].reshape(-1, Hkv, D)
        dv[b] = v[tables[b]].reshape(-1, Hkv, D)
        if freed is not None:
            tables[b, :max(n - window, 0) // block_size] = freed
    q = rng.standard_normal((len(lens), Hq, D)).astype(np.float32)
    pool = KVPool(mx.array(k).astype(dtype), mx.array(v).astype(dtype))
    cast = lambda a: np.array(mx.array(a).astype(dtype).astype(mx.float32), np.float64)  # noqa: E731
    return (mx.array(q).astype(dtype), pool, mx.array(tables), mx.array(np.array(lens, np.int32)),
            cast(q), cast(dk), cast(dv))


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
@pytest.mark.parametrize("window", [1, 8, 37, 500])
def test_reference_window_matches_dense(window: int, dtype: mx.Dtype) -> None:
    rng = np.random.default_rng(window)
    lens = [5, 40, 77, 130]
    q, pool, tables, seq_lens, qd, kd, vd = window_case(rng, lens, window, 16, 64, dtype, freed=None)
    got = reference.paged_decode_attention(q, pool, tables, seq_lens, 0.125, window=window)
    want = dense_window(qd, kd, vd, 0.125, lens, window)
    assert float(np.abs(np.array(got.astype(mx.float32)) - want).max()) <= KERNEL_ATOL[dtype]


@needs_interpreter
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
@pytest.mark.parametrize("window,partition", [(8, 512), (37, 16), (100, 32), (3, 16)])
def test_interpreter_window_never_reads_freed_blocks(window: int, partition: int, dtype: mx.Dtype) -> None:
    """Table entries before the window point at a block whose values are 1e3: the kernel must not read them (its
    result equals the dense masked softmax), split-K over the window's partitions included."""
    rng = np.random.default_rng(window + partition)
    lens = [5, 40, 77, 130]
    nan_block = sum(-(-n // 16) for n in lens)
    q, pool, tables, seq_lens, qd, kd, vd = window_case(rng, lens, window, 16, 64, dtype, freed=nan_block)
    got = paged_decode_attention(q, pool, tables, seq_lens, 0.125, partition_size=partition, backend="interpret",
                                 window=window)
    want = dense_window(qd, kd, vd, 0.125, lens, window)
    got = np.array(got.astype(mx.float32))
    assert float(np.abs(got - want).max()) <= KERNEL_ATOL[dtype]
    # without the window the same tables read that block: the case does test the skipping
    full = paged_decode_attention(q, pool, tables, seq_lens, 0.125, backend="interpret", check_data=False)
    assert float(np.abs(np.array(full.astype(mx.float32)) - want).max()) > 1.0


def test_window_is_checked() -> None:
    rng = np.random.default_rng(0)
    q, pool, tables, seq_lens, *_ = window_case(rng, [20], 8, 16, 64, mx.float32, freed=None)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="window: expected None or a positive int"):
            paged_decode_attention(q, pool, tables, seq_lens, 0.125, window=bad)


def test_data_checks_skip_entries_before_the_window() -> None:
    """A freed entry (past the pool) before the window passes the host checks; inside the window it fails."""
    rng = np.random.default_rng(1)
    q, pool, tables, seq_lens, qd, kd, vd = window_case(rng, [70], 8, 16, 64, mx.float32, freed=None)
    bad = np.array(tables)
    bad[0, 0] = 999
    out = paged_decode_attention(q, pool, mx.array(bad), seq_lens, 0.125, window=8, backend="reference")
    np.testing.assert_allclose(np.array(out), dense_window(qd, kd, vd, 0.125, [70], 8), atol=1e-5)
    bad[0, 4] = 999
    with pytest.raises(ValueError, match=r"block_tables\[0, 4\]"):
        paged_decode_attention(q, pool, mx.array(bad), seq_lens, 0.125, window=8)


# ---------------------------------------------------------------- the engine: a tiny mistral with a window of 8

WINDOW = 8
BS = 16


def mistral_folder(dst: Path, window: int | None = WINDOW, **shape) -> Path:
    """tiny_models' random llama as a mistral with a sliding window (mistral's config field)."""
    folder = random_llama_folder(dst, context=4096, **shape)
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="mistral", sliding_window=window)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def greedy(engine: Engine, ids: list[int], n: int) -> tuple[list[int], np.ndarray]:
    """Greedy tokens and, per step, the top-20 (token id, logprob) pairs (n, 20, 2)."""
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=20)
    events = list(engine.generate(GenerationRequest(prompt_token_ids=ids, sampling=params)))
    lps = [lp for e in events for lp in e.logprobs]
    return [lp.token_id for lp in lps], np.array([[list(t) for t in lp.top] for lp in lps])


PROMPT = [(7 * i + 3) % 120 + 5 for i in range(45)]


def test_mistral_with_a_window_runs_paged_and_matches_the_contiguous_window(tmp_path: Path) -> None:
    """Paged (chunks of 7, blocks of 16, the window 8) against the contiguous cache, which masks with mlx-lm's
    sliding-window mask: same greedy tokens, same top-20 logprobs, 45 prompt tokens and 30 decoded, all far past the
    window. Without the window the model gives other numbers: the comparison does test the window."""
    folder = mistral_folder(tmp_path / "m")
    with Engine.load(str(folder), paged_kv=False) as ref:
        want_tokens, want = greedy(ref, PROMPT, 30)
    with Engine.load(str(folder), block_size=BS, prefill_chunk_size=7) as e:
        assert e.kv_stats()["kind"] == "paged"
        tokens, lps = greedy(e, PROMPT, 30)
    assert tokens == want_tokens
    assert np.array_equal(lps[..., 0], want[..., 0])
    # float32 floor: tests/test_kv_paged.py's paged vs contiguous (11 units), x4 headroom
    assert_f32_close(lps[..., 1], want[..., 1], 48, "windowed paged vs contiguous")
    with Engine.load(str(mistral_folder(tmp_path / "full", window=None)), block_size=BS) as full:
        _, unwindowed = greedy(full, PROMPT, 30)
    assert float(np.abs(unwindowed[..., 1] - want[..., 1]).max()) > 1e-2


def conversation(engine: Engine, turns: int, user: int, reply: int, probe=None) -> tuple[list[int], np.ndarray]:
    """A chat of `turns` turns: each prompt is the history, then `user` new tokens; `reply` greedy tokens each.
    Returns every reply's tokens and top-20 logprobs; `probe()` runs after every streamed event."""
    history: list[int] = []
    tokens, lps = [], []
    params = SamplingParams(temperature=0.0, max_tokens=reply, ignore_eos=True, logprobs=20)
    for t in range(turns):
        history += [(11 * i + 5 * t) % 120 + 5 for i in range(user)]
        for event in engine.generate(GenerationRequest(prompt_token_ids=list(history), sampling=params)):
            for lp in event.logprobs:
                tokens.append(lp.token_id)
                lps.append([list(x) for x in lp.top])
            if probe is not None:
                probe()
        history += tokens[-reply:]
    return tokens, np.array(lps)


def test_a_2000_token_chat_holds_a_window_of_blocks_and_matches_past_it(tmp_path: Path) -> None:
    """Ten turns of 150 user tokens and 50 replies (2,000 tokens; prefill in chunks of 32, then decode) in a pool of
    4 blocks (64 tokens): it runs only because blocks that left the window go back to the pool, and it never holds
    more than cdiv(window - 1 + chunk, block_size) + 1 = 4 blocks (decode: cdiv(window, 16) + 1 = 2 at most).
    Every reply equals the contiguous cache's, whose mask is mlx-lm's sliding window."""
    folder = mistral_folder(tmp_path / "m")
    with Engine.load(str(folder), block_size=BS) as probe_engine:
        per_block = probe_engine.kv_stats()["bytes_per_block"]
    with Engine.load(str(folder), paged_kv=False) as ref:
        want_tokens, want = conversation(ref, 10, 150, 50)
    used: list[int] = []
    with Engine.load(str(folder), block_size=BS, prefill_chunk_size=32, kv_budget_bytes=4 * per_block) as e:
        stats = e.kv_stats()
        assert stats["num_blocks"] == 4
        tokens, lps = conversation(e, 10, 150, 50, probe=lambda: used.append(e.kv_stats()["used"]))
        assert e.kv_stats()["num_hit_tokens"] > 0  # later turns hit the previous turn's window
    assert len(tokens) == 500 and tokens == want_tokens
    assert np.array_equal(lps[..., 0], want[..., 0])
    assert_f32_close(lps[..., 1], want[..., 1], 48, "2,000-token windowed chat vs contiguous")
    # what the pool holds as each token streams: decode at position p holds blocks (p - 7) // 16 .. p // 16
    assert max(used) == 2 and set(used) <= {0, 1, 2}


def tiny_paged_cache(window: int | None, num_blocks: int, max_step_tokens: int | None = 32):
    from mlx_engine.kv.block_pool import BlockPool
    from mlx_engine.kv.cache import PagedCache
    from mlx_engine.kv.manager import KVCacheManager
    from mlx_engine.kv.paged import PagedKVStorage

    storage = PagedKVStorage(2, num_blocks, BS, 2, 16, mx.float32, window=window)
    manager = KVCacheManager(BlockPool(num_blocks, enable_caching=True), BS, window=window)
    return PagedCache(storage, manager, 2, 1, max_step_tokens)


def test_blocks_held_follow_the_window_exactly() -> None:
    """Through the cache's public calls (no model): a 300-token prompt in chunks of 30, then 200 decode steps.
    After each forward's views are made the request holds exactly the blocks from its window's first key
    (position - 7) to its last token, never more than cdiv(7 + 32, 16) + 1 = 4; the pool has only 6."""
    cache = tiny_paged_cache(WINDOW, 6)
    ids = [(3 * i) % 100 for i in range(500)]
    assert cache.blocks_for(500) == 4
    cache.check_fits(500)  # the whole chat fits: it never holds more than 4 of the 6 blocks
    cache.start("a", ids[:300])
    assert cache.num_blocks_held("a") == 0  # a windowed prompt takes its slots per chunk
    held = []
    for s in range(0, 300, 30):
        e = min(300, s + 30)
        cache.prefill_layers("a", s, e)
        assert cache.num_blocks_held("a") == -(-e // BS) - max(0, s - WINDOW + 1) // BS
        held.append(cache.num_blocks_held("a"))
    for p in range(300, 500):
        cache.record("a", ids[:p])
        cache.decode_layers(["a"], [ids[:p]])
        assert cache.num_blocks_held("a") == -(-(p + 1) // BS) - max(0, p - WINDOW + 1) // BS
        held.append(cache.num_blocks_held("a"))
    assert max(held) == 4 and max(held[10:]) == 2
    assert cache.stats()["used"] == 2 and cache.manager.num_tokens("a") == 500
    table = cache.manager.block_table("a")
    assert len(table) == 32 and table[:30] == [0] * 30  # released entries read 0, never attended


def test_a_block_another_sequence_still_reads_stays() -> None:
    """Two sequences share a 48-token prefix (a prefix hit). The first one runs on: its early blocks leave its
    window, but the second, still inside its own window of them, keeps them held (ref counts); once it too moves on
    they go back to the pool, cached."""
    cache = tiny_paged_cache(WINDOW, 16)
    ids = [(5 * i) % 100 for i in range(200)]
    cache.start("a", ids[:49])
    cache.prefill_layers("a", 0, 49)
    cache.record("a", ids[:49])
    shared = cache.manager.block_table("a")[:3]
    assert cache.start("b", ids[:49]) == 48  # a hit: its next token (48) reads from 41 on, the third block only
    assert cache.manager.block_table("b")[:3] == [0, 0, shared[2]]
    pool = cache.manager.pool
    for p in range(49, 100):
        cache.decode_layers(["a"], [ids[:p]])
        cache.record("a", ids[:p + 1])
    assert cache.manager.block_table("a")[:3] == [0, 0, 0]  # a's window left them
    assert [pool.blocks[i].ref_cnt for i in shared] == [0, 0, 1]  # b holds the one in its window
    cache.prefill_layers("b", 48, 49)
    for p in range(49, 80):
        cache.decode_layers(["b"], [ids[:p]])
    assert [pool.blocks[i].ref_cnt for i in shared] == [0, 0, 0]
    assert all(pool.blocks[i].block_hash is not None for i in shared)  # free, still cached for the next hit


def test_rolling_back_into_a_released_block_is_refused() -> None:
    cache = tiny_paged_cache(WINDOW, 8)
    ids = list(range(100))
    cache.start("a", ids[:60])
    cache.prefill_layers("a", 0, 60)
    cache.decode_layers(["a"], [ids[:60]])  # position 60: blocks before (60 - 7) // 16 = 3 released
    cache.trim("a", 57)  # a rollback inside the window is fine
    with pytest.raises(ValueError, match="sliding window .*released"):
        cache.trim("a", 40)


def test_a_prefix_hit_with_a_window_gives_a_fresh_run_s_tokens(tmp_path: Path) -> None:
    """The same 100-token prompt twice: the second request reuses the blocks of the window before its last token
    (96 tokens reported cached: the blocks before the window need not be there) and decodes what the first did."""
    folder = mistral_folder(tmp_path / "m")
    prompt = [(13 * i + 1) % 120 + 5 for i in range(100)]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=20)
    with Engine.load(str(folder), block_size=BS, prefill_chunk_size=32) as e:
        first = list(e.generate(GenerationRequest(prompt_token_ids=prompt, sampling=params)))
        second = list(e.generate(GenerationRequest(prompt_token_ids=prompt, sampling=params)))
    assert first[-1].usage.cached_prompt_tokens == 0 and second[-1].usage.cached_prompt_tokens == 96
    top = lambda events: np.array([[list(t) for t in lp.top] for ev in events for lp in ev.logprobs])  # noqa: E731
    a, b = top(first), top(second)
    assert np.array_equal(a[..., 0], b[..., 0])
    assert_f32_close(b[..., 1], a[..., 1], 48, "windowed prefix hit vs fresh")


def test_concurrent_windowed_requests_equal_each_alone(tmp_path: Path) -> None:
    """Three requests of different lengths batched together (decode rows and prefill chunks packed, each table
    from its own window on) give the tokens each gives alone."""
    folder = mistral_folder(tmp_path / "m")
    prompts = [[(k * 7 + 3 * i) % 120 + 5 for i in range(n)] for k, n in enumerate((30, 75, 140))]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    with Engine.load(str(folder), block_size=BS, prefill_chunk_size=16, prefix_caching=False) as e:
        alone = [[t for ev in e.generate(GenerationRequest(prompt_token_ids=p, sampling=params)) for t in ev.token_ids]
                 for p in prompts]
        streams = [e.generate(GenerationRequest(prompt_token_ids=p, sampling=params)) for p in prompts]
        together, running = [[] for _ in streams], []
        for ev in streams[0]:  # while the shortest runs, the others share its steps
            together[0] += ev.token_ids
            running.append(e.kv_stats()["num_sequences"])
        for out, s in zip(together[1:], streams[1:]):
            out += [t for ev in s for t in ev.token_ids]
    assert together == alone and all(len(t) == 40 for t in alone)
    assert max(running) == 3


def alternating_folder(dst: Path, layers: int = 4) -> Path:
    """A tiny mistral whose layers alternate sliding (window 8) and full attention, as gemma's do."""
    folder = mistral_folder(dst, layers=layers)
    config = json.loads((folder / "config.json").read_text())
    config["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_alternating_layers_keep_a_storage_per_kind_and_match_contiguous(tmp_path: Path) -> None:
    """Sliding and full layers: one pool each; the full layers' blocks grow with the chat, the sliding layers'
    stay at the window's. Tokens and logprobs equal the contiguous cache's, which windows layer by layer."""
    folder = alternating_folder(tmp_path / "m")
    with Engine.load(str(folder), paged_kv=False) as ref:
        want_tokens, want = greedy(ref, PROMPT * 3, 40)
    with Engine.load(str(folder), block_size=BS, prefill_chunk_size=16) as e:
        kinds = e.kv_stats()["kinds"]
        assert [(k["window"], k["layers"]) for k in kinds] == [(None, [1, 3]), (WINDOW, [0, 2])]
        # the default budget: 16 requests' windows (cdiv(7 + 17, 16) + 1 = 3 blocks each, a step at most a chunk of
        # 16 or a verification of 16 drafts) and a quarter; the full layers a context of 4096 and a quarter
        assert [k["num_blocks"] for k in kinds] == [4096 // BS * 5 // 4, 16 * 3 * 5 // 4]
        params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=20)
        held: list[tuple[int, int]] = []
        tokens, lps = [], []
        for ev in e.generate(GenerationRequest(prompt_token_ids=PROMPT * 3, sampling=params)):
            tokens += [lp.token_id for lp in ev.logprobs]
            lps += [[list(t) for t in lp.top] for lp in ev.logprobs]
            held.append(tuple(k["used"] for k in e.kv_stats()["kinds"][::-1]))  # (sliding, full)
    assert tokens == want_tokens
    lps = np.array(lps)
    assert np.array_equal(lps[..., 0], want[..., 0])
    assert_f32_close(lps[..., 1], want[..., 1], 48, "alternating windowed layers vs contiguous")
    sliding, full = zip(*held[:-1])  # the last event comes once the request has given its blocks back
    assert max(sliding) == 2  # a window of 8 in blocks of 16
    assert max(full) == -(-(135 + 39) // BS)  # every position so far: 135 prompt tokens, 39 fed replies


def test_qwen2_slides_from_max_window_layers_as_transformers_does() -> None:
    from mlx_engine.models import qwen2

    base = {"model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 4, "intermediate_size": 96,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128, "sliding_window": 8}
    assert qwen2.args_from_config(base).layer_windows() == [None] * 4  # use_sliding_window unset: HF ignores it
    on = {**base, "use_sliding_window": True}
    assert qwen2.args_from_config({**on, "max_window_layers": 1}).layer_windows() == [None, 8, 8, 8]
    assert qwen2.args_from_config(on).layer_windows() == [None] * 4  # transformers' default: from layer 28 on
    types = ["sliding_attention", "full_attention"] * 2
    assert qwen2.args_from_config({**on, "layer_types": types}).layer_windows() == [8, None, 8, None]


@pytest.mark.parametrize("mode", ["prompt-lookup", "self"])
def test_speculative_rollback_with_a_window_gives_plain_decoding_s_tokens(tmp_path: Path, mode: str) -> None:
    """Verifications of drafts and rollbacks of the rejected ones on windowed layers (verifications take their
    slots per forward, trims stay inside the window): greedy tokens equal plain decoding's, and every block comes
    back."""
    folder = alternating_folder(tmp_path / "m")
    prompt = [5, 6, 7, 8, 9] * 12
    with Engine.load(str(folder), block_size=BS, prefill_chunk_size=16) as e:
        def run(**spec) -> list[int]:
            params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True, **spec)
            return [t for ev in e.generate(GenerationRequest(prompt_token_ids=prompt, sampling=params))
                    for t in ev.token_ids]

        plain = run()
        assert run(speculative=mode, num_draft_tokens=6) == plain
        assert e.kv_stats()["used"] == 0


def test_roofline_kv_counts_the_layers_the_engine_frees(tmp_path: Path) -> None:
    """`roofline kv`'s shape (the catalog's) names as sliding exactly the layers the engine keeps in a windowed
    pool, and counts them at the window: what such a layer holds in decode, to the block (at most
    cdiv(window, block_size) + 1 blocks)."""
    from mlx_engine.catalog import kv_shape
    from mlx_engine.memory import kv_bytes

    folder = alternating_folder(tmp_path / "m")
    shape = kv_shape(str(folder))
    assert (shape.num_sliding_layers, shape.sliding_window) == (2, WINDOW)
    with Engine.load(str(folder), block_size=BS) as e:
        kinds = e.kv_stats()["kinds"]
    assert [len(k["layers"]) for k in kinds if k["window"] == WINDOW] == [shape.num_sliding_layers]
    per_token_layer = kv_bytes(shape, 1, itemsize=4) // shape.num_layers
    assert kv_bytes(shape, 2000, itemsize=4) == per_token_layer * (2 * 2000 + 2 * WINDOW)


def test_the_per_kind_cache_implements_the_kv_contract() -> None:
    from mlx_engine.kv.config import KVConfig
    from mlx_engine.kv.kinds import LayerKindsCache
    from mlx_engine.kv.protocol import KVCache

    cache = LayerKindsCache.create(layer_windows=[WINDOW, None, WINDOW], num_kv_heads=2, head_dim=32,
                                   dtype=mx.float32, context_length=256, weight_bytes=0,
                                   config=KVConfig(kv_budget_bytes=2**20), model_id=b"test", max_step_tokens=32)
    assert isinstance(cache, LayerKindsCache) and isinstance(cache, KVCache)
    assert cache.capabilities.paged and not cache.capabilities.kv_files
    assert cache.layers == [[1], [0, 2]] and cache.windows == [None, WINDOW]
    # a budget split as one full-context request holds blocks: 4 in the two sliding layers, 16 in the full one,
    # 8,192 bytes a block and layer: 2**20 / (24 * 8192) = 5.33 such requests
    assert [c.stats()["num_blocks"] for c in cache.kinds] == [85, 21]
    # admission in the full kind's blocks, each sliding block worth 85 / 21 of them: the sliding pool binds
    assert cache.blocks_for(256) == 17 and cache.blocks_for(20) == 9 and cache.num_free_blocks() == 85
    cache.start("a", list(range(40)))
    views = cache.prefill_layers("a", 0, 40)
    assert [v.storage.window for v in views] == [WINDOW, None, WINDOW] and [v.layer for v in views] == [0, 0, 1]


def test_a_2000_token_chat_on_gemma3_keeps_its_sliding_layers_bounded(tmp_path: Path) -> None:
    """The tiny gemma3 (transformers 5's golden: three sliding layers of window 8 and one full layer, on mlx-lm's
    class through the adapter) with its context raised to 4,096: ten turns of 150 user tokens and 50 replies. The
    sliding layers' pool holds at most cdiv(8 - 1 + 32, 16) + 1 = 4 blocks while a chunk of 32 prefills and
    cdiv(8, 16) + 1 = 2 while decoding; the full layer's grows with the chat. Every reply equals mlx-lm's own
    caches (RotatingKVCache on the sliding layers). Its logits past the window match transformers in
    tests/test_adapter.py."""
    dst = tmp_path / "gemma3"
    shutil.copytree(GOLDEN / "gemma3_text", dst)
    config = json.loads((dst / "config.json").read_text())
    config["max_position_embeddings"] = 4096
    (dst / "config.json").write_text(json.dumps(config))
    with Engine.load(str(dst), paged_kv=False) as ref:
        want_tokens, want = conversation(ref, 10, 150, 50)
    sliding: list[int] = []
    full: list[int] = []

    def probe() -> None:
        kinds = {k["window"]: k["used"] for k in e.kv_stats()["kinds"]}
        sliding.append(kinds[8])
        full.append(kinds[None])

    with Engine.load(str(dst), block_size=BS, prefill_chunk_size=32) as e:
        assert e.kv_stats()["kind"] == "paged" and e.info.warnings == ()
        tokens, lps = conversation(e, 10, 150, 50, probe=probe)
    assert len(tokens) == 500 and tokens == want_tokens
    assert np.array_equal(lps[..., 0], want[..., 0])
    assert_f32_close(lps[..., 1], want[..., 1], 48, "2,000-token gemma3 chat vs mlx-lm's caches")
    assert max(sliding) <= 4 and max(full) == -(-2000 // BS)
