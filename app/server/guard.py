"""What every request passes before a route: the Host header (DNS rebinding), the web page it comes from (Origin),
the drain on shutdown, the API key, CORS, and the count for /metrics. Every refusal is in OpenAI's error shape, or in
Anthropic's for Anthropic's clients (`errors.speaks_anthropic`).

Order, outermost first: `CountRequests` -> `RequestGuard` (Host, Origin, drain) -> `JSONCORSMiddleware` ->
`AuthMiddleware` -> the routes. A preflight from an allowed page needs no key (CORS answers it before the key is
checked); one from a refused page gets the same 403 as its requests.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import math
import re
import socket
import time
from typing import Any

from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse, Response

from app.server.errors import APIError, ollama_error, speaks_anthropic, speaks_ollama
from app.server.metrics import Metrics

LOCAL_ORIGIN_PATTERN = r"https?://(localhost|127\.0\.0\.1|\[::1\])(:\d+)?"


def origin_pattern(allow_origins: tuple[str, ...]) -> str:
    """The origins whose pages may call the API, as one regular expression: this machine's, and `allow_origins`
    ("*": any)."""
    if "*" in allow_origins:
        return ".*"
    return "|".join([LOCAL_ORIGIN_PATTERN, *(re.escape(o) for o in allow_origins)])


def host_name(header: str) -> str:
    """A Host header's name, lowercase, without port or trailing dot: "[::1]:8080" -> "::1"."""
    host = header.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    name, sep, port = host.rpartition(":")
    if sep and port.isdigit() and ":" not in name:
        host = name
    return host.rstrip(".")


class HostCheck:
    """The Host names a request may carry (Ollama's rule since its DNS-rebinding fix): a page on another site whose
    DNS name is made to point at 127.0.0.1 sends its own name as Host, so only names this server is known by are
    served. Allowed: no Host (HTTP/1.0), any IP address, localhost and *.localhost, the bound host, this machine's
    hostname, and `allow_hosts` ("*": any)."""

    def __init__(self, bound_host: str, allow_hosts: tuple[str, ...] = ()):
        self.any = "*" in allow_hosts
        self.names = {host_name(h) for h in (bound_host, socket.gethostname(), *allow_hosts) if h and h != "*"}

    def allows(self, header: bytes | None) -> bool:
        if self.any or header is None:
            return True
        host = host_name(header.decode("latin-1"))
        if host in self.names or host == "localhost" or host.endswith(".localhost"):
            return True
        try:
            ipaddress.ip_address(host)
        except ValueError:
            return False
        return True


class Drain:
    """The server's shutdown state, which `RequestGuard` reads: from `start(timeout_s)` on, new requests get 503 with
    Retry-After (the socket still listens) while `in_flight` admitted ones finish."""

    def __init__(self) -> None:
        self.deadline: float | None = None  # time.monotonic() when the running requests are cancelled
        self.timeout_s = 0.0
        self.in_flight = 0  # admitted requests whose response has not ended

    @property
    def draining(self) -> bool:
        return self.deadline is not None

    def start(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.deadline = time.monotonic() + timeout_s

    def retry_after(self) -> str:
        assert self.deadline is not None
        return str(max(1, math.ceil(self.deadline - time.monotonic())))


class RequestGuard:
    """Refuses, in OpenAI's error shape: a Host this server is not known by (403, `HostCheck`); a page of another
    site (an Origin that is not this machine's nor `--allow-origin`'s: 403, preflights included); and, while the
    server drains, every new request (503 with Retry-After; /health says "draining", /metrics still answers).
    Counts the requests it lets through in `drain.in_flight`.

    Programs (the openai client, curl) send no Origin; a browser always does on a cross-site POST, even one it will
    not let the page read, so a page cannot make a local server generate on a visitor's machine. The pages that are
    allowed get CORS headers (`JSONCORSMiddleware`, inside this one), so a web front end on localhost can read the
    replies."""

    def __init__(self, app: Any, hosts: HostCheck, allow_origins: tuple[str, ...], drain: Drain):
        self.app = app
        self.hosts = hosts
        self.origins = re.compile(f"^({origin_pattern(allow_origins)})$".encode())
        self.drain = drain

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        refusal = self._refusal(headers, scope["path"], speaks_anthropic(scope))
        if refusal is not None:
            return await refusal(scope, receive, send)
        self.drain.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.in_flight -= 1

    def _refusal(self, headers: dict[bytes, bytes], path: str, anthropic: bool) -> Response | None:
        host = headers.get(b"host")
        if not self.hosts.allows(host):
            name = host_name(host.decode("latin-1")) if host else ""
            return APIError(403, f"Host {name!r} is not a name this server answers to (localhost, an IP address, or "
                            f"one given with --allow-host): a web page cannot reach it through a DNS name of its own. "
                            f"To serve under this name, start it with --allow-host {name}", None,
                            "host_not_allowed").response(anthropic)
        origin = headers.get(b"origin")
        if origin is not None and not self.origins.match(origin):  # "null" too: sandboxed frames send it
            message = f"requests from web pages of other sites are refused (Origin: {origin.decode('latin-1')})"
            return APIError(403, message, None, "origin_not_allowed").response(anthropic)
        if self.drain.draining and path != "/metrics":
            retry = {"Retry-After": self.drain.retry_after(), "Connection": "close"}
            if path == "/health":
                return JSONResponse({"status": "draining"}, status_code=503, headers=retry)
            return APIError(503, "the server is shutting down and takes no new requests: retry on another server, or "
                            "on this one once it is back", None, "server_shutting_down",
                            headers=retry).response(anthropic)
        return None


class JSONCORSMiddleware(CORSMiddleware):
    """Starlette's CORS, with a refused preflight (a method or header not allowed) in OpenAI's error shape instead
    of text/plain."""

    def preflight_response(self, request_headers: Headers) -> Response:
        response = super().preflight_response(request_headers)
        if response.status_code < 400:
            return response
        reason = bytes(response.body).decode("utf-8", "replace")
        headers = {k: v for k, v in response.headers.items() if k.lower() not in ("content-length", "content-type")}
        return APIError(response.status_code, f"CORS preflight refused: {reason}", None, "cors_preflight_refused",
                        headers=headers).response()


class AuthMiddleware:
    """With an API key, every route but /health needs it, as `Authorization: Bearer KEY` (OpenAI's clients, and
    Anthropic's given an auth token) or `x-api-key: KEY` (Anthropic's given an API key); else 401."""

    def __init__(self, app: Any, api_key: str | None, open_paths: tuple[str, ...] = ("/health",)):
        self.app = app
        self.key = api_key.encode() if api_key else None
        self.open_paths = open_paths

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or self.key is None or scope["path"] in self.open_paths:
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        header, api_key = headers.get(b"authorization", b""), headers.get(b"x-api-key")
        scheme, _, token = header.partition(b" ")
        if ((scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key))
                or (api_key is not None and hmac.compare_digest(api_key.strip(), self.key))):
            return await self.app(scope, receive, send)
        message = ("Incorrect API key provided." if header or api_key is not None else
                   "You didn't provide an API key: send it as 'Authorization: Bearer KEY' (or 'x-api-key: KEY').")
        error = APIError(401, message, None, "invalid_api_key")
        resp = ollama_error(error) if speaks_ollama(scope) else error.response(speaks_anthropic(scope))
        resp.headers["WWW-Authenticate"] = "Bearer"
        await resp(scope, receive, send)


class CountRequests:
    """Counts answered requests by route and status for /metrics (outermost, so 401s, 403s and 413s count)."""

    def __init__(self, app: Any, metrics: Metrics, routes: set[str]):
        self.app = app
        self.metrics = metrics
        self.routes = routes

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        endpoint = path if path in self.routes else ("/v1/models/{model}" if path.startswith("/v1/models/")
                                                     else "other")

        async def counting_send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                self.metrics.requests[(endpoint, message["status"])] += 1
            await send(message)

        await self.app(scope, receive, counting_send)


def error_body(status: int, message: str, code: str) -> bytes:
    """An OpenAI error body, for the places that answer below ASGI (a malformed HTTP request)."""
    return json.dumps(APIError(status, message, None, code).body()).encode()
