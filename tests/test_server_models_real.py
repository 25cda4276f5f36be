"""The multi-model server over real tiny models in a Hugging Face cache of the test's own: each name loads its model
just in time and answers exactly as that model loaded alone does (OpenAI's route and Ollama's), --max-models 1
swaps them, and an unloaded model's memory goes back (MLX's active memory to where it was, its cache emptied)."""

from __future__ import annotations


import httpx
import ollama
import pytest
from mlx_engine import Engine
from mlx_engine.api import GenerationRequest, SamplingParams
from mlx_engine.memory import held_memory, return_memory

from app.server import create_app
from app.server.run import model_pool
from tests.support.server_fakes import LiveServer, wait_until
from tests.support.model_stores import hf_cache_entry
from tests.support.tokenizer_files import write_tokenizer
from tests.support.tiny_models import random_llama_folder

PROMPT = [5, 17, 33, 8, 90]


@pytest.fixture(scope="module")
def machine(tmp_path_factory: pytest.TempPathFactory):
    """A home whose only models are two tiny llamas in its HF cache (and the embedded one)."""
    home = tmp_path_factory.mktemp("home")
    src = tmp_path_factory.mktemp("src")
    hub = home / ".cache" / "huggingface" / "hub"
    snaps = {}
    for name, seed in (("org/tiny-a", 1), ("org/tiny-b", 2)):
        folder = write_tokenizer(random_llama_folder(src / name.split("/")[1], seed=seed))
        snaps[name] = hf_cache_entry(hub, name, {p.name: p for p in folder.iterdir()})
    with pytest.MonkeyPatch.context() as mp:
        for k in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "XDG_CACHE_HOME", "OLLAMA_MODELS"):
            mp.delenv(k, raising=False)
        mp.setenv("HOME", str(home))
        mp.setenv("HF_HOME", str(home / ".cache" / "huggingface"))
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("ROOFLINE_HOME", str(home / "roofline"))
        yield snaps


def greedy(engine: Engine, n: int = 8) -> str:
    stream = engine.generate(GenerationRequest(prompt_token_ids=PROMPT,
                                               sampling=SamplingParams(max_tokens=n, temperature=0.0)))
    return "".join(e.text for e in stream)


def test_models_load_by_name_answer_as_alone_and_give_their_memory_back(machine) -> None:
    expected = {}
    for name, snap in machine.items():
        with Engine.load(str(snap), backend="mlx") as e:
            expected[name] = greedy(e)
    assert expected["org/tiny-a"] != expected["org/tiny-b"]  # the two models tell apart
    before = return_memory()
    pool = model_pool([], ["a=org/tiny-a"], None, {"backend": "mlx"}, max_models=1, keep_alive_s=300.0)
    with LiveServer(create_app(pool)) as s:
        ids = {m["id"]: m["loaded"] for m in httpx.get(s.url + "/v1/models").json()["data"]}
        assert ids == {"a": False, "embedded": False, "org/tiny-a": False, "org/tiny-b": False}
        for name in ("a", "org/tiny-b", "org/tiny-a"):
            r = httpx.post(s.url + "/v1/completions", json={"model": name, "prompt": PROMPT, "max_tokens": 8,
                                                            "temperature": 0}, timeout=120)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == expected[{"a": "org/tiny-a"}.get(name, name)]
        assert pool.loads == 3 and pool.unloads == 2  # one at a time: each switch unloaded the other
        client = ollama.Client(host=s.url)
        g = client.generate("org/tiny-b", "", keep_alive="5m")  # load only
        assert g.done_reason == "load" and [m.model for m in client.ps().models] == ["org/tiny-b"]
        loaded = held_memory()
        assert loaded.mlx_active_bytes > before.mlx_active_bytes  # its weights and KV
        r = client.generate("org/tiny-b", "", keep_alive=0)
        assert r.done_reason == "unload" and wait_until(lambda: pool.unloads == 4, 30)  # closed, memory handed back
        after = held_memory()
    assert after.mlx_cache_bytes == 0
    assert after.mlx_active_bytes <= before.mlx_active_bytes, (before, loaded, after)
