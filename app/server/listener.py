"""uvicorn as `roofline serve` runs it: a drain that keeps listening, and malformed HTTP answered in OpenAI's shape.

On SIGINT/SIGTERM uvicorn closes its socket at once and, once its graceful timeout runs out, cancels the response
tasks mid-send: clients saw ECONNREFUSED and streams cut mid-chunk. `DrainingServer` drains first, socket open
(`Server.drain_requests`: 503s for new requests, an error chunk and `[DONE]` for streams cut at the deadline), and
only then lets uvicorn stop. `JSONErrorsH11Protocol` answers a request h11 cannot parse (a header over the size
limit, a NUL in a header) with the OpenAI error JSON rather than uvicorn's text/plain 400, and holds every request's
head to the rules h11 leaves to the server: the size limit however the head arrives (h11 checks it only while the
head is incomplete, so a 128 KB head in one write passed), no Content-Length beside Transfer-Encoding (a request
smuggling vector), and the whole head within HEAD_TIMEOUT_S of the connection or the last response (a client that
trickles its headers, or connects and says nothing, holds a connection slot forever otherwise).
"""

from __future__ import annotations

from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from app.server.guard import error_body

# What uvicorn's own wait gets once the drain is over: only responses already ending are left.
AFTER_DRAIN_S = 5.0
MAX_HEAD_BYTES = 16 * 1024  # request line and headers (h11's default)
HEAD_TIMEOUT_S = 10.0  # from the connection (or the end of the last response) to the request's whole head
LINGER_S = 2.0  # how long the rest of a refused request is read and dropped before the connection closes


class DrainingServer(uvicorn.Server):
    """uvicorn.Server that drains `server` (the app's `Server`) for up to `drain_timeout_s` before it stops
    listening. A second SIGINT ends the drain at once (uvicorn's force exit)."""

    def __init__(self, config: uvicorn.Config, server: Any, drain_timeout_s: float):
        super().__init__(config)
        self.app_server = server
        self.drain_timeout_s = drain_timeout_s

    async def main_loop(self) -> None:
        await super().main_loop()
        await self.app_server.drain_requests(self.drain_timeout_s, lambda: self.force_exit)


class _RecordingConnection(h11.Connection):
    """h11's connection, keeping the protocol error it raised, so the 400 can say what was wrong; a request's head is
    checked whole here (`check_head`) before uvicorn sees it."""

    error: h11.RemoteProtocolError | None = None

    def __init__(self, role: Any, max_head_bytes: int):
        super().__init__(role, max_head_bytes)
        self.max_head_bytes = max_head_bytes

    def next_event(self) -> Any:
        try:
            event = super().next_event()
            if isinstance(event, h11.Request):
                check_head(event, self.max_head_bytes)
            return event
        except h11.RemoteProtocolError as e:
            self.error = e
            raise


def check_head(request: h11.Request, max_head_bytes: int) -> None:
    """RemoteProtocolError (431 or 400) for a head h11 parsed but the server refuses."""
    raw = request.headers.raw_items()
    size = len(request.method) + len(request.target) + len(b" HTTP/1.1\r\n") + sum(
        len(k) + len(v) + 4 for k, v in raw) + 2  # "name: value\r\n" each, and the blank line
    if size > max_head_bytes:
        raise h11.RemoteProtocolError("request head too large", error_status_hint=431)
    names = {k.lower() for k, _ in raw}
    if b"content-length" in names and b"transfer-encoding" in names:
        raise h11.RemoteProtocolError("a request may not carry both Content-Length and Transfer-Encoding (RFC 9112 "
                                      "6.3): send one", error_status_hint=400)


class ServeConfig(uvicorn.Config):
    """uvicorn's Config with the head's time limit (`JSONErrorsH11Protocol`)."""

    def __init__(self, app: Any, head_timeout_s: float = HEAD_TIMEOUT_S, **kwargs: Any):
        super().__init__(app, **kwargs)
        self.head_timeout_s = head_timeout_s


class JSONErrorsH11Protocol(H11Protocol):
    def __init__(self, config: uvicorn.Config, *args: Any, **kwargs: Any):
        super().__init__(config, *args, **kwargs)
        self.max_head_bytes = config.h11_max_incomplete_event_size or MAX_HEAD_BYTES
        self.conn = _RecordingConnection(h11.SERVER, self.max_head_bytes)
        self.head_timeout_s = getattr(config, "head_timeout_s", HEAD_TIMEOUT_S)
        self.head_timer: Any = None  # asyncio.TimerHandle while a request's head is awaited

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._await_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._head_arrived()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:  # kept alive: the next head
            self._await_head()

    def _await_head(self) -> None:
        if self.head_timer is None:
            self.head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

    def _head_arrived(self) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None

    def _head_timed_out(self) -> None:
        self.head_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return  # a head arrived meanwhile
        if not self.conn.trailing_data[0]:
            self.transport.close()  # nothing was sent (an idle keep-alive connection): nothing to answer
            return
        body = error_body(408, f"the request's head did not arrive within {self.head_timeout_s:g} s",
                          "request_timeout")
        self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\ncontent-length: "
                             + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body)
        self.transport.close()

    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state is not h11.IDLE:
            self._head_arrived()  # a head was parsed: the body's time is the app's (`read_body`)

    def send_400_response(self, msg: str) -> None:
        error = getattr(self.conn, "error", None)
        status = getattr(error, "error_status_hint", 400)
        if status == 431:
            text, code = (f"the request's head (request line and headers) is over {self.max_head_bytes:,} bytes",
                          "headers_too_large")
        else:
            detail = str(error) if error is not None else msg
            detail = detail if len(detail) <= 160 else detail[:157] + "..."
            text, code = f"malformed HTTP request: {detail}", "invalid_http_request"
        body = error_body(status, text, code)
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        for event in (h11.Response(status_code=status, headers=headers), h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        # Closing with the rest of the request unread would send a TCP reset, which can destroy the reply before the
        # client reads it: end our side, read and drop what still comes for a moment, then close (a lingering close).
        self.discarding = True
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(LINGER_S, self.transport.close)

    discarding = False

    def data_received(self, data: bytes) -> None:
        if not self.discarding:
            super().data_received(data)


def uvicorn_config(app: Any, head_timeout_s: float = HEAD_TIMEOUT_S, **kwargs: Any) -> uvicorn.Config:
    """uvicorn's Config with the protocol above and uvicorn's short after-drain wait."""
    return ServeConfig(app, head_timeout_s=head_timeout_s, http=JSONErrorsH11Protocol,
                       timeout_graceful_shutdown=AFTER_DRAIN_S, h11_max_incomplete_event_size=MAX_HEAD_BYTES, **kwargs)
