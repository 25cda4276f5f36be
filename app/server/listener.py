"""uvicorn as `roofline serve` runs it: a drain that keeps listening, and malformed HTTP answered in OpenAI's shape.

On SIGINT/SIGTERM uvicorn closes its socket at once and, once its graceful timeout runs out, cancels the response
tasks mid-send: clients saw ECONNREFUSED and streams cut mid-chunk. `DrainingServer` drains first, socket open
(`Server.drain_requests`: 503s for new requests, an error chunk and `[DONE]` for streams cut at the deadline), and
only then lets uvicorn stop. `JSONErrorsH11Protocol` answers a request h11 cannot parse (a header over the size
limit, a NUL in a header) with the OpenAI error JSON rather than uvicorn's text/plain 400.
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
    """h11's connection, keeping the protocol error it raised, so the 400 can say what was wrong."""

    error: h11.RemoteProtocolError | None = None

    def next_event(self) -> Any:
        try:
            return super().next_event()
        except h11.RemoteProtocolError as e:
            self.error = e
            raise


class JSONErrorsH11Protocol(H11Protocol):
    def __init__(self, config: uvicorn.Config, *args: Any, **kwargs: Any):
        super().__init__(config, *args, **kwargs)
        self.max_head_bytes = config.h11_max_incomplete_event_size or MAX_HEAD_BYTES
        self.conn = _RecordingConnection(h11.SERVER, self.max_head_bytes)

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


def uvicorn_config(app: Any, **kwargs: Any) -> uvicorn.Config:
    """uvicorn's Config with the protocol above and uvicorn's short after-drain wait."""
    return uvicorn.Config(app, http=JSONErrorsH11Protocol, timeout_graceful_shutdown=AFTER_DRAIN_S,
                          h11_max_incomplete_event_size=MAX_HEAD_BYTES, **kwargs)
