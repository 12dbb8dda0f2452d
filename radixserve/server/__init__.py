"""HTTP server: OpenAI-compatible and native endpoints over an Engine running on its own thread.

    from radixserve.server import create_app, ServerOptions
    app = create_app(engine, ServerOptions(api_key="secret"))   # a Starlette app; serve with uvicorn
"""

from radixserve.server.app import create_app
from radixserve.server.options import ServerOptions

__all__ = ["ServerOptions", "create_app"]
