"""The OpenAI-compatible server: `create_app(engine)` for an ASGI app, `serve(...)` for `roofline serve`."""

from app.server.app import ServerConfig, create_app
from app.server.run import serve

__all__ = ["ServerConfig", "create_app", "serve"]
