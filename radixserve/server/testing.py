"""BackgroundServer: an app served by uvicorn on a free loopback port in a thread (tests, tools)."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any


class BackgroundServer:
    """`with BackgroundServer(app) as server: httpx.get(server.url + "/health")`.

    The socket is bound before the thread starts, so the port is known and free of races;
    `stop()` runs the app's shutdown (lifespan) and joins the thread.
    """

    def __init__(self, app: Any, host: str = "127.0.0.1", graceful_timeout_s: int = 5):
        import uvicorn

        self.app = app
        self.socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.socket.bind((host, 0))
        self.host, self.port = self.socket.getsockname()[:2]
        config = uvicorn.Config(
            app, log_level="warning", lifespan="on", timeout_graceful_shutdown=graceful_timeout_s, access_log=False
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 60.0) -> "BackgroundServer":
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        return self

    def stop(self, timeout_s: float = 60.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout_s)
        self.socket.close()
        if self.thread.is_alive():
            raise RuntimeError("the server did not stop")

    def __enter__(self) -> "BackgroundServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
