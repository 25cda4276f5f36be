"""The OpenAI-compatible server (and Anthropic's and Ollama's APIs): `create_app(engine)` for an ASGI app serving one
model, `create_app(pool)` for one serving many by name (`models_pool.ModelPool`, built by `run.model_pool`),
`serve(...)` for `roofline serve`."""

from app.server.app import ServerConfig, create_app
from app.server.run import serve

__all__ = ["ServerConfig", "create_app", "serve"]
