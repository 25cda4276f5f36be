"""The chat app's MCP servers: `mcp.json` in the app's data dir (beside chats.db), in the `mcpServers` shape Claude
Desktop and LM Studio use:

    {"mcpServers": {"files": {"command": "npx", "args": ["-y", "@modelcontextprotocol/server-filesystem", "/tmp"],
                              "env": {"KEY": "value"}},
                    "web": {"url": "http://127.0.0.1:8000/mcp", "headers": {"Authorization": "Bearer ..."}}}}

A server runs as a subprocess over stdio (`command`, `args`, `env`, `cwd`) or is reached over streamable HTTP
(`url`, `headers`). Ours beside them: `timeout` (seconds a tool call may take, default 60) and `disabled`. A file
that is not JSON, or not this shape, is one error naming the file (and line and column); a server entry that is
wrong is one error naming it and the field, and the others still run.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CONFIG_NAME = "mcp.json"
DEFAULT_CALL_TIMEOUT_S = 60.0
HTTP_TYPES = ("http", "streamable-http", "streamableHttp", "streamable_http")


def config_path(home: Path) -> Path:
    return home / CONFIG_NAME


class ConfigError(Exception):
    """The whole file is unusable: `str(e)` is one line naming the file."""


@dataclass(frozen=True)
class ServerSpec:
    name: str
    command: str | None = None  # stdio
    args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    url: str | None = None  # streamable HTTP
    headers: dict[str, str] = field(default_factory=dict)
    timeout_s: float = DEFAULT_CALL_TIMEOUT_S

    @property
    def transport(self) -> str:
        return "stdio" if self.command is not None else "http"

    def describe(self) -> str:
        """What it runs or where it is, for the status screen."""
        if self.command is not None:
            return " ".join([self.command, *self.args])
        return self.url or ""


@dataclass
class Config:
    path: Path
    servers: list[ServerSpec]
    errors: list[str]  # one line per server entry that was left out
    disabled: list[str]  # names of servers marked "disabled": true


def load_config(path: Path) -> Config | None:
    """The file's servers, or None when there is no file. Raises ConfigError when the file cannot be used at all."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read it ({getattr(e, 'strerror', None) or e})") from None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: line {e.lineno}, column {e.colno}: {e.msg}") from None
    if not isinstance(raw, dict) or "mcpServers" not in raw:
        raise ConfigError(f"{path}: expected an object with \"mcpServers\": {{\"name\": {{\"command\": ...}} or "
                          f"{{\"url\": ...}}}}, got {_kind(raw) if not isinstance(raw, dict) else 'no mcpServers'}")
    servers = raw["mcpServers"]
    if not isinstance(servers, dict):
        raise ConfigError(f"{path}: \"mcpServers\" must be an object of named servers, got {_kind(servers)}")
    config = Config(path, [], [], [])
    for name, entry in servers.items():
        try:
            spec = _server(name, entry)
        except ValueError as e:
            config.errors.append(f"{path}: mcpServers.{name}: {e}")
            continue
        if spec is None:
            config.disabled.append(name)
        else:
            config.servers.append(spec)
    return config


def _server(name: str, entry: Any) -> ServerSpec | None:
    """One entry -> its spec (None when disabled). Raises ValueError naming the field."""
    if not name.strip():
        raise ValueError("a server needs a name")
    if not isinstance(entry, dict):
        raise ValueError(f"expected an object with \"command\" or \"url\", got {_kind(entry)}")
    disabled = entry.get("disabled", False)
    if not isinstance(disabled, bool):
        raise ValueError(f"\"disabled\" must be true or false, got {_kind(disabled)}")
    kind = entry.get("type")
    if kind is not None and kind not in ("stdio", *HTTP_TYPES):
        hint = " (the SSE transport is not supported: use the server's streamable HTTP URL)" if kind == "sse" else ""
        raise ValueError(f"\"type\" must be \"stdio\" or \"http\", got {kind!r}{hint}")
    command, url = entry.get("command"), entry.get("url") or entry.get("serverUrl")
    if (command is None) == (url is None):
        raise ValueError("needs exactly one of \"command\" (a program to run) or \"url\" (a streamable HTTP endpoint)")
    if kind == "stdio" and command is None or kind in HTTP_TYPES and url is None:
        raise ValueError(f"\"type\" is {kind!r} but the entry has {'a url' if command is None else 'a command'}")
    timeout = entry.get("timeout", DEFAULT_CALL_TIMEOUT_S)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not math.isfinite(timeout) or timeout <= 0:
        raise ValueError(f"\"timeout\" must be a number of seconds above 0, got {timeout!r}")
    if disabled:
        return None
    if command is not None:
        if not isinstance(command, str) or not command.strip():
            raise ValueError(f"\"command\" must be a non-empty string, got {_kind(command)}")
        args = entry.get("args", [])
        if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            raise ValueError("\"args\" must be an array of strings")
        cwd = entry.get("cwd")
        if cwd is not None and not isinstance(cwd, str):
            raise ValueError(f"\"cwd\" must be a string, got {_kind(cwd)}")
        return ServerSpec(name, command=command, args=tuple(args), env=_strings(entry, "env"), cwd=cwd,
                          timeout_s=float(timeout))
    if not isinstance(url, str) or not re.match(r"https?://", url):
        raise ValueError(f"\"url\" must be an http:// or https:// URL, got {url!r}")
    return ServerSpec(name, url=url, headers=_strings(entry, "headers"), timeout_s=float(timeout))


def _strings(entry: dict[str, Any], key: str) -> dict[str, str]:
    value = entry.get(key) or {}
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise ValueError(f"\"{key}\" must be an object of strings")
    return dict(value)


def _kind(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number")
