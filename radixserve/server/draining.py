"""DrainingServer: a uvicorn.Server whose shutdown ends the app's requests itself.

uvicorn's own shutdown waits `timeout_graceful_shutdown` for handlers, then cancels them:
a stream is cut mid-chunk (no final event, no `[DONE]`) and the app's lifespan shutdown,
which would have ended it cleanly, only runs afterwards. Here, on SIGINT/SIGTERM:

1. stop accepting connections (idle keep-alive ones close, busy ones close after their
   response);
2. run the app's `drain`: running requests get the grace period, then every one still
   open is failed with a 503 "shutting_down" error (a stream sends it as its final event,
   then `data: [DONE]`; a non-streamed request answers it as its body);
3. uvicorn's shutdown: it waits (`timeout_graceful_shutdown`, now only the time to write
   those last bytes) for the responses to finish, then runs the lifespan shutdown.

A second SIGINT stops waiting for the drain (uvicorn's force exit).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable

import uvicorn

log = logging.getLogger("radixserve.server")


class DrainingServer(uvicorn.Server):
    """uvicorn.Server that awaits `drain()` between closing its sockets and uvicorn's shutdown."""

    def __init__(self, config: uvicorn.Config, drain: Callable[[], Awaitable[None]]):
        super().__init__(config)
        self.drain = drain

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for server in self.servers:
            server.close()
        for sock in sockets or []:
            sock.close()
        for connection in list(self.server_state.connections):
            connection.shutdown()
        log.info("draining: %d request(s) open", len(self.server_state.tasks))
        await self._drain_unless_forced()
        await super().shutdown(sockets)

    async def _drain_unless_forced(self) -> None:
        task = asyncio.ensure_future(self.drain())
        while not task.done() and not self.force_exit:
            await asyncio.wait({task}, timeout=0.1)
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        elif not task.cancelled() and task.exception() is not None:
            log.error("draining the requests at shutdown failed", exc_info=task.exception())
