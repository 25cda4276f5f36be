"""POST /v1/embeddings through the official `openai` client against a live server on a tiny sentence-transformers
checkpoint (tests/data/golden/st_qwen3_last): float and base64, dimensions, usage, 64 inputs in one request, and
bad input answered with a 400 naming the part while the server stays healthy."""

from __future__ import annotations

import base64
import json

import httpx
import numpy as np
import openai
import pytest
from mlx_engine import Engine

from tests.support.server_fakes import FakeEngine, LiveServer
from tests.support.tiny_models import GOLDEN
from tests.support.tolerance import assert_f32_close

LAST = GOLDEN / "st_qwen3_last"
SENTENCES = json.loads((LAST / "sentences.json").read_text())
GOLD = np.load(LAST / "golden.npz")
VS_ST = 56  # tests/test_embedding.py's floor against sentence-transformers


@pytest.fixture(scope="module")
def engine():
    with Engine.load(str(LAST)) as e:
        yield e


@pytest.fixture(scope="module")
def server(engine):
    from app.server import create_app

    with LiveServer(create_app(engine), drain_s=5) as s:
        yield s


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model_id(client) -> str:
    return client.models.list().data[0].id


def vectors(r) -> np.ndarray:
    assert [d.index for d in r.data] == list(range(len(r.data))) and all(d.object == "embedding" for d in r.data)
    return np.array([d.embedding for d in r.data], dtype=np.float32)


def test_float_embeddings_match_sentence_transformers(client, model_id, engine) -> None:
    r = client.embeddings.create(model=model_id, input=SENTENCES, encoding_format="float")
    assert r.object == "list" and r.model == model_id
    got = vectors(r)
    assert_f32_close(got, GOLD["plain"], VS_ST, "server float")
    n = sum(len(engine.tokenizer.encode(s)) for s in SENTENCES)
    assert r.usage.prompt_tokens == r.usage.total_tokens == n


def test_base64_is_the_same_float32_bytes(client, server, model_id) -> None:
    floats = vectors(client.embeddings.create(model=model_id, input=SENTENCES, encoding_format="float"))
    # the SDK asks for base64 when no format is given, and decodes it
    np.testing.assert_array_equal(vectors(client.embeddings.create(model=model_id, input=SENTENCES)), floats)
    raw = httpx.post(server.url + "/v1/embeddings", json={"input": SENTENCES, "encoding_format": "base64"}).json()
    decoded = [np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in raw["data"]]
    np.testing.assert_array_equal(np.stack(decoded), floats)


def test_dimensions_truncate_and_renormalize(client, model_id) -> None:
    got = vectors(client.embeddings.create(model=model_id, input=SENTENCES, dimensions=16, encoding_format="float"))
    want = GOLD["plain"][:, :16] / np.linalg.norm(GOLD["plain"][:, :16], axis=1, keepdims=True)
    assert got.shape == (len(SENTENCES), 16)
    assert_f32_close(got, want, VS_ST, "server dimensions=16")


def test_64_inputs_in_one_request_and_a_prompt_name(client, model_id, engine) -> None:
    texts = [f"{SENTENCES[i % len(SENTENCES)]} #{i}" for i in range(64)]
    got = vectors(client.embeddings.create(model=model_id, input=texts, encoding_format="float"))
    assert got.shape == (64, 64)
    np.testing.assert_array_equal(got, engine.embed(texts).vectors)
    query = vectors(client.embeddings.create(model=model_id, input=SENTENCES, encoding_format="float",
                                             extra_body={"prompt_name": "query"}))
    assert_f32_close(query, GOLD["query"], VS_ST, "server query")


def test_token_id_inputs(client, model_id, engine) -> None:
    ids = [engine.tokenizer.encode(s) for s in SENTENCES[:3]]
    got = vectors(client.embeddings.create(model=model_id, input=ids, encoding_format="float"))
    assert_f32_close(got, GOLD["plain"][:3], VS_ST, "server token ids")


@pytest.mark.parametrize("body, param, words", [
    ({"input": []}, "input", "input is empty"),
    ({"input": ""}, "input", "input[0] is an empty string"),
    ({"input": ["ok", "x" * 400]}, "input", "input[1] is 401 tokens but the model's context is 256 tokens"),
    ({"input": [[1, 2], [3, 5000]]}, "input", "input[1]: token id 5000 is outside the vocabulary"),
    ({"input": 5}, "input", "'input' must be a string or an array, got an integer"),
    ({}, "input", "'input' is required"),
    ({"input": "a", "dimensions": 0}, "dimensions", "'dimensions' must be an integer >= 1, got 0"),
    ({"input": "a", "dimensions": 65}, "dimensions", "dimensions=65: expected an integer from 1 to 64"),
    ({"input": "a", "encoding_format": "hex"}, "encoding_format", "'encoding_format' must be one of 'float', "
                                                                  "'base64', got 'hex'"),
    ({"input": "a", "prompt_name": "passage"}, "prompt_name", "prompt_name='passage' is not one of this model's"),
])
def test_bad_input_is_a_400_naming_the_part(server, body, param, words) -> None:
    r = httpx.post(server.url + "/v1/embeddings", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert words in error["message"] and error["param"] == param and error["type"] == "invalid_request_error"
    assert httpx.get(server.url + "/health").status_code == 200
    ok = httpx.post(server.url + "/v1/embeddings", json={"input": "still here", "encoding_format": "float"})
    assert ok.status_code == 200 and len(ok.json()["data"][0]["embedding"]) == 64


def test_an_unknown_model_is_a_404(server) -> None:
    r = httpx.post(server.url + "/v1/embeddings", json={"input": "a", "model": "gpt-4"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_chat_with_an_embedding_model_is_a_400(client, model_id, server) -> None:
    with pytest.raises(openai.BadRequestError, match="is an embedding model: it answers embeddings"):
        client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert httpx.get(server.url + "/health").status_code == 200


def test_a_chat_model_refuses_embeddings_and_names_what_to_serve() -> None:
    from app.server import create_app

    with LiveServer(create_app(FakeEngine())) as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=30)
        with pytest.raises(openai.BadRequestError) as e:
            client.embeddings.create(model="default", input="hi")
        error = e.value.body
        assert error["param"] == "model" and error["code"] == "model_not_embedding"
        assert "is a chat model" in error["message"] and "roofline serve -m" in error["message"]
        assert httpx.get(s.url + "/health").status_code == 200


def test_embeddings_need_the_api_key(engine) -> None:
    from app.server import create_app
    from app.server.config import ServerConfig

    with LiveServer(create_app(engine, ServerConfig(api_key="sk-test"))) as s:
        r = httpx.post(s.url + "/v1/embeddings", json={"input": "a"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        ok = httpx.post(s.url + "/v1/embeddings", json={"input": "a"}, headers={"Authorization": "Bearer sk-test"})
        assert ok.status_code == 200 and ok.json()["usage"]["prompt_tokens"] == 2


def test_ollama_embed_gives_the_same_vectors(client, server, model_id) -> None:
    """Ollama's /api/embed (and its older /api/embeddings) through the `ollama` client: the vectors of
    /v1/embeddings, the prompt's token count, and a 400 naming the field for what it cannot take."""
    import ollama

    want = vectors(client.embeddings.create(model=model_id, input=SENTENCES, encoding_format="float"))
    oc = ollama.Client(host=server.url)
    r = oc.embed(model=model_id, input=SENTENCES)
    np.testing.assert_array_equal(np.array(r.embeddings, dtype=np.float32), want)
    assert r.model == model_id and r.prompt_eval_count == client.embeddings.create(
        model=model_id, input=SENTENCES).usage.prompt_tokens
    one = oc.embeddings(model=model_id, prompt=SENTENCES[0])
    np.testing.assert_array_equal(np.array(one.embedding, dtype=np.float32), want[0])
    short16 = np.array(oc.embed(model=model_id, input=SENTENCES[0], dimensions=16).embeddings[0], dtype=np.float32)
    np.testing.assert_allclose(np.linalg.norm(short16), 1.0, rtol=1e-6)
    for body, field in (({"input": ""}, "input"), ({"input": [1, 2]}, "input"), ({"input": "hi", "truncate": "no"},
                        "truncate"), ({"input": "hi", "dimensions": 0}, "dimensions")):
        e = httpx.post(server.url + "/api/embed", json={"model": model_id, **body})
        assert e.status_code == 400 and e.json()["error"].startswith(f"'{field}'"), e.text
    assert httpx.get(server.url + "/health").status_code == 200
