"""Server-sent events, and noticing a client that went away."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from radixserve.server.errors import APIError, server_error

log = logging.getLogger("radixserve.server")

Receive = Callable[[], Awaitable[dict[str, Any]]]


class EventStream:
    """An ASGI response streaming `data: <json>` events from `events`, then `data: [DONE]`.

    An APIError raised by `events` after the stream started is sent as a `data:
    {"error": ...}` event. If the client disconnects (or a send fails), sending stops;
    `on_close` runs in every case (finished, failed, disconnected, cancelled) so the
    request behind the stream can be aborted and its blocks freed.
    """

    end = b"data: [DONE]\n\n"  # the last bytes of the stream

    def __init__(self, events: AsyncIterator[dict[str, Any]], on_close: Callable[[], None]):
        self.events = events
        self.on_close = on_close
        self.status_code = 200

    async def __call__(self, scope: dict, receive: Receive, send: Callable) -> None:
        sender = asyncio.ensure_future(self._send_all(send))
        watcher = asyncio.ensure_future(wait_for_disconnect(receive))
        try:
            await asyncio.wait({sender, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (sender, watcher):
                task.cancel()
            await asyncio.gather(sender, watcher, return_exceptions=True)
            self.on_close()
        if sender.done() and not sender.cancelled() and isinstance(sender.exception(), Exception):
            if not isinstance(sender.exception(), OSError):
                log.error("event stream failed", exc_info=sender.exception())

    async def _send_all(self, send: Callable) -> None:
        headers = [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no"),
        ]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        try:
            async for event in self.events:
                await send({"type": "http.response.body", "body": self.frame(event), "more_body": True})
        except APIError as exc:
            await send({"type": "http.response.body", "body": self.error_frame(exc), "more_body": True})
        except (OSError, asyncio.CancelledError):
            raise
        except Exception as exc:
            log.exception("error while streaming a response")
            await send({"type": "http.response.body", "body": self.error_frame(server_error(str(exc))), "more_body": True})
        await send({"type": "http.response.body", "body": self.end, "more_body": False})

    def frame(self, payload: dict[str, Any]) -> bytes:
        return _event(payload)

    def error_frame(self, error: APIError) -> bytes:
        return _event(error.body())


async def wait_for_disconnect(receive: Receive) -> None:
    """Return once the client has disconnected (call after the request body was read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


def _event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode("utf-8") + b"\n\n"
