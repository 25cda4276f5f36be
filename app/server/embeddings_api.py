"""POST /v1/embeddings in OpenAI's shape: `input` (a string, strings, token ids or lists of them), `encoding_format`
float or base64 (little-endian float32, what the `openai` SDK asks for by default), `dimensions` (Matryoshka
truncation, renormalized), `usage.prompt_tokens`; and `prompt_name`, an instruction prefix of the checkpoint's
`prompts`. A chat model is refused with a 400 that says what to serve instead."""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any, cast

from mlx_engine.api import EmbedderLike, RequestError
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from app.server.errors import APIError, invalid
from app.server.fields import Fields, kind_of, parse_body, short
from app.server.protocol import check_model

ENCODING_FORMATS = ("float", "base64")
_PARAMS = ("dimensions", "prompt_name")  # a RequestError that starts with one of these names that field


@dataclass
class EmbeddingsJob:
    input: str | list[Any]
    encoding_format: str
    dimensions: int | None
    prompt_name: str | None


def parse_embeddings(body: dict[str, Any], model_names: set[str], served_id: str) -> EmbeddingsJob:
    """The request's fields, their types checked (400 naming the field); the inputs' contents are the engine's."""
    f = Fields(body)
    check_model(f, model_names, served_id)
    if body.get("input") is None:
        raise invalid("'input' is required: a string, an array of strings, or token ids (an array of integers or of "
                      "arrays of integers)", "input")
    value = body["input"]
    if not isinstance(value, (str, list)):
        raise invalid(f"'input' must be a string or an array, got {kind_of(value)}: {short(value)}", "input")
    fmt = f.string("encoding_format") or "float"
    if fmt not in ENCODING_FORMATS:
        raise invalid(f"'encoding_format' must be one of {', '.join(map(repr, ENCODING_FORMATS))}, got {fmt!r}",
                      "encoding_format")
    f.string("user")  # accepted and ignored, but it must be a string
    return EmbeddingsJob(input=value, encoding_format=fmt, dimensions=f.integer("dimensions", 1),
                         prompt_name=f.string("prompt_name"))


def _vector(row: Any, fmt: str) -> list[float] | str:
    if fmt == "base64":
        return base64.b64encode(row.astype("<f4").tobytes()).decode("ascii")
    return row.tolist()


async def run_embeddings(server: Any, res: Any, name: str, inputs: str | list[Any], dimensions: int | None,
                         prompt_name: str | None) -> Any:
    """The vectors of `inputs` from the checked-out model `res` (`api.Embeddings`), within the server's admission
    gate; a chat model, or inputs the engine refuses, are a 400 naming the part. Ollama's /api/embed serves this
    too (`ollama_routes`)."""
    info = res.served.info
    if not info.embeddings:
        raise invalid(f"the model '{name}' is a chat model: it has no pooling, so it gives no "
                      "embeddings (Roofline does not mean-pool a chat model's states); serve an embedding model "
                      "for embeddings: a sentence-transformers folder (modules.json) or a GGUF file with a "
                      "pooling type, e.g. `roofline serve -m Qwen/Qwen3-Embedding-0.6B`", "model",
                      "model_not_embedding")
    engine = cast(EmbedderLike, res.served.engine)
    await server.gate.acquire()
    try:
        return await run_in_threadpool(engine.embed, inputs, dimensions, prompt_name)
    except RequestError as e:
        message = str(e)
        param = next((p for p in _PARAMS if message.startswith(p)), "input")
        code = "context_length_exceeded" if "context" in message else None
        raise APIError(400, message, param, code) from None
    finally:
        server.gate.release()


def embeddings_route(server: Any) -> Route:
    """The route for `server` (app.server.app.Server: its models by name, body limits and admission gate)."""

    async def embeddings(request: Request) -> Response:
        res, name, body = await server._checkout(parse_body(await server._body(request)), "embeddings",
                                                 model_optional=True)
        try:
            return await embed(res, name, body)
        finally:
            server.pool.release(res)

    async def embed(res: Any, name: str, body: dict[str, Any]) -> Response:
        job = parse_embeddings(body, server._names(res, name), name)
        result = await run_embeddings(server, res, name, job.input, job.dimensions, job.prompt_name)
        data = [{"object": "embedding", "index": i, "embedding": _vector(row, job.encoding_format)}
                for i, row in enumerate(result.vectors)]
        n = result.prompt_tokens
        return JSONResponse({"object": "list", "data": data, "model": name,
                             "usage": {"prompt_tokens": n, "total_tokens": n}})

    return Route("/v1/embeddings", embeddings, methods=["POST"])
