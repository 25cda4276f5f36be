"""`roofline serve`: bind, load the model, serve with uvicorn until SIGINT/SIGTERM, then drain and exit."""

from __future__ import annotations

import ipaddress
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mlx_engine.api import ModelLoadError, RooflineError

from app.server.app import ServerConfig, create_app
from app.server.model_table import ModelTable, Preset, names_a_file, parse_aliases, read_models_file
from app.server.models_pool import ModelPool


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


def model_pool(refs: Sequence[str], aliases: Sequence[str], models_file: Path | None, options: dict[str, Any],
               max_models: int | None = None, keep_alive_s: float | None = 300.0, max_queue: int = 64) -> ModelPool:
    """The pool of a multi-model server: every model on this machine (`refs` empty) or those `refs`, under their refs
    and the names `aliases` ("NAME=REF") and `models_file` (models.toml) give them. Bad entries fail here, before the
    server binds, naming the file or flag."""
    from mlx_engine.catalog import check_fit, describe_model, scan_local_models

    from app.models_cmd import app_model_paths
    from app.options import load_engine

    presets, default = read_models_file(models_file) if models_file is not None else ({}, None)
    for name, ref in parse_aliases(aliases).items():
        presets[name] = Preset(name, ref, *(() if name not in presets else (presets[name].load, presets[name].sampling,
                                                                              presets[name].system,
                                                                              presets[name].keep_alive)))

    def scan() -> list[Any]:
        if not refs:
            return scan_local_models(app_model_paths())[0]
        out = []
        for ref in refs:
            try:
                out.append(describe_model(None if ref == "embedded" else ref))
            except ModelLoadError as e:
                print(f"roofline: warning: -m {ref}: {e}", file=sys.stderr)
        return out

    if refs and default is None:  # the first -m; a folder goes by its name, as requests never name files
        default = Path(refs[0]).expanduser().resolve().name if names_a_file(refs[0]) or Path(refs[0]).exists() \
            else refs[0]

    def ref_of(p: Preset) -> str | None:
        return None if p.ref == "embedded" else p.ref

    def load(p: Preset) -> Any:
        return load_engine(ref_of(p), no_tokenizer="warn", **{**options, **p.load})

    def fits(p: Preset) -> str | None:
        try:
            check_fit(ref_of(p), "torch" if options.get("backend") == "torch" else "mlx", {**options, **p.load})
        except ModelLoadError as e:
            return str(e)
        return None

    def close(engine: Any) -> None:
        from mlx_engine.memory import return_memory

        engine.close()
        return_memory()

    return ModelPool(ModelTable(scan, presets, default), load, close=close, fits=fits, max_models=max_models,
                     keep_alive_s=keep_alive_s, max_waiting=max_queue)


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
    engine = engine_factory()  # an engine, or a ModelPool that loads models by name
    config = ServerConfig(api_key=api_key, max_concurrency=max_concurrency, max_queue=max_queue,
                          default_max_tokens=default_max_tokens, speculative=speculative,
                          allow_origins=allow_origins, host=host, allow_hosts=allow_hosts)
    app = create_app(engine, config)
    server_state = app.state.server
    bound_host, bound_port = sock.getsockname()[:2]
    shown = f"[{bound_host}]" if ":" in bound_host else bound_host
    if isinstance(engine, ModelPool):
        limit = f"at most {engine.max_models} loaded" if engine.max_models else "as many loaded as memory holds"
        keep = "forever" if engine.keep_alive_s is None else f"{engine.keep_alive_s:g} s"
        print(f"roofline: serving the models on this machine by name (GET /v1/models, /api/tags), loaded when a "
              f"request names one, {limit}, unloaded after {keep} idle, on http://"
              f"{'[' + bound_host + ']' if ':' in bound_host else bound_host}:{bound_port}/v1 and /api (Ollama's)"
              f"{'; API key required' if api_key else ''}", file=sys.stderr, flush=True)
    else:
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
