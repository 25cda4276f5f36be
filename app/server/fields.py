"""A request body's fields read with their types checked, every error a 400 naming the field: the body as JSON
(`parse_body`), and typed getters over it (`Fields`). Shared by every API's parser (protocol.py, the Responses and
Anthropic translations)."""

from __future__ import annotations

import json
import math
from typing import Any

from app.server.errors import APIError, invalid


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON")


def parse_body(raw: bytes) -> dict[str, Any]:
    """Request bytes -> a JSON object; 400 on invalid UTF-8, malformed JSON, NaN/Infinity, a non-object."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise invalid(f"the request body is not valid UTF-8 (byte {e.start}: {raw[e.start:e.start + 1]!r})",
                      code="invalid_utf8") from None
    if not text.strip():
        raise invalid("the request body is empty: expected a JSON object", code="invalid_json")
    try:
        body = json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:
        detail = "nested too deeply" if isinstance(e, RecursionError) else str(e)
        raise invalid(f"the request body is not valid JSON: {detail}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise invalid(f"the request body must be a JSON object, got {kind_of(body)}", code="invalid_json")
    return body


def kind_of(v: Any) -> str:
    if v is None:
        return "null"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
            dict: "an object"}.get(type(v), type(v).__name__)


def checked_text(v: str, param: str) -> str:
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        raise invalid(f"{param} contains an unpaired UTF-16 surrogate (\\ud800-\\udfff): not valid Unicode text",
                      param) from None
    return v


class Fields:
    """Typed getters over one body: null counts as absent, bool is never a number."""

    def __init__(self, body: dict[str, Any]):
        self.body = body

    def get(self, name: str) -> Any:
        return self.body.get(name)

    def wrong(self, name: str, expected: str) -> APIError:
        return invalid(f"'{name}' must be {expected}, got {kind_of(self.body[name])}: {short(self.body[name])}", name)

    def number(self, name: str, lo: float, hi: float, *, lo_open: bool = False) -> float | None:
        v = self.body.get(name)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise self.wrong(name, "a number")
        if v < lo or v > hi or (lo_open and v == lo):
            interval = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
            raise invalid(f"'{name}' must be in {interval}, got {v}", name)
        return float(v)

    def integer(self, name: str, lo: int | None = None, hi: int | None = None) -> int | None:
        v = self.body.get(name)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, int):
            raise self.wrong(name, "an integer")
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            bounds = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
            raise invalid(f"'{name}' must be an integer {bounds}, got {v}", name)
        return v

    def boolean(self, name: str) -> bool | None:
        v = self.body.get(name)
        if v is None:
            return None
        if not isinstance(v, bool):
            raise self.wrong(name, "a boolean")
        return v

    def string(self, name: str) -> str | None:
        v = self.body.get(name)
        if v is None:
            return None
        if not isinstance(v, str):
            raise self.wrong(name, "a string")
        return checked_text(v, name)


def short(v: Any) -> str:
    s = json.dumps(v, ensure_ascii=False, default=str)
    return s if len(s) <= 60 else s[:57] + "..."


def or_default(v: Any, default: Any) -> Any:
    return default if v is None else v
