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
import hashlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal

from mlx_engine.api import (EngineLike, GenerationEvent, GenerationRequest, RequestError, RooflineError, SamplingParams)
from mlx_engine.reasoning import template_kwargs
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from app.server.anthropic_api import parse_messages
from app.server.anthropic_reply import MessagesFormatter, message_events, model_card, model_list
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
from app.server.guard import (AuthMiddleware, CountRequests, Drain, HostCheck, JSONCORSMiddleware, RequestGuard,
                              origin_pattern)
from app.server.metrics import KVStatsReader, Metrics
from app.server.embeddings_api import embeddings_route
from app.server.fields import parse_body
from app.server.protocol import Endpoint, Job, model_slug, parse_job
from app.server.tokenize import parse_detokenize, parse_tokenize
from app.server.responses import DONE, Choice, Echo, Formatter, error_chunk, sse, token_bytes_fn, token_str
from app.server.responses_api import ResponsesFormatter, parse_responses, response_events
from app.server.transport import EventStreamResponse, read_body
from app.server.harmony_tools import call_deltas, tool_format_for

_PARAM_NAMES = {"logprobs": "top_logprobs"}  # SamplingParams field -> request field, where they differ


class Server:
    """State shared by the routes: the engine, the served model's names, admission, metrics."""

    def __init__(self, engine: EngineLike, config: ServerConfig):
        self.engine = engine
        self.config = config
        info = engine.info
        self.info = info
        self.reasons = info.reasoning is not None  # replies carry reasoning apart from the answer
        self.model_id = model_slug(info.name)
        self.model_names = {self.model_id, "default", info.name}
        digest = hashlib.sha256(f"{info.name}|{info.path}|{info.quantization}|{info.dtype}".encode()).hexdigest()
        self.fingerprint = "fp_" + digest[:10]
        self.created = int(time.time())
        self.gate = AdmissionGate(config.max_concurrency, config.max_queue)
        self.metrics = Metrics()
        self.kv = KVStatsReader(engine.kv_stats)
        self.token_bytes = token_bytes_fn(engine.tokenizer)
        # how this model calls tools: harmony's, or from its chat template's text (no template: the JSON format)
        self.tool_format = tool_format_for(info.reasoning, getattr(engine.tokenizer, "chat_template", None),
                                           lambda text: engine.tokenizer.encode(text, add_special_tokens=False))
        self.generations: set[Generation] = set()
        self.drain = Drain()

    async def _body(self, request: Request) -> bytes:
        return await read_body(request, self.config.max_body_bytes, self.config.body_timeout_s)

    # ---- routes ----------------------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    def _model_card(self) -> dict[str, Any]:
        i = self.info
        return {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "roofline",
                "name": i.name, "context_length": i.context_length, "quantization": i.quantization,
                "model_type": i.model_type, "num_parameters": i.num_parameters,
                "backend": i.backend, "device": i.device}  # what Engine.load's backend="auto" chose

    def _anthropic_card(self) -> dict[str, Any]:
        return model_card(self.model_id, self.info.name, self.created)

    async def models(self, request: Request) -> Response:
        if "anthropic-version" in request.headers:  # an Anthropic client: its shape
            return JSONResponse(model_list(self._anthropic_card()))
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request) -> Response:
        name = request.path_params["model"]
        if name not in self.model_names:
            raise APIError(404, f"The model '{name}' does not exist: this server serves '{self.model_id}'",
                           "model", "model_not_found")
        if "anthropic-version" in request.headers:
            return JSONResponse(self._anthropic_card())
        return JSONResponse(self._model_card())

    async def metrics_text(self, request: Request) -> Response:
        kv, age = await run_in_threadpool(self.kv.read, self.config.metrics_wait_s)
        engine_waiting = sum(1 for g in self.generations if not g.started)
        text = self.metrics.render(self.gate.waiting, engine_waiting, kv, age)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    # ---- the tokenizer (vLLM's routes: lm-evaluation-harness tokenizes through them, with no download) -----

    async def tokenize(self, request: Request) -> Response:
        job = parse_tokenize(parse_body(await self._body(request)), self.model_names,
                             self.model_id, self.tool_format)
        tok = self.engine.tokenizer

        def run() -> list[int]:
            if job.messages is not None:
                return tok.encode_chat(job.messages, add_generation_prompt=job.add_generation_prompt)
            return tok.encode(job.prompt or "", add_special_tokens=job.add_special_tokens)

        try:
            ids = await run_in_threadpool(run)
        except RequestError as e:
            raise from_request_error(str(e), {}) from None
        out: dict[str, Any] = {"count": len(ids), "max_model_len": self.info.context_length, "tokens": ids}
        if job.return_token_strs:
            out["token_strs"] = [token_str(self.token_bytes(t)) for t in ids]
        return JSONResponse(out)

    async def detokenize(self, request: Request) -> Response:
        ids = parse_detokenize(parse_body(await self._body(request)), self.model_names,
                               self.model_id, self.info.vocab_size)
        return JSONResponse({"prompt": await run_in_threadpool(self.engine.tokenizer.decode, ids)})

    async def tokenizer_info(self, request: Request) -> Response:
        tok = self.engine.tokenizer
        special = getattr(tok, "special_tokens", {})
        return JSONResponse({"tokenizer_class": type(tok).__name__, "model": self.model_id,
                             "model_max_length": self.info.context_length, "vocab_size": self.info.vocab_size,
                             "bos_token": special.get("bos_token"), "eos_token": special.get("eos_token"),
                             "pad_token": special.get("pad_token"), "unk_token": special.get("unk_token"),
                             "chat_template": getattr(tok, "chat_template", None)})

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
        job = parse_messages(parse_body(await self._body(request)), self.model_names,
                             self.model_id, self.info.context_length, self.info.vocab_size, self.info.reasoning,
                             self.tool_format, count_only=True)
        try:
            ids = await run_in_threadpool(self._encode_chat, job)
        except RequestError as e:
            raise from_request_error(str(e), {}) from None
        return JSONResponse({"input_tokens": len(ids)})

    # ---- completions -------------------------------------------------------------------------------------

    async def _complete(self, request: Request, endpoint: Endpoint | Literal["responses", "messages"]) -> Response:
        t0 = time.perf_counter()
        body = parse_body(await self._body(request))
        fmt: Formatter | ResponsesFormatter | MessagesFormatter
        if endpoint == "responses":
            job = parse_responses(body, self.model_names, self.model_id, self.info.context_length,
                                  self.info.vocab_size, self.tool_format)
            fmt = ResponsesFormatter(job, self.model_id, body)
        elif endpoint == "messages":
            job = parse_messages(body, self.model_names, self.model_id, self.info.context_length,
                                 self.info.vocab_size, self.info.reasoning, self.tool_format)
            fmt = MessagesFormatter(job, self.model_id)
        else:
            job = parse_job(body, endpoint, self.model_names, self.model_id, self.info.context_length,
                            self.info.vocab_size, self.tool_format)
            fmt = Formatter(job, self.model_id, self.fingerprint, self.token_bytes, self.reasons)
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
                submitted = await run_in_threadpool(self._submit, job, fmt)
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

            gens = [Generation(stream, n, done) for stream, n in submitted]
            self.generations.update(gens)
            self.metrics.running += len(gens)
            for gen in gens:
                watch.on_gone(gen.cancel)
            if not job.stream:
                return await self._collect(gens, fmt, t0, watch)
        if isinstance(fmt, ResponsesFormatter):
            return EventStreamResponse(gens, self._response_events(gens[0], fmt, t0))
        if isinstance(fmt, MessagesFormatter):
            seen: list[bool] = []
            return EventStreamResponse(gens, message_events(fmt, gens[0], lambda e: self._first_token(e, t0, seen),
                                                            self.cancelled_message))
        return EventStreamResponse(gens, self._chunks(gens, fmt, t0))

    def _encode_chat(self, job: Job) -> list[int]:
        """A chat job's prompt ids: its messages through the chat template, with the job's template variables."""
        assert job.messages is not None
        variables = template_kwargs(self.info.reasoning, job.chat_template_kwargs, job.reasoning_effort)
        return self.engine.tokenizer.encode_chat(job.messages, add_generation_prompt=True,
                                                 **{**variables, **job.tool_variables})

    def _submit(self, job: Job, fmt: Formatter | ResponsesFormatter | MessagesFormatter) -> list[tuple[Any, int]]:
        """On a worker thread: tokenize every prompt and check it against the context, score the echoed prompts,
        then start a generation per prompt (all or none)."""
        tok = self.engine.tokenizer
        try:
            if job.messages is not None:
                prompts = [(self._encode_chat(job), "messages", None)]
            else:
                prompts = [(tok.encode(p.text) if p.text is not None else list(p.token_ids or ()),
                            "prompt" if len(job.prompts) == 1 else f"prompt[{i}]", p.text)
                           for i, p in enumerate(job.prompts)]
            requests = [replies for ids, what, _ in prompts for replies in self._requests(job, ids, what)]
            if job.echo:  # completions only
                assert isinstance(fmt, Formatter)
                for i, (ids, _, text) in enumerate(prompts):
                    for j in range(job.n):
                        fmt.echoes[i * job.n + j] = Echo(text if text is not None else tok.decode(ids), ids)
            submitted: list[tuple[Any, int]] = []
            try:
                for r in requests:
                    submitted.append((self.engine.generate(r), len(r.prompt_token_ids or ())))
            except BaseException:
                for stream, _ in submitted:
                    stream.cancel()
                raise
            return submitted
        except RequestError as e:
            err = from_request_error(str(e), _PARAM_NAMES)
            if err.param == "response_format":  # or the vLLM field the grammar came from
                err.param = job.format_param
                if job.tools is not None:  # each function's schema compiled alone at parsing; together they did not
                    err.message = "the tools' parameter schemas cannot be held together: " + err.message.split(
                        ": ", 2)[-1]
            raise err from None
        except RooflineError as e:
            raise APIError(503, f"the engine cannot take requests: {e}", None, "engine_unavailable") from None

    def _requests(self, job: Job, ids: list[int], what: str) -> list[GenerationRequest]:
        """One prompt's n engine requests, checked against the context (`what` names the prompt in errors). With a
        seed, reply j samples with seed + j."""
        ctx, n = self.info.context_length, len(ids)
        if n == 0:  # "" on a model whose tokenizer adds no BOS: nothing to continue from
            raise invalid(f"'{what}' is empty: it gives no tokens, and this model adds none before a prompt; send some "
                          "text", what)
        if n >= ctx:
            verb = "are" if what == "messages" else "is"
            raise invalid(f"This model's maximum context length is {ctx} tokens, but the {what} {verb} {n} "
                          "tokens (at least 1 token must be left to generate)", what, "context_length_exceeded")
        if job.max_tokens is not None and n + job.max_tokens > ctx:
            raise invalid(f"This model's maximum context length is {ctx} tokens, but {n + job.max_tokens} were "
                          f"requested ({n} in the {what}, {job.max_tokens} in '{job.max_tokens_param}'); "
                          f"at most {ctx - n} can be generated for this prompt", job.max_tokens_param,
                          "context_length_exceeded")
        max_tokens = job.max_tokens
        if max_tokens is None:
            max_tokens = min(ctx - n, self.config.default_max_tokens or ctx)
        kw = dict(job.sampling)
        if "speculative" not in kw and self.config.speculative is not None:
            kw["speculative"] = self.config.speculative
        seed = kw.pop("seed", None)
        if job.echo and job.logprobs:  # the prompt's log-probabilities, scored in the batch's prefill chunks
            kw["prompt_logprobs"] = job.top_logprobs
        elif max_tokens == 0:  # echo without logprobs and no reply: the engine still reads the prompt, once
            kw["prompt_logprobs"] = 0
        return [GenerationRequest(prompt_token_ids=ids, chat_template_kwargs=job.chat_template_kwargs,
                                  sampling=SamplingParams(max_tokens=max_tokens,
                                                          seed=None if seed is None else seed + j, **kw))
                for j in range(job.n)]

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

    async def _response_events(self, gen: Generation, fmt: ResponsesFormatter, t0: float) -> AsyncIterator[bytes]:
        seen: list[bool] = []

        async def events() -> AsyncIterator[GenerationEvent]:
            async for event in gen.events():
                self._first_token(event, t0, seen)
                yield event

        async for b in response_events(events(), fmt, self.reasons, self.cancelled_message):
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


def create_app(engine: EngineLike, config: ServerConfig | None = None) -> Starlette:
    """The ASGI app serving `engine` (a loaded Engine, or a fake with its surface: `mlx_engine.api.EngineLike`)."""
    server = Server(engine, config or ServerConfig())

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        server.cancel_all()  # whatever outlived the graceful-shutdown wait

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
