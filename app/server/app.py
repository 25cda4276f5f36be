"""The HTTP app, OpenAI-compatible (and Anthropic's Messages API): routes, auth, body limits, admission, and the SSE
response.

A request's life: read the body (<= 4 MiB) -> validate it into a Job -> wait for an admission slot (or 429)
-> tokenize and submit on a worker thread (engine RequestError -> 400) -> stream or collect events while a
watcher cancels the generation if the client goes away. The slot is released when the engine has
finished with the request, not when the response ends. A request of several choices (`n`, or several
completion prompts) holds one slot and runs a generation per choice (they batch in the engine).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal

from mlx_engine.api import EngineLike, GenerationEvent, RequestError
from mlx_engine.memory import held_memory
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from app.server.anthropic_api import parse_messages
from app.server.anthropic_reply import MessagesFormatter, message_events, model_list
from app.server.bridge import AdmissionGate, DisconnectWatch, Generation, accepted_draft_tokens, total_usage
from app.server.config import ServerConfig
from app.server.errors import (
    APIError,
    api_error_handler,
    from_request_error,
    http_error_handler,
    invalid,
    server_error_handler,
)
from app.server.model_table import apply_defaults, parse_keep_alive
from app.server.models_pool import _UNSET, ModelPool, Resident, pool_cards
from app.server.ollama_api import OllamaFormatter, ollama_events, parse_ollama
from app.server.ollama_routes import ollama_routes
from app.server.served import Served
from app.server.guard import (AuthMiddleware, CountRequests, Drain, HostCheck, JSONCORSMiddleware, RequestGuard,
                              origin_pattern)
from app.server.metrics import Metrics, memory_lines
from app.server.embeddings_api import embeddings_route
from app.server.fields import parse_body
from app.server.protocol import Endpoint, Job, parse_job
from app.server.tokenize import parse_detokenize, parse_tokenize
from app.server.responses import DONE, Choice, Formatter, error_chunk, sse, token_str
from app.server.responses_api import ResponsesFormatter, parse_responses, response_events
from app.server.transport import NDJSON, EventStreamResponse, read_body
from app.server.harmony_tools import call_deltas

AnyFormatter = Formatter | ResponsesFormatter | MessagesFormatter | OllamaFormatter


class Server:
    """State shared by the routes: the models (one, or a pool loaded by name), admission, metrics."""

    def __init__(self, pool: ModelPool, config: ServerConfig):
        self.pool = pool
        self.config = config
        self.created = int(time.time())
        self.gate = AdmissionGate(config.max_concurrency, config.max_queue)
        self.metrics = Metrics()
        self.generations: set[Generation] = set()
        self.drain = Drain()

    @property
    def model_id(self) -> str:
        """The served model's id (one model), or what `serve` prints for a pool."""
        if self.pool.multi:
            return "any model on this machine, by name"
        return next(iter(self.pool.residents.values())).served.model_id

    async def _checkout(self, body: dict[str, Any], endpoint: str, model_optional: bool = False
                        ) -> tuple[Resident, str, dict[str, Any]]:
        """The model a request's body names, held until `pool.release`; its name for replies; the body with the
        model's preset defaults."""
        keep: Any = _UNSET
        if body.get("keep_alive") is not None:
            try:
                keep = parse_keep_alive(body["keep_alive"], "'keep_alive'")
            except ValueError as e:
                raise invalid(str(e), "keep_alive") from None
        model = body.get("model")
        res, name = await self.pool.checkout("default" if model is None and model_optional else model, keep)
        if self.pool.multi and isinstance(model, str) and model != "default":
            name = model  # replies carry the name as the client sent it ("qwen3" for "ollama:qwen3:latest")
        return res, name, apply_defaults(body, endpoint, res.preset)

    def _names(self, res: Resident, name: str) -> set[str]:
        return {name, "default"} if self.pool.multi else res.served.model_names

    async def _body(self, request: Request) -> bytes:
        return await read_body(request, self.config.max_body_bytes, self.config.body_timeout_s)

    # ---- routes ----------------------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def models(self, request: Request) -> Response:
        if not self.pool.multi:
            served = next(iter(self.pool.residents.values())).served
            if "anthropic-version" in request.headers:  # an Anthropic client: its shape
                return JSONResponse(model_list(served.anthropic_card()))
            return JSONResponse({"object": "list", "data": [{**served.model_card(), "loaded": True}]})
        cards = await run_in_threadpool(pool_cards, self.pool, self.created)
        if "anthropic-version" in request.headers:
            data = [{"type": "model", "id": c["id"], "display_name": c["name"], "created_at": "1970-01-01T00:00:00Z"}
                    for c in cards]
            return JSONResponse({"data": data, "has_more": False, "first_id": data[0]["id"] if data else None,
                                 "last_id": data[-1]["id"] if data else None})
        return JSONResponse({"object": "list", "data": cards})

    async def model(self, request: Request) -> Response:
        name = request.path_params["model"]
        if self.pool.multi:
            cards = await run_in_threadpool(pool_cards, self.pool, self.created)
            card = next((c for c in cards if c["id"] == name), None)
            if card is None:
                await run_in_threadpool(self.pool.table.resolve, name)  # type: ignore[union-attr]  # its 404 or 400
                card = {"id": name, "object": "model", "owned_by": "roofline", "loaded": False}
            return JSONResponse(card)
        served = next(iter(self.pool.residents.values())).served
        if name not in served.model_names:
            raise APIError(404, f"The model '{name}' does not exist: this server serves '{served.model_id}'",
                           "model", "model_not_found")
        if "anthropic-version" in request.headers:
            return JSONResponse(served.anthropic_card())
        return JSONResponse(served.model_card())

    async def metrics_text(self, request: Request) -> Response:
        recent = self.pool.recent()
        kv, age = await run_in_threadpool(recent.served.kv.read, self.config.metrics_wait_s) if recent else (None, None)
        engine_waiting = sum(1 for g in self.generations if not g.started)
        text = self.metrics.render(self.gate.waiting, engine_waiting, kv, age)
        text += memory_lines(await run_in_threadpool(held_memory), len(self.pool.residents))
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    # ---- the tokenizer (vLLM's routes: lm-evaluation-harness tokenizes through them, with no download) -----

    async def tokenize(self, request: Request) -> Response:
        body = parse_body(await self._body(request))
        res, name, body = await self._checkout(body, "tokenize", model_optional=True)
        try:
            m = res.served
            job = parse_tokenize(body, self._names(res, name), name, m.tool_format)
            tok = m.engine.tokenizer

            def run() -> list[int]:
                if job.messages is not None:
                    return tok.encode_chat(job.messages, add_generation_prompt=job.add_generation_prompt)
                return tok.encode(job.prompt or "", add_special_tokens=job.add_special_tokens)

            try:
                ids = await run_in_threadpool(run)
            except RequestError as e:
                raise from_request_error(str(e), {}) from None
            out: dict[str, Any] = {"count": len(ids), "max_model_len": m.info.context_length, "tokens": ids}
            if job.return_token_strs:
                out["token_strs"] = [token_str(m.token_bytes(t)) for t in ids]
            return JSONResponse(out)
        finally:
            self.pool.release(res)

    async def detokenize(self, request: Request) -> Response:
        body = parse_body(await self._body(request))
        res, name, body = await self._checkout(body, "detokenize", model_optional=True)
        try:
            m = res.served
            ids = parse_detokenize(body, self._names(res, name), name, m.info.vocab_size)
            return JSONResponse({"prompt": await run_in_threadpool(m.engine.tokenizer.decode, ids)})
        finally:
            self.pool.release(res)

    async def tokenizer_info(self, request: Request) -> Response:
        res, name, _ = await self._checkout({"model": request.query_params.get("model", "default")}, "tokenize")
        try:
            m = res.served
            tok = m.engine.tokenizer
            special = getattr(tok, "special_tokens", {})
            return JSONResponse({"tokenizer_class": type(tok).__name__, "model": name,
                                 "model_max_length": m.info.context_length, "vocab_size": m.info.vocab_size,
                                 "bos_token": special.get("bos_token"), "eos_token": special.get("eos_token"),
                                 "pad_token": special.get("pad_token"), "unk_token": special.get("unk_token"),
                                 "chat_template": getattr(tok, "chat_template", None)})
        finally:
            self.pool.release(res)

    async def chat_completions(self, request: Request) -> Response:
        return await self._complete(request, "chat")

    async def completions(self, request: Request) -> Response:
        return await self._complete(request, "completion")

    async def responses(self, request: Request) -> Response:
        return await self._complete(request, "responses")

    async def messages(self, request: Request) -> Response:
        return await self._complete(request, "messages")

    async def count_tokens(self, request: Request) -> Response:
        """Anthropic's `/v1/messages/count_tokens`: the rendered prompt's tokens, tools included."""
        body = parse_body(await self._body(request))
        res, name, body = await self._checkout(body, "messages")
        try:
            m = res.served
            job = parse_messages(body, self._names(res, name), name, m.info.context_length, m.info.vocab_size,
                                 m.info.reasoning, m.tool_format, count_only=True)
            try:
                ids = await run_in_threadpool(m.encode_chat, job)
            except RequestError as e:
                raise from_request_error(str(e), {}) from None
            return JSONResponse({"input_tokens": len(ids)})
        finally:
            self.pool.release(res)

    async def ollama_chat(self, request: Request) -> Response:
        return await self._complete(request, "ollama_chat")

    async def ollama_generate(self, request: Request) -> Response:
        return await self._complete(request, "ollama_generate")

    # ---- completions -------------------------------------------------------------------------------------

    def _parse(self, body: dict[str, Any], endpoint: str, res: Resident, name: str) -> tuple[Job, AnyFormatter]:
        m, names = res.served, self._names(res, name)
        info = m.info
        if endpoint == "responses":
            job = parse_responses(body, names, name, info.context_length, info.vocab_size, m.tool_format)
            return job, ResponsesFormatter(job, name, body)
        if endpoint == "messages":
            job = parse_messages(body, names, name, info.context_length, info.vocab_size, info.reasoning,
                                 m.tool_format)
            return job, MessagesFormatter(job, name)
        if endpoint.startswith("ollama_"):
            job = parse_ollama(body, endpoint.removeprefix("ollama_"), name, info, m.tool_format)
            return job, OllamaFormatter(job, name, endpoint == "ollama_chat")
        job = parse_job(body, endpoint, names, name, info.context_length,  # type: ignore[arg-type]
                        info.vocab_size, m.tool_format)
        return job, Formatter(job, name, m.fingerprint, m.token_bytes, m.reasons)

    async def _complete(self, request: Request, endpoint: str) -> Response:
        t0 = time.perf_counter()
        body = getattr(request.state, "body", None)  # read already (Ollama's routes look at it first)
        if body is None:
            body = parse_body(await self._body(request))
        res, name, body = await self._checkout(body, endpoint.replace("ollama_", ""))
        held = True  # until the generations hold the model (their end releases it)
        try:
            job, fmt = self._parse(body, endpoint, res, name)
            async with DisconnectWatch(request.receive) as watch:
                acquire = asyncio.ensure_future(self.gate.acquire())
                watch.on_gone(acquire.cancel)
                try:
                    await acquire
                except asyncio.CancelledError:
                    if watch.gone:
                        return Response(status_code=499)  # nobody is there to read it
                    acquire.cancel()
                    raise
                try:
                    submitted = await run_in_threadpool(res.served.submit, job, fmt, self.config)
                except BaseException:
                    self.gate.release()
                    raise
                left = len(submitted)

                def done(gen: Generation, final: GenerationEvent) -> None:
                    nonlocal left
                    self._on_done(gen, final)
                    left -= 1
                    if left == 0:  # the request's slot goes back once the engine is done with all its prompts
                        self.gate.release()
                        self.pool.release(res)

                held = False
                gens = [Generation(stream, n, done) for stream, n in submitted]
                self.generations.update(gens)
                self.metrics.running += len(gens)
                for gen in gens:
                    watch.on_gone(gen.cancel)
                if not job.stream:
                    return await self._collect(gens, fmt, t0, watch)  # type: ignore[arg-type]
        finally:
            if held:
                self.pool.release(res)
        if isinstance(fmt, ResponsesFormatter):
            return EventStreamResponse(gens, self._response_events(gens[0], fmt, t0, res.served.reasons))
        seen: list[bool] = []
        if isinstance(fmt, MessagesFormatter):
            return EventStreamResponse(gens, message_events(fmt, gens[0], lambda e: self._first_token(e, t0, seen),
                                                            self.cancelled_message))
        if isinstance(fmt, OllamaFormatter):
            return EventStreamResponse(gens, ollama_events(fmt, gens[0], lambda e: self._first_token(e, t0, seen),
                                                           self.cancelled_message), NDJSON)
        return EventStreamResponse(gens, self._chunks(gens, fmt, t0))

    def _on_done(self, gen: Generation, final: GenerationEvent) -> None:
        self.generations.discard(gen)
        m = self.metrics
        m.running -= 1
        m.finished[final.finish_reason or "error"] += 1
        if final.usage is not None:
            m.prompt_tokens += final.usage.prompt_tokens
            m.cached_prompt_tokens += final.usage.cached_prompt_tokens
            m.completion_tokens += final.usage.completion_tokens
        m.draft_accepted_tokens += gen.num_draft_accepted
        rate = getattr(final.stats, "acceptance_rate", None)
        if rate is not None:
            m.acceptance_sum += rate
            m.acceptance_count += 1

    def _first_token(self, event: GenerationEvent, t0: float, seen: list[bool]) -> None:
        """Time to the request's first token (of any of its prompts), once."""
        if not seen and event.token_ids:
            self.metrics.ttft.observe(time.perf_counter() - t0)
            seen.append(True)

    async def _collect(self, gens: list[Generation], fmt: Formatter, t0: float, watch: DisconnectWatch) -> Response:
        seen: list[bool] = []

        async def one(gen: Generation) -> tuple[Choice, GenerationEvent]:
            texts, thoughts, lps, prompt_lps = [], [], [], []
            final: GenerationEvent | None = None
            async for event in gen.events():
                self._first_token(event, t0, seen)
                texts.append(event.text)
                thoughts.append(event.reasoning)
                lps.extend(event.logprobs)
                prompt_lps.extend(event.prompt_logprobs)
                final = event
            assert final is not None and final.finish_reason is not None
            if final.finish_reason == "error":
                for other in gens:  # the request fails as a whole: its other prompts stop
                    other.cancel()
            return Choice("".join(texts), tuple(lps), final.finish_reason, tuple(prompt_lps), "".join(thoughts),
                          final.stop_string, final.tool_calls), final

        results = await asyncio.gather(*(one(g) for g in gens))
        finals = [final for _, final in results]
        failed = next((f for f in finals if f.finish_reason == "error"), None)
        if failed is not None:
            raise APIError(500, f"the generation failed: {failed.error}", None, "generation_failed")
        if any(f.finish_reason == "cancelled" for f in finals):
            if watch.gone:
                return Response(status_code=499)
            raise APIError(503, self.cancelled_message(), None, "cancelled", headers={"Retry-After": "1"})
        return JSONResponse(fmt.response([c for c, _ in results], total_usage(finals, fmt.job.n),
                                         accepted_draft_tokens(gens, finals)))

    async def _chunks(self, gens: list[Generation], fmt: Formatter, t0: float) -> AsyncIterator[bytes]:
        for head in fmt.first_chunks():
            yield sse(head)
        events: asyncio.Queue[tuple[int, GenerationEvent]] = asyncio.Queue()

        async def pump(i: int, gen: Generation) -> None:
            async for event in gen.events():
                events.put_nowait((i, event))

        pumps = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
        finals: dict[int, GenerationEvent] = {}
        seen: list[bool] = []
        started: set[int] = set()
        # a tool-calling reply is read in the model's tool-call format: text and calls go out as it shows them
        readers = {i: fmt.job.tool_format.stream(fmt.job.tools) for i in range(len(gens))} if fmt.job.tools is not None else {}
        try:
            while len(finals) < len(gens):
                i, event = await events.get()
                self._first_token(event, t0, seen)
                if i not in started:  # an echoed prompt goes before its reply
                    started.add(i)
                    echo = fmt.echo_chunk(i, event.prompt_logprobs)
                    if echo is not None:
                        yield sse(echo)
                if event.reasoning:  # its tokens' log-probabilities with it, where they gave no answer text
                    yield sse(fmt.reasoning_chunk(event.reasoning, () if event.text else event.logprobs, i))
                if readers:
                    for delta in readers[i].feed(event.text):
                        yield sse(fmt.tool_delta_chunk(delta, i))
                elif event.text or (event.logprobs and not event.reasoning):
                    yield sse(fmt.delta_chunk(event.text, event.logprobs, i))
                reason = event.finish_reason
                if reason is None:
                    continue
                finals[i] = event
                if reason in ("error", "cancelled"):
                    message = (f"the generation failed: {event.error}" if reason == "error"
                               else self.cancelled_message())
                    yield sse(error_chunk(message, "generation_failed" if reason == "error" else "cancelled"))
                    for gen in gens:
                        gen.cancel()
                    break
                if readers:  # what the reader held, then the calls the engine read in the model's own format
                    for delta in [*readers[i].finish(), *call_deltas(event.tool_calls)]:
                        yield sse(fmt.tool_delta_chunk(delta, i))
                    reason = "tool_calls" if readers[i].called or event.tool_calls else reason
                yield sse(fmt.finish_chunk(reason, i))
            else:
                if fmt.job.include_usage:
                    ordered = [finals[i] for i in range(len(gens))]
                    yield sse(fmt.usage_chunk(total_usage(ordered, fmt.job.n), accepted_draft_tokens(gens, ordered)))
            yield DONE
        finally:
            for p in pumps:
                p.cancel()

    async def _response_events(self, gen: Generation, fmt: ResponsesFormatter, t0: float,
                               reasons: bool) -> AsyncIterator[bytes]:
        seen: list[bool] = []

        async def events() -> AsyncIterator[GenerationEvent]:
            async for event in gen.events():
                self._first_token(event, t0, seen)
                yield event

        async for b in response_events(events(), fmt, reasons, self.cancelled_message):
            yield b

    def cancel_all(self) -> None:
        for gen in list(self.generations):
            gen.cancel()

    def cancelled_message(self) -> str:
        if self.drain.draining:
            return (f"the server shut down before this reply was finished: its drain timeout of "
                    f"{self.drain.timeout_s:g} s ran out")
        return "the generation was cancelled (the server is shutting down)"

    async def drain_requests(self, timeout_s: float, forced: Callable[[], bool] = lambda: False) -> None:
        """Shutdown's first part, while the socket still listens: new requests get 503 (`RequestGuard`) and those
        running finish, for up to `timeout_s`; then the rest are cancelled, so a stream ends with an error chunk and
        `[DONE]` and a waiting request gets 503, and they are given a moment to be sent. `forced()`: stop now."""
        self.drain.start(timeout_s)
        assert self.drain.deadline is not None
        while self.drain.in_flight and time.monotonic() < self.drain.deadline and not forced():
            await asyncio.sleep(0.05)
        if not self.drain.in_flight:
            return
        self.cancel_all()
        self.gate.fail_waiting(APIError(503, self.cancelled_message(), None, "server_shutting_down",
                                        headers={"Retry-After": "1"}))
        flushed = time.monotonic() + 5.0
        while self.drain.in_flight and time.monotonic() < flushed and not forced():
            await asyncio.sleep(0.05)


def create_app(engine: EngineLike | ModelPool, config: ServerConfig | None = None) -> Starlette:
    """The ASGI app serving `engine` (a loaded Engine, or a fake with its surface: `mlx_engine.api.EngineLike`), or
    a pool of models loaded by name (`models_pool.ModelPool`)."""
    pool = engine if isinstance(engine, ModelPool) else ModelPool.single(Served(engine))
    server = Server(pool, config or ServerConfig())

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        server.cancel_all()  # whatever outlived the graceful-shutdown wait
        await server.pool.close_all()

    routes = [
        Route("/health", server.health, methods=["GET"]),
        Route("/metrics", server.metrics_text, methods=["GET"]),
        Route("/v1/models", server.models, methods=["GET"]),
        Route("/v1/models/{model:path}", server.model, methods=["GET"]),
        Route("/v1/chat/completions", server.chat_completions, methods=["POST"]),
        Route("/v1/completions", server.completions, methods=["POST"]),
        Route("/v1/responses", server.responses, methods=["POST"]),
        Route("/v1/messages", server.messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", server.count_tokens, methods=["POST"]),
        Route("/tokenize", server.tokenize, methods=["POST"]),
        Route("/detokenize", server.detokenize, methods=["POST"]),
        Route("/tokenizer_info", server.tokenizer_info, methods=["GET"]),
        embeddings_route(server),
        *ollama_routes(server),
    ]
    app = Starlette(
        routes=routes,
        exception_handlers={APIError: api_error_handler, HTTPException: http_error_handler,
                            Exception: server_error_handler},
        lifespan=lifespan,
    )
    config = server.config
    app.add_middleware(AuthMiddleware, api_key=config.api_key)
    app.add_middleware(JSONCORSMiddleware, allow_origin_regex=origin_pattern(config.allow_origins),
                       allow_methods=["GET", "POST"], max_age=600,
                       allow_headers=["Authorization", "Content-Type", "x-api-key", "anthropic-version",
                                      "anthropic-beta"])
    app.add_middleware(RequestGuard, hosts=HostCheck(config.host, config.allow_hosts),
                       allow_origins=config.allow_origins, drain=server.drain)
    app.add_middleware(CountRequests, metrics=server.metrics, routes={r.path for r in routes})
    app.state.server = server
    return app
