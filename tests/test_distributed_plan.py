"""The distributed engine's pure parts, without launching ranks: the pipeline's split, the plan's token deltas,
micro-batches, the link roof, `roofline kv --distributed`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from mlx_engine.distributed.mirror import PlanLog, Replayer
from mlx_engine.distributed.plan import (bytes_per_token, check_mode, link_roof, pipeline_split, read_hostfile_peers,
                                         tensor_problem)

ROOT = Path(__file__).resolve().parents[1]


def test_pipeline_split_balances_and_puts_the_last_layers_on_rank_0():
    assert pipeline_split([10, 10], 0, 2) == [(1, 2), (0, 1)]
    assert pipeline_split([10] * 30, 50, 2) == [(17, 30), (0, 17)]  # rank 0's 50 extra: 13 layers + 50 = 180 vs 170
    assert pipeline_split([10] * 30, 0, 3) == [(20, 30), (0, 10), (10, 20)]
    assert pipeline_split([1, 1, 1, 100], 0, 2) == [(3, 4), (0, 3)]
    with pytest.raises(Exception, match="at least 3 layers"):
        pipeline_split([1, 1], 0, 3)


def test_tensor_problem_and_mode_lines():
    assert tensor_problem(4, 2, 96, 2, "m") is None
    line = tensor_problem(9, 3, 1536, 2, "SmolLM2")
    assert "9 query and 3 KV heads" in line and "use --distributed pipeline" in line
    with pytest.raises(Exception, match="expected pipeline"):
        check_mode("ring")


def test_plan_tokens_travel_as_deltas_and_replay_exactly():
    class Cache:  # what a rank's cache receives
        def __init__(self):
            self.calls = []

        def record(self, req, ids):
            self.calls.append(("record", req, list(ids)))

        def decode_layers(self, reqs, known):
            self.calls.append(("decode", list(reqs), [list(k) for k in known]))
            return ["view"]

        def finish(self, req, ids):
            self.calls.append(("finish", req, list(ids)))

    from mlx_engine.distributed.mirror import CACHE_CALLS, MirroredCache

    for name in CACHE_CALLS - set(vars(Cache)):  # the protocol's other changing calls: not made here
        setattr(Cache, name, lambda self, *args, **kwargs: None)
    log, here = PlanLog(), Cache()

    mirror = MirroredCache(here, log)
    a = list(range(100))
    mirror.record("a", a)
    mirror.decode_layers(["a"], [a + [7]])
    mirror.record("a", a[:50] + [9])  # a rollback: only what follows the common prefix travels
    layers = mirror.decode_layers(["a"], [a[:50] + [9, 4]])
    mirror.finish("a", a[:50] + [9, 4])
    ops = log.take()
    sent = [op[3][1] for op in ops if op[2] in ("record", "finish")]
    sent += [op[3][1][0] for op in ops if op[2] == "decode_layers"]
    assert all(len(t[2]) <= 100 for t in sent)
    assert [t[1] for t in sent] == [0, 50, 52, 100, 51]  # kept prefix lengths: record, record, finish, then decodes
    assert layers.op == ops[3][0] and log.view_reqs == {ops[3][0]: ["a"]}
    there = Cache()
    replay = Replayer(there, lambda: [])
    for op in ops:
        replay.apply(op)
    assert there.calls == here.calls
    assert "a" not in replay.tokens  # forgotten at finish


def test_link_roof_counts_hops_and_all_sums():
    # pipeline over 2 ranks: two hops of one hidden row per token; tensor: 2 all-sums a layer, each 2(N-1)/N rows
    assert bytes_per_token("pipeline", 2, 30, 576, 2, 1, 0) == 2 * 576 * 2
    assert bytes_per_token("tensor", 2, 30, 576, 2, 4, 400) == 2 * 30 * 576 * 2 + 100
    link = {"bandwidth_bytes_s": 1e9, "latency_s": 1e-4}
    roof = link_roof(link, "pipeline", 2, 30, 576, 2, 1, 0)
    assert roof["bandwidth_roof_tps"] == pytest.approx(1e9 / 2304)
    assert roof["latency_roof_tps"] == pytest.approx(1 / (3 * 1e-4 + 2304 / 1e9))  # plan + 2 hops


def test_hostfile_peers():
    assert read_hostfile_peers('[["10.0.0.1:5000"], ["10.0.0.2:5001", "10.0.1.2:5002"]]') == \
        ["10.0.0.1:5000", "10.0.0.2:5001, 10.0.1.2:5002"]
    assert read_hostfile_peers("") == [] and read_hostfile_peers("{not json") == []


def test_kv_per_rank_on_paper():
    out = subprocess.run([sys.executable, "-m", "app.cli", "kv", "-c", "8192", "--distributed", "pipeline"],
                         capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    # the split a live run makes (tests/test_distributed.py: layers 19-29 on rank 0 with the tied embedding)
    assert lines[1].startswith("rank 0: layers 19-29 (11) x 3 KV heads; embedding, head")
    assert lines[2].startswith("rank 1: layers 0-18 (19) x 3 KV heads: weights")
    bad = subprocess.run([sys.executable, "-m", "app.cli", "kv", "-c", "8192", "--distributed", "tensor"],
                         capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert bad.returncode == 2 and "3 do not divide by 2: use --distributed pipeline" in bad.stderr


def paged_cache():
    """A two-layer paged cache with room for a block each of 100 sequences."""
    import mlx.core as mx

    from mlx_engine.kv.cache import PagedCache
    from mlx_engine.kv.config import KVConfig

    return PagedCache.create(num_layers=2, num_kv_heads=2, head_dim=32, dtype=mx.float32, context_length=256,
                             weight_bytes=0, config=KVConfig(kv_budget_bytes=2**23), model_id=b"test")


def _decoding(cache, n: int, prompt: int = 5) -> tuple[list[str], list[list[int]]]:
    """n sequences in `cache`, each prefilled with `prompt` tokens and about to decode its next."""
    reqs, known = [f"r{i}" for i in range(n)], []
    for i, r in enumerate(reqs):
        ids = [(3 * i + j) % 100 + 1 for j in range(prompt)]
        cache.start(r, ids)
        cache.prefill_layers(r, 0, prompt)
        known.append(ids)
    return reqs, known


def test_decode_rows_are_cut_by_sequence_only_where_the_cost_rule_allows():
    from mlx_engine.distributed.stage import MIN_DECODE_ROWS_PER_MICRO_BATCH as MIN, cuts_decode, micro_batches

    for n, want in [(1, None), (2 * MIN - 1, None), (2 * MIN, [(0, MIN), (MIN, 2 * MIN)]),
                    (2 * MIN + 3, [(0, MIN + 1), (MIN + 1, 2 * MIN + 3)])]:
        cache = paged_cache()
        views = cache.decode_layers(*_decoding(cache, n))
        assert micro_batches(views, 2) == want, n
        assert micro_batches(views, 1) is None
        assert cuts_decode(views, want) == (want is not None)
    cache = paged_cache()
    reqs, known = _decoding(cache, 6)
    assert micro_batches(cache.decode_layers(reqs, known), 3, min_decode_rows=2) == [(0, 2), (2, 4), (4, 6)]
    # packed forwards: a prefill chunk of 40 rows beside the decode rows goes on its own; one of 8 joins the
    # second group of sequences
    for rows, want in [(40, [(0, 2 * MIN), (2 * MIN, 2 * MIN + 40)]), (8, [(0, MIN), (MIN, 2 * MIN + 8)])]:
        cache = paged_cache()
        reqs, known = _decoding(cache, 2 * MIN)
        cache.start("p", list(range(1, rows + 1)))
        views = cache.packed_layers(reqs, known, [("p", 0, rows)])
        groups = micro_batches(views, 2)
        assert groups == want and cuts_decode(views, groups) == (rows == 8), rows


def test_a_decode_micro_batch_attends_as_the_whole_step_does():
    import mlx.core as mx

    from mlx_engine.distributed.stage import sub_views

    cache = paged_cache()
    reqs, known = _decoding(cache, 7, prompt=19)  # two blocks each: the tables' padding is read too
    views = cache.decode_layers(reqs, known)
    H, D = 2, 32
    q, k, v = (mx.random.normal((7, H, 1, D), key=mx.random.key(s)) for s in (1, 2, 3))
    st = cache.storage  # the prompts' keys, at random
    for layer in range(2):
        for pos in range(19):
            slots = mx.array([19 * i + pos for i in range(7)], dtype=mx.int32)
            kk, vv = (mx.random.normal((7, H, D), key=mx.random.key(100 * layer + pos + s)) for s in (0, 50))
            st.write(layer, slots, kk, vv, None)
    whole = views[1].attention(q, k, v, 0.125)
    parts = [sub_views(views, a, b)[1].attention(q[a:b], k[a:b], v[a:b], 0.125) for a, b in ((0, 3), (3, 7))]
    assert mx.array_equal(mx.concatenate(parts, axis=0), whole).item()
    subs = sub_views(views, 3, 7)
    assert subs[0].step is subs[1].step and subs[0].step.num_rows == 4  # one step shared by the layers
    with pytest.raises(ValueError, match="not a cut"):
        views[0].step.rows(5, 9)
