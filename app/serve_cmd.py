"""`roofline serve`: its own flags (several models, the network, limits) and the command; the flags it shares with
generate and chat (runner, template, KV, draft, distributed) are cli.py's."""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path
from typing import Any

from mlx_engine.api import RooflineError

from app.options import load_engine


def add_serve_args(sv: argparse.ArgumentParser) -> None:
    pool = sv.add_argument_group("several models (no -m, or several)")
    pool.add_argument("--alias", action="append", default=[], metavar="NAME=REF",
                      help="a name requests may use for a model, e.g. chat=ollama:qwen3:4b (repeat for more)")
    pool.add_argument("--models-file", metavar="FILE",
                      help="presets per model name: ref, context, kv_bits, draft_model, system, sampling defaults, "
                      "keep_alive (default: models.toml in roofline's config dir; docs/server.md)")
    pool.add_argument("--max-models", type=int, metavar="N",
                      help="models loaded at once (default: as many as memory holds, by the load-time fit check); "
                      "the least recently used idle one is unloaded to make room")
    pool.add_argument("--keep-alive", default="5m", metavar="SECONDS|forever",
                      help="how long an idle model stays loaded (default 5m; 0: unloaded after each request); a "
                      "request's keep_alive overrides it for its model")
    sv.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1, this machine only)")
    sv.add_argument("--port", type=int, default=8080, help="TCP port (default 8080; 0 picks a free one)")
    sv.add_argument("--api-key", default=os.environ.get("ROOFLINE_API_KEY"),
                    help="require 'Authorization: Bearer KEY' on every route but /health "
                    "(default: $ROOFLINE_API_KEY)")
    sv.add_argument("--allow-origin", action="append", default=[], metavar="ORIGIN",
                    help="a web site whose pages may call the API from a browser (CORS), as scheme://host[:port]; "
                    "repeat for more, or '*' for any. Pages on this machine (localhost, 127.0.0.1) always may")
    sv.add_argument("--allow-host", action="append", default=[], metavar="HOST",
                    help="a name clients may reach the server by (the Host header), beyond localhost, IP addresses, "
                    "--host and this machine's name; repeat for more, or '*' for any. Others get 403, so a web page "
                    "cannot reach the server through a DNS name of its own (DNS rebinding)")
    sv.add_argument("--max-concurrency", type=int, default=16,
                    help="requests generating at once, batched together by the engine (default 16); more wait in "
                    "a queue of --max-queue, beyond it they get 429")
    sv.add_argument("--max-queue", type=int, default=64, help="requests waiting for a slot (default 64)")
    sv.add_argument("--default-max-tokens", type=int, default=2048,
                    help="tokens a request without max_tokens may generate, within the context (default 2048; "
                    "the engine reserves KV for prompt + max_tokens, so larger defaults admit fewer requests)")
    sv.add_argument("--drain-timeout", type=float, default=30.0,
                    help="on SIGINT/SIGTERM, seconds to let running requests finish (default 30)")
    sv.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))


def cmd_serve(args: argparse.Namespace, options: dict[str, Any], speculative: str | None) -> int:
    """`roofline serve`, with the load options and speculative mode the command line's shared flags gave."""
    from app.server import serve

    if not 0 <= args.port <= 65535:
        raise RooflineError(f"--port {args.port}: expected 0..65535")
    if args.max_concurrency < 1 or args.max_queue < 0:
        raise RooflineError("--max-concurrency must be >= 1 and --max-queue >= 0")
    if args.default_max_tokens < 1:
        raise RooflineError("--default-max-tokens must be >= 1")
    if args.drain_timeout < 0:
        raise RooflineError("--drain-timeout must be >= 0")
    for origin in args.allow_origin:
        if origin != "*" and not re.fullmatch(r"[a-zA-Z][a-zA-Z0-9+.-]*://[^/\s?#]+/?", origin):
            raise RooflineError(f"--allow-origin {origin!r}: expected an origin like https://example.com "
                                "(scheme://host[:port], no path), or '*'")
    for host in args.allow_host:
        if host != "*" and not re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?\.?", host):
            raise RooflineError(f"--allow-host {host!r}: expected a host name like roofline.lan (no scheme, port or "
                                "path), or '*'")
    options["max_seqs"] = args.max_concurrency  # the requests the server lets run are the ones the engine batches
    factory = _serve_factory(args, options)
    return serve(factory,
                 host=args.host, port=args.port, api_key=args.api_key or None,
                 max_concurrency=args.max_concurrency, max_queue=args.max_queue,
                 drain_timeout_s=args.drain_timeout, default_max_tokens=args.default_max_tokens,
                 log_level=args.log_level, speculative=speculative,
                 allow_origins=tuple(o.rstrip("/") for o in args.allow_origin), allow_hosts=tuple(args.allow_host))


def _serve_factory(args: argparse.Namespace, options: dict[str, Any]) -> Any:
    """One -m: that model, loaded before serving (as ever). None or several: a pool that loads them by name."""
    if len(args.model) == 1 or ("distributed" in options and not args.model):
        # --distributed without -m: the embedded model, as every rank but 0 loads it (cli._serve_other_rank)
        model = args.model[0] if args.model else None
        for flag, value in (("--alias", args.alias), ("--models-file", args.models_file),
                            ("--max-models", args.max_models)):
            if value:
                raise RooflineError(f"{flag} is for serving several models: give -m more than once, or none")
        return lambda: load_engine(model, no_tokenizer="warn", **options)
    from app.server.model_table import MODELS_FILE, config_dir, parse_keep_alive
    from app.server.run import model_pool

    if "distributed" in options:
        raise RooflineError("--distributed serves one model: give it with one -m (or none: the embedded model)")
    if args.max_models is not None and args.max_models < 1:
        raise RooflineError(f"--max-models {args.max_models}: expected an integer >= 1")
    try:
        keep = parse_keep_alive(args.keep_alive, "--keep-alive")
    except ValueError as e:
        raise RooflineError(str(e)) from None
    path = Path(args.models_file).expanduser() if args.models_file else config_dir() / MODELS_FILE
    if args.models_file and not path.is_file():
        raise RooflineError(f"--models-file {args.models_file}: no such file")
    pool = model_pool(args.model, args.alias, path, options, args.max_models, keep, args.max_queue)
    return lambda: pool
