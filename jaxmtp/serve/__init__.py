"""`jaxmtp serve`: an OpenAI-compatible HTTP server over the serving engine (docs/serving.md).

create_app(engine, model_name=...) makes the ASGI app; serve(app, bind(host, port)) runs it with
uvicorn until SIGTERM or SIGINT has drained it.
"""

from jaxmtp.serve.app import ChatTemplate, Defaults, create_app
from jaxmtp.serve.server import bind, serve

__all__ = ["ChatTemplate", "Defaults", "bind", "create_app", "serve"]
