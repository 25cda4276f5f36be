"""`roofline serve`: bind, load the model, serve with uvicorn until SIGINT/SIGTERM, then drain and exit."""

from __future__ import annotations

import ipaddress
import socket
import sys
from typing import Any

from mlx_engine.api import RooflineError

from app.server.app import ServerConfig, create_app


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind(host: str, port: int) -> socket.socket:
    """A listening-ready socket, so a busy port is a clear error before the model loads."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise RooflineError(f"--host {host!r}: cannot resolve ({e.strerror})") from None
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise RooflineError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.set_inheritable(True)
    return sock


def serve(
    engine_factory: Any,
    host: str = "127.0.0.1",
    port: int = 8080,
    api_key: str | None = None,
    max_concurrency: int | None = 16,
    max_queue: int = 64,
    drain_timeout_s: float = 30.0,
    default_max_tokens: int | None = 2048,
    log_level: str = "info",
    speculative: str | None = None,
    allow_origins: tuple[str, ...] = (),
    allow_hosts: tuple[str, ...] = (),
) -> int:
    """Binds host:port, loads the engine (`engine_factory()`), serves until a signal, drains, exits. Returns an exit
    code."""
    from app.server.listener import DrainingServer, uvicorn_config

    if not is_loopback(host) and not api_key:
        print(f"roofline: warning: serving on {host}, which is not a loopback address, without --api-key: anyone "
              "who can reach this machine can use the model. Pass --api-key KEY (or set ROOFLINE_API_KEY).",
              file=sys.stderr)
    if "*" in allow_origins and not api_key:
        print("roofline: warning: --allow-origin '*' without --api-key: any web page open in a browser on this "
              "machine can use the model.", file=sys.stderr)
    sock = bind(host, port)
    engine = engine_factory()
    config = ServerConfig(api_key=api_key, max_concurrency=max_concurrency, max_queue=max_queue,
                          default_max_tokens=default_max_tokens, speculative=speculative,
                          allow_origins=allow_origins, host=host, allow_hosts=allow_hosts)
    app = create_app(engine, config)
    server_state = app.state.server
    bound_host, bound_port = sock.getsockname()[:2]
    shown = f"[{bound_host}]" if ":" in bound_host else bound_host
    print(f"roofline: serving {server_state.model_id} (also 'default', {engine.info.runs_on}) on "
          f"http://{shown}:{bound_port}/v1 "
          f"- max {max_concurrency or 'unlimited'} running, {max_queue} waiting, then 429"
          f"{'; API key required' if api_key else ''}"
          f"{f'; speculative={speculative} unless a request says otherwise' if speculative else ''}"
          f"{f'; draft model {engine.info.draft_model}' if engine.info.draft_model else ''}",
          file=sys.stderr, flush=True)
    uv_config = uvicorn_config(app, log_level=log_level, lifespan="on", access_log=log_level == "debug")
    DrainingServer(uv_config, server_state, drain_timeout_s).run(sockets=[sock])
    return 0
