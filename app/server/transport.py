"""HTTP in and out for the routes: a request's body read within its limits (size, time, a client that hangs up), and
a generation's events sent as `text/event-stream`, cancelled when the client goes."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import anyio
from starlette.requests import ClientDisconnect, Request

from app.server.bridge import Generation
from app.server.errors import APIError, invalid

log = logging.getLogger("uvicorn.error")  # where uvicorn logs, so `serve --log-level` governs it


async def read_body(request: Request, limit: int, timeout_s: float = 30.0) -> bytes:
    """The body, or 413 past `limit` bytes (an oversized body is read on, and dropped, up to 4x the limit so the
    client gets the 413 instead of a broken pipe), or 408 when it has not all come within `timeout_s`. A client that
    hangs up before its body is whole is one line in the log, not a traceback."""
    try:
        with anyio.fail_after(timeout_s):
            return await _read_body(request, limit)
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive whole within {timeout_s:g} s", None,
                       "request_timeout", headers={"connection": "close"}) from None
    except ClientDisconnect:
        client = f"{request.client.host}:{request.client.port}" if request.client else "a client"
        log.info("%s closed the connection before its %s %s body arrived whole", client, request.method,
                 request.url.path)
        raise APIError(400, "the client closed the connection before the request body arrived whole", None,
                       "client_closed") from None


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    too_big = None
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise invalid(f"Content-Length {declared!r} is not a number", code="invalid_header") from None
        if size > limit:
            too_big = size
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            too_big = max(too_big or 0, size)
            if size > 4 * limit:
                break
            continue
        chunks.append(chunk)
    if too_big is not None:
        raise APIError(413, f"the request body is {too_big:,} bytes; the limit is {limit:,} bytes", None,
                       "request_too_large")
    return b"".join(chunks)


SSE = b"text/event-stream; charset=utf-8"
NDJSON = b"application/x-ndjson"  # Ollama's streams: one JSON object a line


class EventStreamResponse:
    """`text/event-stream` (or NDJSON) over one generation. A client disconnect (seen on the ASGI channel) or a failed
    send cancels the generation; so does leaving early for any reason (server shutdown, an error)."""

    def __init__(self, gens: list[Generation], chunks: AsyncIterator[bytes], content_type: bytes = SSE):
        self.gens = gens
        self.chunks = chunks
        self.headers = [(b"content-type", content_type), (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]

    def cancel(self) -> None:
        for gen in self.gens:
            gen.cancel()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            async with anyio.create_task_group() as tg:

                async def watch() -> None:
                    while (await receive())["type"] != "http.disconnect":
                        pass
                    self.cancel()
                    tg.cancel_scope.cancel()

                tg.start_soon(watch)
                await send({"type": "http.response.start", "status": 200, "headers": self.headers})
                async for chunk in self.chunks:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                tg.cancel_scope.cancel()
        except OSError:  # the client went away mid-send
            pass
        finally:
            self.cancel()
