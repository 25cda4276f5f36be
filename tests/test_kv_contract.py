"""The KV-cache contract (`mlx_engine.kv.protocol`): every cache kind implements it and declares what it can do,
front ends read the declaration, and nothing in the engine probes a cache or calls its private methods."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mlx_engine import Engine, GenerationRequest, RooflineError, SamplingParams
from mlx_engine.kv.protocol import KVCache, KVStorage, MLXLayerView
from tests.support.tiny_models import random_llama_folder

ROOT = Path(__file__).resolve().parent.parent
PROMPT = [(7 * i + 3) % 120 + 5 for i in range(40)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return random_llama_folder(tmp_path_factory.mktemp("m"))


def engine_source() -> list[tuple[str, str]]:
    return [(str(f.relative_to(ROOT)), f.read_text()) for f in sorted((ROOT / "mlx_engine").rglob("*.py"))]


def test_no_cache_runner_or_storage_is_probed() -> None:
    probe = re.compile(r"(hasattr|getattr)\((cache|runner|storage|self\.cache|self\.runner|self\._runner|"
                       r"self\.storage|\w+\.cache|\w+\.storage)\b")
    found = [f"{path}: {m.group(0)}" for path, text in engine_source() for m in probe.finditer(text)]
    assert not found, found


def test_nothing_outside_kv_calls_a_private_cache_method() -> None:
    private = re.compile(r"\bcache\.(_\w+|manager\b|storage\._\w+)")  # the manager: the bookkeeping's own
    found = [f"{path}: {m.group(0)}" for path, text in engine_source() if not path.startswith("mlx_engine/kv/")
             for m in private.finditer(text)]
    assert not found, found


def paged_cache():
    import mlx.core as mx

    from mlx_engine.kv.cache import PagedCache
    from mlx_engine.kv.config import KVConfig

    return PagedCache.create(num_layers=2, num_kv_heads=2, head_dim=32, dtype=mx.float32, context_length=256,
                             weight_bytes=0, config=KVConfig(kv_budget_bytes=2**20), model_id=b"test")


def test_the_mlx_caches_implement_the_contract() -> None:
    import mlx.core as mx

    from mlx_engine.kv.contiguous import ContiguousCache
    from mlx_engine.models.llama import Model, ModelArgs

    cache = paged_cache()
    assert isinstance(cache, KVCache) and isinstance(cache.storage, KVStorage)
    caps = cache.capabilities
    assert caps.paged and caps.batching and caps.packed and caps.rollback and caps.kv_files and not caps.quantized
    assert cache.blocks_for(33) == 3 and cache.num_blocks_held("r") == 0
    free = cache.num_free_blocks()
    assert cache.start("r", PROMPT) == 0
    views = cache.prefill_layers("r", 0, len(PROMPT))
    assert len(views) == 2 and all(isinstance(v, MLXLayerView) for v in views)
    assert cache.num_blocks_held("r") == 3 and cache.num_free_blocks() == free - 3
    cache.allocate("r", PROMPT, 10)
    cache.trim("r", 41)
    assert cache.num_blocks_held("r") == 3
    cache.free("r")
    assert cache.num_free_blocks() == free

    model = Model(ModelArgs("llama", hidden_size=32, num_hidden_layers=2, intermediate_size=64, num_attention_heads=2,
                            vocab_size=128))
    contiguous = ContiguousCache(model, native=True)
    assert isinstance(contiguous, KVCache)
    caps = contiguous.capabilities
    assert not (caps.paged or caps.batching or caps.packed or caps.kv_files) and caps.rollback
    assert contiguous.blocks_for(33) == contiguous.num_free_blocks() == 0
    contiguous.start("r", PROMPT)
    layers = contiguous.prefill_layers("r", 0, len(PROMPT))
    assert all(isinstance(v, MLXLayerView) for v in layers)
    mx.eval(model(mx.array([PROMPT]), layers))
    contiguous.allocate("score", PROMPT, len(PROMPT))  # another request: buffers of its own
    assert contiguous.prefill_layers("score", 0, 5) is not layers and layers[0].offset == len(PROMPT)
    contiguous.trim("r", 30)
    assert layers[0].offset == 30


def test_front_ends_read_kv_files_from_model_info(folder: Path) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    with Engine.load(str(folder), block_size=16) as e:
        assert e.info.kv_files
    with Engine.load(str(folder), paged_kv=False) as e:
        assert not e.info.kv_files
        with pytest.raises(RooflineError, match="saving KV needs the paged KV cache"):
            e.save_kv("/nonexistent.kv", PROMPT)
        # scoring gets buffers of its own: the chat's cached prefix stays
        list(e.generate(GenerationRequest(prompt_token_ids=PROMPT, sampling=params)))
        e.score(PROMPT[:20])
        final = list(e.generate(GenerationRequest(prompt_token_ids=PROMPT + [9], sampling=params)))[-1]
        assert final.usage.cached_prompt_tokens == len(PROMPT)


def test_the_torch_cache_implements_the_contract(folder: Path) -> None:
    from tests.support.torch_support import require

    torch = require()
    from mlx_engine.backends.torch.kv import TorchPagedCache
    from mlx_engine.kv.config import KVConfig

    cache = TorchPagedCache.create_torch(num_layers=2, num_kv_heads=2, head_dim=32, dtype=torch.float32,
                                         device=torch.device("cpu"), context_length=256, weight_bytes=0,
                                         config=KVConfig(kv_budget_bytes=2**20), model_id=b"test")
    assert isinstance(cache, KVCache) and isinstance(cache.storage, KVStorage)
    caps = cache.capabilities
    assert caps.paged and caps.batching and caps.packed and caps.rollback and not caps.kv_files
    assert cache.start("r", PROMPT) == 0 and cache.num_blocks_held("r") == 3
    with Engine.load(str(folder), backend="torch", device="cpu", block_size=16) as e:
        assert not e.info.kv_files  # its KV cannot be saved: front ends offer no KV files
        with pytest.raises(RooflineError, match="saving KV is not supported on the torch backend"):
            e.save_kv("/nonexistent.kv", PROMPT)
