"""HTTP server: OpenAI-compatible and native endpoints over an Engine running on its own thread.

    from radixserve.server import create_app, ServerOptions
    app = create_app(engine, ServerOptions(api_key="secret"))   # a Starlette app; serve with uvicorn
"""

from radixserve.server.options import ServerOptions

__all__ = ["ServerOptions", "create_app"]


def __getattr__(name: str):
    # The app pulls in the engine and torch; the cluster's ingress reads the request models
    # (radixserve.server.protocol) without them, so the app is imported on first use.
    if name == "create_app":
        from radixserve.server.app import create_app

        return create_app
    raise AttributeError(f"module 'radixserve.server' has no attribute {name!r}")
