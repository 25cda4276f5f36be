"""Ollama's API on the server's port, for the desktop clients that speak it (Open WebUI, Enchanted, Msty, Raycast,
Zed, ...): /api/chat and /api/generate (through the server's completion path: `ollama_api`), /api/tags (every model
served), /api/ps (those loaded, with when each unloads), /api/show, /api/version. A chat or generate body with no
prompt loads the model (and with keep_alive 0 unloads it), as Ollama's do; /api/embed and /api/embeddings serve an
embedding model's vectors as /v1/embeddings does. Pulling, creating, copying and deleting models are
`roofline pull` / `roofline rm`'s (501 naming them)."""

from __future__ import annotations

import hashlib
import time
from typing import TYPE_CHECKING, Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from app.server.embeddings_api import run_embeddings
from app.server.errors import APIError, invalid
from app.server.fields import kind_of, parse_body, short
from app.server.models_pool import pool_cards
from app.server.ollama_api import is_load_only, iso_now

if TYPE_CHECKING:
    from app.server.app import Server

# the Ollama API release whose routes and fields this serves: clients gate features on it
OLLAMA_API_VERSION = "0.12.0"


def _size(n: int | None) -> str:
    if not n:
        return ""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)


def _details(card: dict[str, Any]) -> dict[str, Any]:
    family = card.get("model_type") or ""
    return {"parent_model": "", "format": "gguf" if "gguf" in str(card.get("ref", "")).lower() else "",
            "family": family, "families": [family] if family else None,
            "parameter_size": _size(card.get("num_parameters")), "quantization_level": card.get("quantization") or ""}


def _tag(card: dict[str, Any]) -> dict[str, Any]:
    return {"name": card["id"], "model": card["id"], "modified_at": iso_now(), "size": card.get("size_bytes") or 0,
            "digest": hashlib.sha256(str(card.get("ref", card["id"])).encode()).hexdigest(), "details": _details(card)}


class OllamaRoutes:
    def __init__(self, server: Server):
        self.server = server

    async def _cards(self) -> list[dict[str, Any]]:
        pool = self.server.pool
        if pool.multi:
            return await run_in_threadpool(pool_cards, pool, self.server.created)
        served = next(iter(pool.residents.values())).served
        return [{**served.model_card(), "ref": served.info.path, "loaded": True}]

    async def tags(self, request: Request) -> Response:
        return JSONResponse({"models": [_tag(c) for c in await self._cards()]})

    async def ps(self, request: Request) -> Response:
        out = []
        for res in list(self.server.pool.residents.values()):
            card = {**res.served.model_card(), "id": res.preset.name, "ref": res.preset.ref}
            expires = res.expires_at if res.expires_at is not None else time.time() + 10 * 365 * 86400
            if res.in_flight:
                expires = time.time() + (res.keep_alive if res.keep_alive is not None else 10 * 365 * 86400)
            out.append({**_tag(card), "size": res.served.info.weight_bytes, "size_vram": 0,
                        "context_length": res.served.info.context_length,
                        "expires_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(expires))})
        return JSONResponse({"models": out})

    async def show(self, request: Request) -> Response:
        body = parse_body(await self.server._body(request))
        name = body.get("model", body.get("name"))
        pool = self.server.pool
        if pool.multi:
            assert pool.table is not None
            preset = await run_in_threadpool(pool.table.resolve, name)
            card = next((c for c in await self._cards() if c["id"] == preset.name), None) or {"id": preset.name}
        else:
            res, _ = await pool.checkout(name)
            pool.release(res)
            card, preset = (await self._cards())[0], res.preset
        loaded = next((r for r in pool.residents.values() if r.preset.name == card["id"]), None)
        params = "\n".join(f"{k} {v}" for k, v in preset.sampling.items())
        arch = card.get("model_type") or "unknown"
        caps = ["completion"]
        template = ""
        if loaded is not None:
            template = getattr(loaded.served.engine.tokenizer, "chat_template", None) or ""
            if "tools" in template:
                caps.append("tools")
            if loaded.served.reasons:
                caps.append("thinking")
        system = f'SYSTEM """{preset.system}"""\n' if preset.system else ""
        return JSONResponse({"modelfile": f"FROM {preset.ref}\n{system}" + "".join(
                                f"PARAMETER {k} {v}\n" for k, v in preset.sampling.items()),
                             "parameters": params, "template": template, "system": preset.system or "",
                             "details": _details(card), "capabilities": caps, "modified_at": iso_now(),
                             "model_info": {"general.architecture": arch,
                                            "general.parameter_count": card.get("num_parameters") or 0,
                                            f"{arch}.context_length": card.get("context_length") or 0}})

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": OLLAMA_API_VERSION})

    async def embed(self, request: Request) -> Response:
        """/api/embed ({model, input: string or strings, dimensions, truncate, keep_alive} -> embeddings) and the
        older /api/embeddings ({model, prompt} -> embedding), through the /v1/embeddings path's engine call."""
        legacy = request.url.path == "/api/embeddings"
        body = parse_body(await self.server._body(request))
        field = "prompt" if legacy else "input"
        value = body.get(field)
        if isinstance(value, str) and value == "" or value is None or isinstance(value, list) and not value:
            raise invalid(f"'{field}' is required: {'a string' if legacy else 'a string or an array of strings'}",
                          field)
        if not isinstance(value, str) and (legacy or not isinstance(value, list)
                                           or not all(isinstance(v, str) for v in value)):
            raise invalid(f"'{field}' must be {'a string' if legacy else 'a string or an array of strings'}, got "
                          f"{kind_of(value)}: {short(value)}", field)
        if not isinstance(body.get("truncate", True), bool):
            raise invalid(f"'truncate' must be a boolean, got {short(body['truncate'])}", "truncate")
        # truncate true (Ollama's default) would cut an input to the context: here it is a 400 naming the input
        # either way, as truncate false asks, rather than a vector of a text the client did not send
        dimensions = body.get("dimensions")
        if dimensions is not None and (not isinstance(dimensions, int) or isinstance(dimensions, bool)
                                       or dimensions < 1):
            raise invalid(f"'dimensions' must be an integer >= 1, got {short(dimensions)}", "dimensions")
        start = time.perf_counter_ns()
        res, name, _ = await self.server._checkout(body, "embeddings")
        try:
            result = await run_embeddings(self.server, res, name, value, dimensions, None)
        finally:
            self.server.pool.release(res)
        vectors = [row.tolist() for row in result.vectors]
        if legacy:
            return JSONResponse({"embedding": vectors[0]})
        return JSONResponse({"model": name, "embeddings": vectors, "total_duration": time.perf_counter_ns() - start,
                             "load_duration": 0, "prompt_eval_count": result.prompt_tokens})

    async def manage(self, request: Request) -> Response:
        raise APIError(501, f"{request.url.path} is not served: models are managed with `roofline pull`, "
                       "`roofline rm` and `roofline models` (or Ollama's own CLI for its store)", None,
                       "not_implemented")

    async def chat(self, request: Request) -> Response:
        return await self._maybe_load(request, "chat")

    async def generate(self, request: Request) -> Response:
        return await self._maybe_load(request, "generate")

    async def _maybe_load(self, request: Request, kind: str) -> Response:
        body = parse_body(await self.server._body(request))
        if not is_load_only(body, kind):
            request.state.body = body
            return await self.server._complete(request, f"ollama_{kind}")
        res, name, _ = await self.server._checkout(body, kind)
        self.server.pool.release(res)
        unloading = res.keep_alive == 0 and not res.pinned
        out: dict[str, Any] = {"model": name, "created_at": iso_now(), "done": True,
                               "done_reason": "unload" if unloading else "load"}
        out.update({"message": {"role": "assistant", "content": ""}} if kind == "chat" else {"response": ""})
        return JSONResponse(out)


def ollama_routes(server: Server) -> list[Route]:
    r = OllamaRoutes(server)
    return [
        Route("/api/chat", r.chat, methods=["POST"]),
        Route("/api/generate", r.generate, methods=["POST"]),
        Route("/api/tags", r.tags, methods=["GET"]),
        Route("/api/ps", r.ps, methods=["GET"]),
        Route("/api/show", r.show, methods=["POST"]),
        Route("/api/version", r.version, methods=["GET"]),
        Route("/api/embed", r.embed, methods=["POST"]),
        Route("/api/embeddings", r.embed, methods=["POST"]),
        *(Route(f"/api/{p}", r.manage, methods=["POST", "DELETE"]) for p in ("pull", "push", "create", "copy",
                                                                              "delete")),
    ]
