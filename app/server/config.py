"""`roofline serve`'s settings: what the command line sets for the app (`create_app(engine, ServerConfig(...))`)."""

from __future__ import annotations

from dataclasses import dataclass

MAX_BODY_BYTES = 4 * 2**20


@dataclass
class ServerConfig:
    api_key: str | None = None
    max_concurrency: int | None = 16  # requests running at once; None: no limit
    max_queue: int = 64  # requests waiting for a slot before new ones get 429
    max_body_bytes: int = MAX_BODY_BYTES
    # from the head's arrival to the whole body: a client that trickles its body (or stops sending it) holds a
    # request slot until then, and gets a 408
    body_timeout_s: float = 30.0
    metrics_wait_s: float = 0.25  # how long /metrics waits for fresh KV figures from a busy engine
    # A request without max_tokens may generate up to the rest of the context (OpenAI's rule), but no more
    # than this: the engine reserves KV for prompt + max_tokens at admission, so whole-context defaults
    # would let only one such request run at a time. None: the rest of the context.
    default_max_tokens: int | None = 2048
    # speculative decoding for requests that do not name a mode ("auto", "prompt-lookup", "self", "draft");
    # None: plain decoding. A speculating request verifies in a forward of its own, outside the batch.
    speculative: str | None = None
    # web pages that may call the API from a browser, beyond this machine's own (http(s)://localhost, 127.0.0.1,
    # [::1], any port: always allowed): exact origins ("https://my.app"), or "*" for any page
    allow_origins: tuple[str, ...] = ()
    # the Host names requests may carry beyond localhost, IP addresses, the bound host and this machine's hostname
    # (DNS rebinding: guard.HostCheck); "*": any
    host: str = "127.0.0.1"
    allow_hosts: tuple[str, ...] = ()
