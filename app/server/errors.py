"""Errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}` with the HTTP status; for Anthropic's
clients (the Messages routes, or an `anthropic-version` header) in Anthropic's, `{"type": "error", "error": {"type",
"message"}}`."""

from __future__ import annotations

import re
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse

_TYPES = {401: "invalid_request_error", 404: "invalid_request_error", 413: "invalid_request_error",
          429: "requests", 500: "server_error", 503: "server_error"}
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                    529: "overloaded_error"}
# Anthropic says "overloaded" with 529 where this server says 503 (draining, or the engine cannot take requests);
# its clients retry both
_ANTHROPIC_STATUS = {503: 529}


def speaks_anthropic(scope: Any) -> bool:
    """Whether a request (its ASGI scope) gets errors in Anthropic's shape: those to the Messages routes, and any
    from an Anthropic client, which sends `anthropic-version` (its /v1/models calls)."""
    path = scope.get("path", "")
    return (path == "/v1/messages" or path.startswith("/v1/messages/")
            or any(k == b"anthropic-version" for k, _ in scope.get("headers", ())))


class APIError(Exception):
    """A request the server answers with an error: `status`, a complete `message`, the offending `param`."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None,
                 details: dict[str, Any] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
        self.headers = headers
        self.details = details  # Anthropic's `error.details` (its `error_code` is what its SDK acts on)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def anthropic_body(self) -> dict[str, Any]:
        """Anthropic's shape, which has no `param`: the message names the field where it does not already."""
        status = _ANTHROPIC_STATUS.get(self.status, self.status)
        kind = _ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
        message = self.message
        if self.param and self.param not in message:
            message = f"{self.param}: {message}"
        error: dict[str, Any] = {"type": kind, "message": message}
        if self.details is not None:
            error["details"] = self.details
        return {"type": "error", "error": error}

    def response(self, anthropic: bool = False) -> JSONResponse:
        """The error as a response, in Anthropic's shape (and status: 529 for 503) with `anthropic`."""
        if anthropic:
            return JSONResponse(self.anthropic_body(), status_code=_ANTHROPIC_STATUS.get(self.status, self.status),
                                headers=self.headers)
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


_SAMPLING_FIELD = re.compile(r"invalid sampling parameter (\w+)")
_SPECULATIVE = re.compile(r"(speculative)=")  # a mode the engine cannot serve ("draft" without a draft model)


def from_request_error(message: str, param_names: dict[str, str] | None = None) -> APIError:
    """An engine RequestError as a 400; the param is read from SamplingParams' message when it names one."""
    m = _SAMPLING_FIELD.match(message) or _SPECULATIVE.match(message)
    param = None
    if message.startswith("response format"):  # structured.constrain: the schema, regex or grammar
        param = "response_format"
    elif m:
        param = (param_names or {}).get(m.group(1), m.group(1))
    elif "context" in message and "prompt" in message:
        return APIError(400, message, None, "context_length_exceeded")
    return APIError(400, message, param)


def speaks_ollama(scope: Any) -> bool:
    """Ollama's routes answer errors in its shape, `{"error": "message"}`, which its clients read."""
    return scope.get("path", "").startswith("/api/")


def ollama_error(exc: APIError) -> JSONResponse:
    message = exc.message
    if exc.param and exc.param not in message:
        message = f"{exc.param}: {message}"
    return JSONResponse({"error": message}, status_code=exc.status, headers=exc.headers)


async def api_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    if speaks_ollama(request.scope):
        return ollama_error(exc)
    return exc.response(speaks_anthropic(request.scope))


async def http_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        message = f"Unknown request URL: {request.method} {request.url.path}"
    elif exc.status_code == 405:
        message = f"Method {request.method} is not allowed on {request.url.path}"
    else:
        message = str(exc.detail)
    code = {404: "unknown_url", 405: "method_not_allowed"}.get(exc.status_code)
    if speaks_ollama(request.scope):
        return ollama_error(APIError(exc.status_code, message, None, code))
    return APIError(exc.status_code, message, None, code).response(speaks_anthropic(request.scope))


async def server_error_handler(request: Request, exc: Exception) -> JSONResponse:
    if speaks_ollama(request.scope):
        return ollama_error(APIError(500, f"internal server error: {type(exc).__name__}: {exc}"))
    return APIError(500, f"internal server error: {type(exc).__name__}: {exc}", None,
                    "internal_error").response(speaks_anthropic(request.scope))
