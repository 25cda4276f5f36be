"""The multi-model server (`roofline serve` without -m, or with several): models loaded just in time by name, the
least recently used idle one evicted to fit (never one with requests in flight), keep-alive, aliases and
models.toml presets, and the errors for names that are not on the machine or that are files. Scripted engines
(tests/support/server_fakes.py) stand in for models here; tests/test_server_models_real.py loads real tiny ones."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from mlx_engine.api import RooflineError

from app.server import create_app
from app.server.errors import APIError
from app.server.model_table import Preset, parse_aliases, parse_keep_alive, read_models_file
from app.server.models_pool import ModelPool
from tests.support.pool_fakes import REFS, Loads, make_pool
from tests.support.server_fakes import LiveServer, wait_until

def budget_fits(pool_ref: list[ModelPool], units: int):
    """A memory budget of `units`: org/big takes 2, the others 1 each."""
    def fits(p: Preset) -> str | None:
        held = sum(2 if r.preset.ref == "org/big" else 1 for r in pool_ref[0].residents.values())
        need = 2 if p.ref == "org/big" else 1
        return None if held + need <= units else f"{p.ref} needs {need} units, {units - held} free"
    return fits


def chat(model: Any, **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "Hi"}], **extra}


# ---- the pool itself ---------------------------------------------------------------------------------------

def test_eviction_takes_the_least_recently_used_idle_model() -> None:
    loads = Loads()
    pool = make_pool(loads, max_models=2)

    async def use(name: str) -> None:
        res, _ = await pool.checkout(name)
        pool.release(res)

    async def run() -> None:
        for name in ("org/a", "org/b", "org/a", "org/c"):  # b is the least recently used when c comes
            await use(name)

    asyncio.run(run())
    assert loads.loaded == ["org/a", "org/b", "org/c"]
    assert loads.closed == ["org/b"] and loads.engines["org/b"].closed
    assert sorted(r.preset.ref for r in pool.residents.values()) == ["org/a", "org/c"]


def test_a_memory_budget_evicts_idle_models_oldest_first_until_the_new_one_fits() -> None:
    loads = Loads()
    ref: list[ModelPool] = []
    pool = make_pool(loads)
    pool._fits = budget_fits(ref, 3)
    ref.append(pool)

    async def run() -> None:
        for name in ("org/a", "org/b", "org/c", "org/big"):  # a, b, c fill 3 units; big needs 2: a, then b go
            res, _ = await pool.checkout(name)
            pool.release(res)

    asyncio.run(run())
    assert loads.closed == ["org/a", "org/b"]
    assert sorted(r.preset.ref for r in pool.residents.values()) == ["org/big", "org/c"]


def test_a_model_with_requests_in_flight_is_never_evicted() -> None:
    loads = Loads()
    pool = make_pool(loads, max_models=1, wait_s=0.2)

    async def refused() -> APIError:
        held, _ = await pool.checkout("org/a")
        with pytest.raises(APIError) as e:
            await pool.checkout("org/b")  # a is busy for longer than wait_s
        pool.release(held)
        return e.value

    async def waits() -> list[str]:
        held, _ = await pool.checkout("org/a")
        pool.wait_s = 5
        later = asyncio.ensure_future(pool.checkout("org/b"))
        await asyncio.sleep(0.1)
        assert not later.done() and loads.closed == []  # b waits while a runs
        pool.release(held)
        res, _ = await later
        pool.release(res)
        return [r.preset.ref for r in pool.residents.values()]

    async def both() -> tuple[APIError, list[str]]:  # one loop, as a server has
        err = await refused()
        assert loads.closed == []
        return err, await waits()

    err, left = asyncio.run(both())
    assert (err.status, err.code, err.param) == (503, "models_busy", "model")
    assert "--max-models 1" in err.message
    assert left == ["org/b"] and loads.closed == ["org/a"]


def test_requests_for_a_loading_model_share_its_load_and_the_queue_limit_holds() -> None:
    loads = Loads(delay_s=0.3)
    pool = make_pool(loads, max_waiting=2)

    async def run() -> list[Any]:
        tries = [asyncio.ensure_future(pool.checkout("org/a")) for _ in range(3)]
        return await asyncio.gather(*tries, return_exceptions=True)

    results = asyncio.run(run())
    assert loads.loaded == ["org/a"]  # one load for both that waited
    assert [type(r).__name__ for r in results] == ["tuple", "tuple", "APIError"]
    assert results[2].status == 429 and results[2].code == "rate_limit_exceeded"
    assert results[0][0] is results[1][0] and results[0][0].in_flight == 2


def test_keep_alive_parses_seconds_durations_and_forever() -> None:
    assert parse_keep_alive(30, "x") == 30.0
    assert parse_keep_alive("5m", "x") == 300.0
    assert parse_keep_alive("1h30m", "x") == 5400.0
    assert parse_keep_alive("90s", "x") == 90.0
    assert parse_keep_alive("0", "x") == 0.0
    assert parse_keep_alive("forever", "x") is None and parse_keep_alive(-1, "x") is None
    assert parse_keep_alive("-1m", "x") is None
    for bad in ("soon", True, "5 minutes", ""):
        with pytest.raises(ValueError, match="x: expected seconds"):
            parse_keep_alive(bad, "x")


# ---- over HTTP -------------------------------------------------------------------------------------------

def test_a_request_loads_its_model_once_and_v1_models_says_what_is_loaded() -> None:
    loads = Loads()
    with LiveServer(create_app(make_pool(loads))) as s:
        listed = httpx.get(s.url + "/v1/models").json()["data"]
        assert [m["id"] for m in listed] == list(REFS) and not any(m["loaded"] for m in listed)
        for _ in range(2):
            r = httpx.post(s.url + "/v1/chat/completions", json=chat("org/b"))
            assert r.status_code == 200 and r.json()["model"] == "org/b"
            assert r.json()["choices"][0]["message"]["content"] == "Hello world"
        r = httpx.post(s.url + "/v1/chat/completions", json=chat("tiny"))  # an Ollama name, as its clients write it
        assert r.status_code == 200 and r.json()["model"] == "tiny"
        assert loads.loaded == ["org/b", "ollama:tiny:latest"]
        listed = {m["id"]: m["loaded"] for m in httpx.get(s.url + "/v1/models").json()["data"]}
        assert listed == {"org/a": False, "org/b": True, "org/c": False, "ollama:tiny:latest": True, "org/big": False}
        assert httpx.get(s.url + "/v1/models/org/b").json()["loaded"] is True


def test_names_not_on_the_machine_and_file_paths_are_refused_clearly() -> None:
    loads = Loads()
    with LiveServer(create_app(make_pool(loads))) as s:
        r = httpx.post(s.url + "/v1/chat/completions", json=chat("org/nope"))
        e = r.json()["error"]
        assert r.status_code == 404 and e["code"] == "model_not_found" and e["param"] == "model"
        assert "'org/nope' is not on this machine" in e["message"] and "roofline models" in e["message"]
        assert "roofline pull" in e["message"]
        for path in ("/home/me/model.gguf", "~/models/x", "./x", "model.gguf", "C:\\m\\x"):
            r = httpx.post(s.url + "/v1/chat/completions", json=chat(path))
            e = r.json()["error"]
            assert r.status_code == 400 and e["code"] == "model_path_refused" and "never name files" in e["message"]
        r = httpx.post(s.url + "/v1/chat/completions", json=chat(7))
        assert r.status_code == 400 and r.json()["error"]["param"] == "model"
        r = httpx.post(s.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}]})
        assert r.status_code == 400 and r.json()["error"]["code"] == "missing_required_parameter"
        r = httpx.post(s.url + "/v1/chat/completions", json=chat("org/a", keep_alive="later"))
        assert r.status_code == 400 and r.json()["error"]["param"] == "keep_alive"
        assert "'keep_alive': expected seconds" in r.json()["error"]["message"]
    assert loads.loaded == []  # nothing loaded for any of them


def test_idle_models_unload_after_the_keep_alive_and_a_request_can_set_it() -> None:
    loads = Loads()
    pool = make_pool(loads, keep_alive_s=0.3)
    with LiveServer(create_app(pool)) as s:
        assert httpx.post(s.url + "/v1/chat/completions", json=chat("org/a")).status_code == 200
        assert [r.preset.ref for r in pool.residents.values()] == ["org/a"]
        assert wait_until(lambda: loads.closed == ["org/a"], 5) and not pool.residents
        # keep_alive 0: gone as soon as its request ends; "forever": stays past the server's keep-alive
        assert httpx.post(s.url + "/v1/chat/completions", json=chat("org/b", keep_alive=0)).status_code == 200
        assert wait_until(lambda: loads.closed == ["org/a", "org/b"], 5)
        assert httpx.post(s.url + "/v1/chat/completions", json=chat("org/c", keep_alive="forever")).status_code == 200
        time.sleep(0.6)
        assert loads.closed == ["org/a", "org/b"] and [r.preset.ref for r in pool.residents.values()] == ["org/c"]
        assert pool.residents and next(iter(pool.residents.values())).expires_at is None
    assert loads.closed == ["org/a", "org/b", "org/c"]  # the server's stop unloads what is left


def test_a_busy_model_is_not_unloaded_by_its_keep_alive() -> None:
    loads = Loads()
    pool = make_pool(loads, keep_alive_s=0.05)
    with LiveServer(create_app(pool)) as s:
        body = {"model": "org/a", "prompt": "[slow][long]", "max_tokens": 30}
        r = httpx.post(s.url + "/v1/completions", json=body, timeout=30)  # ~0.6 s of tokens, 12x the keep-alive
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == ("Hello world" * 4)[:30]
        assert wait_until(lambda: loads.closed == ["org/a"], 5)


# ---- aliases and models.toml -------------------------------------------------------------------------------

MODELS_TOML = """
default = "chat"

[models.chat]
ref = "org/a"
context = 2048
kv_bits = 8
system = "Be terse."
temperature = 0.25
top_k = 40
repeat_penalty = 1.1
stop = "END"
num_predict = 5
keep_alive = "10m"

[models."org/c"]
temperature = 0.5
"""


def test_models_toml_presets_give_defaults_that_requests_override(tmp_path: Path) -> None:
    f = tmp_path / "models.toml"
    f.write_text(MODELS_TOML)
    presets, default = read_models_file(f)
    assert default == "chat" and presets["chat"].keep_alive == 600.0
    loads = Loads()
    pool = make_pool(loads, presets, default)
    with LiveServer(create_app(pool)) as s:
        r = httpx.post(s.url + "/v1/chat/completions", json=chat("chat"))
        assert r.status_code == 200 and r.json()["model"] == "chat"
        assert r.json()["choices"][0]["message"]["content"] == "Hello"  # num_predict 5
        engine = loads.engines["org/a"]
        assert loads.options == [{"max_context": 2048, "kv_bits": 8}]
        p = engine.requests[-1].sampling
        assert (p.temperature, p.top_k, p.repetition_penalty, p.stop, p.max_tokens) == (0.25, 40, 1.1, ("END",), 5)
        assert engine.tokenizer.decode(engine.requests[-1].prompt_token_ids).startswith("<system>Be terse.<user>Hi")
        body = chat("default", temperature=1.5, max_tokens=3,
                    messages=[{"role": "system", "content": "Mine."}, {"role": "user", "content": "Hi"}])
        r = httpx.post(s.url + "/v1/chat/completions", json=body)
        assert r.status_code == 200 and r.json()["model"] == "chat" and loads.loaded == ["org/a"]
        p = engine.requests[-1].sampling
        assert (p.temperature, p.max_tokens) == (1.5, 3)
        assert engine.tokenizer.decode(engine.requests[-1].prompt_token_ids).startswith("<system>Mine.<user>Hi")
        # a table named by a ref sets that ref's defaults; /v1/models lists presets first
        assert httpx.post(s.url + "/v1/chat/completions", json=chat("org/c")).status_code == 200
        assert loads.engines["org/c"].requests[-1].sampling.temperature == 0.5
        ids = [m["id"] for m in httpx.get(s.url + "/v1/models").json()["data"]]
        assert ids[:2] == ["chat", "org/c"] and "org/a" in ids
        assert [r.keep_alive for r in pool.residents.values()] == [600.0, 300.0]


@pytest.mark.parametrize("text, expected", [
    ("[models.x]\ntemperature = 3\n", "models.x.temperature: expected a number in [0, 2], got 3"),
    ("[models.x]\ncolour = 'red'\n", "models.x.colour: unknown field (expected one of ref, system"),
    ("[models.x]\nkv_bits = 6\n", "models.x.kv_bits: expected 4 or 8, got 6"),
    ("[models.x]\ncontext = '8k'\n", "models.x.context: expected an integer >= 1, got '8k'"),
    ("[models.x]\nkeep_alive = 'soon'\n", "models.x.keep_alive: expected seconds"),
    ("[models.x]\nstop = []\n", "models.x.stop: expected a string or an array of 1 to 4"),
    ("[models\n", "not valid TOML"),
    ("default = 3\n", "default: expected a model name, got 3"),
    ("model = 'x'\n", "unknown top-level field 'model'"),
])
def test_a_bad_models_toml_is_one_line_naming_the_file_and_field(tmp_path: Path, text: str, expected: str) -> None:
    f = tmp_path / "models.toml"
    f.write_text(text)
    with pytest.raises(RooflineError) as e:
        read_models_file(f)
    assert str(e.value).startswith(f"{f}: ") and expected in str(e.value) and "\n" not in str(e.value)


def test_an_alias_and_its_ref_share_one_engine() -> None:
    loads = Loads()
    presets = {n: Preset(n, r) for n, r in parse_aliases(["fast=org/a"]).items()}
    with LiveServer(create_app(make_pool(loads, presets))) as s:
        for name in ("fast", "org/a", "fast"):
            r = httpx.post(s.url + "/v1/chat/completions", json=chat(name))
            assert r.status_code == 200 and r.json()["model"] == name
    assert loads.loaded == ["org/a"]
    with pytest.raises(RooflineError, match="--alias 'fast': expected NAME=REF"):
        parse_aliases(["fast"])


def test_the_tokenizer_routes_and_messages_pick_the_model_by_name() -> None:
    loads = Loads()
    with LiveServer(create_app(make_pool(loads))) as s:
        r = httpx.post(s.url + "/tokenize", json={"model": "org/c", "prompt": "ab"})
        assert r.status_code == 200 and r.json()["tokens"] == [2, 97, 98]
        r = httpx.post(s.url + "/v1/messages", json={"model": "org/a", "max_tokens": 5,
                                                      "messages": [{"role": "user", "content": "Hi"}]})
        assert r.status_code == 200 and r.json()["model"] == "org/a"
        assert r.json()["content"] == [{"type": "text", "text": "Hello"}]
        assert loads.loaded == ["org/c", "org/a"]


@pytest.mark.parametrize("args, expected", [
    (["--keep-alive", "soon"], "--keep-alive: expected seconds, a duration like '5m' or '1h', or 'forever', got 'soon'"),
    (["--max-models", "0"], "--max-models 0: expected an integer >= 1"),
    (["--models-file", "/nonexistent/models.toml"], "--models-file /nonexistent/models.toml: no such file"),
    (["-m", "embedded", "--alias", "a=b"], "--alias is for serving several models: give -m more than once, or none"),
    (["--alias", "ab"], "--alias 'ab': expected NAME=REF, like chat=ollama:qwen3:4b"),
])
def test_serve_flags_for_several_models_are_checked_before_anything_loads(capsys, tmp_path: Path, args: list[str],
                                                                            expected: str) -> None:
    from app.cli import main

    empty = tmp_path / "models.toml"
    empty.write_text("")
    extra = [] if "--models-file" in args or "-m" in args else ["--models-file", str(empty)]
    assert main(["serve", "--port", "9", *extra, *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"roofline: error: {expected}", err
