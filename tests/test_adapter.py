"""mlx-lm's model classes on the engine's paged KV (mlx_engine.models.adapter), on the golden checkpoints of
transformers 5 (tests/data/golden): logits and greedy tokens against transformers through the paged path, a
prefix-cache hit, concurrent requests token-identical to the same requests alone, prompt-lookup speculation
(drafts rolled back) equal to plain decoding, and a mixture-of-experts decode step's bytes from its routing."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open

from mlx_engine import Engine, GenerationRequest, SamplingParams
from tests.support.tiny_models import GOLDEN, random_mamba_folder
from tests.support.tolerance import assert_f32_close

# mlx-lm's classes through the adapter, sliding families (windows per kind of layer) included; gemma2's soft cap
# and gpt_oss's sinks through the attention table's scored rows
PAGED = ["gemma2", "gemma3_text", "gpt_oss", "granite", "mixtral", "olmo2", "phi3", "qwen3_moe", "starcoder2"]
MOE = ["mixtral", "qwen3_moe"]
SLIDING = ["gemma2", "gemma3_text", "gpt_oss", "starcoder2"]  # windowed layers: KV files unavailable


def golden(name: str) -> dict[str, np.ndarray]:
    return dict(np.load(GOLDEN / name / "golden.npz"))


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def run(e: Engine, ids: list[int], **sampling):
    sampling.setdefault("temperature", 0.0)
    sampling.setdefault("ignore_eos", True)
    events = list(e.generate(GenerationRequest(prompt_token_ids=ids, sampling=SamplingParams(**sampling))))
    return [t for ev in events for t in ev.token_ids], events


@pytest.fixture(scope="module", params=PAGED)
def family(request):
    # chunks of 5: the 12-token golden prompt prefills in three chunks; longer prompts span several blocks
    with Engine.load(str(GOLDEN / request.param), prefill_chunk_size=5) as e:
        yield request.param, e


def test_runs_paged_not_native(family) -> None:
    name, e = family
    stats = e.kv_stats()
    assert not e.info.native and e.info.warnings == ()
    assert stats["kind"] == "paged" and stats["block_size"] == 16
    assert any("on the engine's KV cache" in n for n in e.info.notes)


def test_paged_logits_match_transformers(family) -> None:
    """The prompt's log-probabilities through the paged cache in prefill chunks (`score`), and one forward
    without it, against transformers' logits."""
    name, e = family
    g = golden(name)
    ids = g["input_ids"].ravel().tolist()
    want = g["logits"].reshape(len(ids), -1)
    targets = log_softmax(want)[np.arange(len(ids) - 1), ids[1:]]
    # float32 floors (units, tests/support/tolerance.py; AMD EPYC): score 0.8-9.3, forward 5.9-16.3 (mixtral); x4
    assert_f32_close(e.score(ids), targets, 38, f"{name} paged score vs transformers")
    assert_f32_close(e.forward_logits(ids), want, 66, f"{name} forward vs transformers")
    assert float(np.abs(e.forward_logits(ids) - want).max()) <= 1e-4  # the bound


def test_greedy_identical_and_decode_logprobs(family) -> None:
    """transformers' 32 greedy tokens through paged prefill and decode; each decode step's log-probability
    equals one forward over the whole sequence."""
    name, e = family
    g = golden(name)
    ids = g["input_ids"].ravel().tolist()
    want = g["greedy_tokens"].ravel().tolist()
    tokens, events = run(e, ids, max_tokens=len(want), logprobs=1)
    assert tokens == want
    lps = [lp.logprob for ev in events for lp in ev.logprobs]
    seq = ids + tokens
    full = log_softmax(e.forward_logits(seq[:-1]))
    ref = full[np.arange(len(ids) - 1, len(seq) - 1), tokens]
    assert_f32_close(lps, ref, 53, f"{name} paged decode vs one forward")  # floor 1.4-13.2 units (gpt_oss), x4


def test_repeated_prompt_hits_the_prefix_cache(family) -> None:
    name, e = family
    ids = [(7 * i + 3) % 120 + 2 for i in range(35)]
    first, _ = run(e, ids, max_tokens=6)
    again, events = run(e, ids, max_tokens=6)
    cached = events[-1].usage.cached_prompt_tokens
    assert cached == 32 and again == first  # the full blocks of 16 before the last prompt token


def test_kv_file_restores_into_a_fresh_engine(family, tmp_path: Path) -> None:
    """A conversation's KV saved to a file and restored into a new engine: the prefix is not prefilled again and
    the reply is the same. Sliding layers release their blocks before the window, so those families refuse."""
    from mlx_engine import RooflineError

    name, e = family
    ids = [(11 * i + 5) % 120 + 2 for i in range(40)]
    first, _ = run(e, ids, max_tokens=5)
    path = str(tmp_path / "chat.kv")
    if name in SLIDING:
        assert not e.info.kv_files
        with pytest.raises(RooflineError, match="sliding-window layers"):
            e.save_kv(path, ids)
        return
    assert e.info.kv_files and e.save_kv(path, ids) == 32
    with Engine.load(str(GOLDEN / name)) as other:
        assert other.restore_kv(path) == 32
        again, events = run(other, ids, max_tokens=5)
    assert events[-1].usage.cached_prompt_tokens == 32 and again == first


PROMPTS = [[(5 * i + 7 * k) % 120 + 4 for i in range(n)] for k, n in enumerate([9, 40, 3, 21])]


def test_concurrent_requests_equal_alone(family) -> None:
    """Four requests at once: the 40-token prompt prefills in chunks of 8 packed with the others' decode rows
    (`PackedView`, each part roped at its own positions), then all decode as one batch."""
    name, _ = family
    with Engine.load(str(GOLDEN / name), prefix_caching=False, prefill_chunk_size=8) as e:
        alone = [run(e, p, max_tokens=10)[0] for p in PROMPTS]
        streams = [e.generate(GenerationRequest(prompt_token_ids=p, sampling=SamplingParams(
            temperature=0.0, ignore_eos=True, max_tokens=10))) for p in PROMPTS]
        together = [[t for ev in s for t in ev.token_ids] for s in streams]
        assert e.kv_stats()["used"] == 0
    assert together == alone


@pytest.mark.parametrize("name", ["phi3", "qwen3_moe"])
def test_unpacked_batches_rope_at_per_sequence_offsets(name: str, monkeypatch) -> None:
    """A family without one rope module per layer is not packed: B sequences decode as (B, 1) rows and mlx-lm's
    own rope takes the view's (B,) positions (mx.fast.rope's array offset); each equals the request alone."""
    import mlx_engine.models.adapter as adapter

    monkeypatch.setattr(adapter, "_rope_owners", lambda model: None)
    with Engine.load(str(GOLDEN / name), prefix_caching=False) as e:
        alone = [run(e, p, max_tokens=10)[0] for p in PROMPTS]
        streams = [e.generate(GenerationRequest(prompt_token_ids=p, sampling=SamplingParams(
            temperature=0.0, ignore_eos=True, max_tokens=10))) for p in PROMPTS]
        together = [[t for ev in s for t in ev.token_ids] for s in streams]
        routing = e.moe_routing()
    assert together == alone
    if routing is not None:  # batched decode steps of (B, 1) rows were recorded as such
        assert max(s["decode_rows"] for s in routing["steps"]) > 1


# gemma2's tiny weights continue the 7-token loop exactly (every draft accepted, nothing rolled back): another loop
REPETITIVE = {"gemma2": [3, 17, 42, 99, 7, 64, 120, 5] * 3}


def test_prompt_lookup_rolls_back_to_plain_decoding(family) -> None:
    """A repetitive prompt: prompt lookup drafts, the model rejects some drafts (the KV is trimmed back), and
    the reply is the plain one, token for token."""
    name, e = family
    ids = REPETITIVE.get(name, [9, 21, 33, 45, 57, 69, 81] * 4)
    plain, _ = run(e, ids, max_tokens=16)
    spec, events = run(e, ids, max_tokens=16, speculative="prompt-lookup")
    assert spec == plain
    stats = events[-1].stats
    assert stats.acceptance_rate is not None and stats.acceptance_rate < 1  # drafts verified, some rejected
    with Engine.load(str(GOLDEN / name)) as fresh:
        assert run(fresh, ids, max_tokens=16)[0] == plain


# --- mixture of experts --------------------------------------------------------------------------------------


def expert_bytes_from_file(name: str) -> tuple[list[int], int, int]:
    """(bytes of one expert per layer, experts per layer, bytes a token reads of everything but the experts)
    from the checkpoint's own tensors (all float32)."""
    config = json.loads((GOLDEN / name / "config.json").read_text())
    num = config.get("num_local_experts") or config["num_experts"]
    per_layer = []
    with safe_open(str(GOLDEN / name / "model.safetensors"), "np") as f:
        size = {k: int(np.prod(f.get_slice(k).get_shape())) * 4 for k in f.keys()}
        embed = 0 if config.get("tie_word_embeddings") else size["model.embed_tokens.weight"]  # a row lookup
        shared = sum(v for k, v in size.items() if ".experts." not in k) - embed
        for layer in range(config["num_hidden_layers"]):
            stem = f"model.layers.{layer}." + ("block_sparse_moe" if name == "mixtral" else "mlp") + ".experts.0."
            sizes = [int(np.prod(f.get_slice(k).get_shape())) * 4 for k in f.keys() if k.startswith(stem)]  # F32
            assert len(sizes) == 3, sizes
            per_layer.append(sum(sizes))
    return per_layer, num, shared


def routing_signatures(steps: list[dict]) -> list[tuple]:
    """Every decoded token of the recorded steps: its experts in each layer, as one hashable row."""
    out = []
    for step in steps:
        for r in range(step["decode_rows"]):
            out.append(tuple(tuple(layer[r]) for layer in step["rows"]))
    return sorted(out)


@pytest.mark.parametrize("name", MOE)
def test_moe_step_bytes_are_the_routed_experts(name: str) -> None:
    """Bytes per decode step = shared weights + each layer's union of routed experts over the batch, counted
    here from the router's recorded choices and the expert tensors' sizes in the file; each request's routing
    is the same batched as alone; alone (batch 1) a step reads top-k experts per layer, the roofline's figure."""
    expert_bytes, num, shared = expert_bytes_from_file(name)
    # chunks of 8: the 40-token prompt's prefill is packed with the others' decode rows (read in the same step)
    with Engine.load(str(GOLDEN / name), prefix_caching=False, prefill_chunk_size=8) as e:
        k = e.moe_routing()["experts_per_token"]
        assert e.moe_routing()["expert_bytes"] == expert_bytes and e.moe_routing()["steps"] == []
        weights = e.decode_bytes_per_token(0)  # batch 1: shared + k experts per layer
        for p in PROMPTS:
            run(e, p, max_tokens=10)
        alone = e.moe_routing()
        streams = [e.generate(GenerationRequest(prompt_token_ids=p, sampling=SamplingParams(
            temperature=0.0, ignore_eos=True, max_tokens=10))) for p in PROMPTS]
        for s in streams:
            list(s)
        both = e.moe_routing()
    assert alone["shared_bytes"] == shared and weights == shared + k * sum(expert_bytes)
    alone_steps = alone["steps"]
    batched = both["steps"][len(alone_steps):]
    assert len(alone_steps) == 4 * 9  # the first token comes from the prefill
    for step in alone_steps:
        assert step["decode_rows"] == len(step["rows"][0]) == 1
        assert [len(layer) for layer in step["experts"]] == [k] * len(expert_bytes)
        assert step["bytes"] == weights
    assert max(s["decode_rows"] for s in batched) > 1  # really batched
    assert any(len(s["rows"][0]) > s["decode_rows"] for s in batched)  # and packed with a prefill chunk
    for step in batched:
        union = [set(e for row in layer for e in row) for layer in step["rows"]]
        assert all(u <= set(range(num)) for u in union)
        assert step["bytes"] == shared + sum(len(u) * b for u, b in zip(union, expert_bytes))
    assert any(s["bytes"] > weights for s in batched)  # a batch's union reads more experts than one row
    assert routing_signatures(batched) == routing_signatures(alone_steps)


def test_dense_model_has_no_routing() -> None:
    with Engine.load(str(GOLDEN / "phi3")) as e:
        assert e.moe_routing() is None


def test_bench_prices_a_batched_moe_step_by_its_routing() -> None:
    """`roofline bench`'s bytes per decode step (roofline.moe_weights_per_step): a batch of 4 reads the union of
    its rows' experts, measured; one sequence reads top-k experts per layer, the model's per-token figure."""
    from mlx_engine.roofline import moe_weights_per_step

    with Engine.load(str(GOLDEN / "qwen3_moe"), prefix_caching=False) as e:
        prompts = [[(3 * i + 11 * k) % 120 + 4 for i in range(10)] for k in range(4)]
        streams = [e.generate(GenerationRequest(prompt_token_ids=p, sampling=SamplingParams(
            temperature=0.0, ignore_eos=True, max_tokens=8))) for p in prompts]
        for s in streams:
            list(s)
        run(e, prompts[0], max_tokens=4)
        report = e.moe_routing()
        four = [s["bytes"] for s in report["steps"] if s["decode_rows"] == len(s["rows"][0]) == 4]
        assert four and moe_weights_per_step(report, 4) == sum(four) / len(four) > e.decode_bytes_per_token(0)
        assert moe_weights_per_step(report, 1) == e.decode_bytes_per_token(0)
        assert moe_weights_per_step(report, 7) is None and moe_weights_per_step(None, 1) is None


def test_routed_attention_leaves_mlx_lm_caches_to_mlx_lm() -> None:
    """Once a family's module is routed (an engine loaded it), mlx-lm's own class on mlx-lm's own KVCache still
    attends through mlx-lm's function: transformers' logits, prefill then one decode step."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_engine.models import instantiate

    g = golden("phi3")
    ids = g["input_ids"].ravel().tolist()
    with Engine.load(str(GOLDEN / "phi3")):
        config = json.loads((GOLDEN / "phi3" / "config.json").read_text())
        model, *_ = instantiate(config, "phi3")
        model.load_weights(str(GOLDEN / "phi3" / "model.safetensors"))
        cache = make_prompt_cache(model)
        head = np.array(model(mx.array([ids[:-1]]), cache=cache))
        last = np.array(model(mx.array([ids[-1:]]), cache=cache))
    got = np.concatenate([head[0], last[0]])
    assert_f32_close(got, g["logits"].reshape(len(ids), -1), 66, "mlx-lm's own cache after routing")


def test_attention_outside_the_seam_keeps_mlx_lm_caches() -> None:
    """A family that writes its cache but attends by hand (not through the routed function) is not adapted."""
    import mlx.core as mx
    import mlx.nn as nn

    from mlx_engine.models.adapter import adapt

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 8)

        def __call__(self, x, cache):
            k = self.proj(x).reshape(1, 1, -1, 8)
            keys, values = cache.update_and_fetch(k, k)
            return x + (keys @ values.swapaxes(-1, -2)).sum()

    class Decoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(4, 8)
            self.layers = [Layer(), Layer()]

        def __call__(self, inputs, cache=None):
            h = self.embed(inputs)
            for layer, c in zip(self.layers, cache):
                h = layer(h, c)
            return h

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = Decoder()

        @property
        def layers(self):
            return self.model.layers

        def __call__(self, inputs, cache=None):
            return self.model(inputs, cache)

    model = Model()
    same, why = adapt(model)
    assert same is model and why == "its attention is not mlx-lm's scaled_dot_product_attention on every layer"
    flat = Decoder()  # layers but no decoder child for the head to follow
    same, why = adapt(flat)
    assert same is flat and why == "its decoder is none of model, transformer, language_model, backbone"


def test_ssm_family_keeps_its_state_caches_and_says_what_is_unavailable(tmp_path: Path) -> None:
    """mamba (state, not K/V): mlx-lm's ArraysCache stays, generation works, one line says what does not."""
    with Engine.load(str(random_mamba_folder(tmp_path))) as e:
        assert e.kv_stats()["kind"] == "contiguous"
        (line,) = e.info.warnings
        assert "ArraysCache" in line and "paged KV, prefix caching, batching and speculative decoding are " \
            "unavailable" in line and "\n" not in line
        assert len(run(e, [1, 2, 3], max_tokens=4)[0]) == 4


def test_sliding_layers_map_to_windows_on_the_views() -> None:
    """starcoder2's RotatingKVCache(max_size=8) on every layer becomes a window of 8 on the engine's views:
    transformers' logits and greedy tokens, 32 of them well past the window."""
    g = golden("starcoder2")
    ids = g["input_ids"].ravel().tolist()
    with Engine.load(str(GOLDEN / "starcoder2")) as e:
        assert e.info.warnings == () and any("on the engine's KV cache" in n for n in e.info.notes)
        want = g["logits"].reshape(len(ids), -1)
        assert_f32_close(e.forward_logits(ids), want, 66, "starcoder2 windowed views vs transformers")
        assert run(e, ids, max_tokens=32)[0] == g["greedy_tokens"].ravel().tolist()
