"""Forwarding an HTTP request from the ingress into a replica's own app, in-process.

The ingress reads the request (method, path, headers, body) into a ForwardedRequest, which
Ray carries to a replica; there `serve_forwarded` runs the replica's radixserve app (the
one `radixserve serve` runs) on it as an ASGI call and yields what the app sends: first a
ResponseHead, then the body's chunks. So every endpoint, error and stream of the single
server is the cluster's too. Plain Python, no Ray.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from radixserve.cluster.pd_jobs import PREFILL_TARGET
from radixserve.cluster.routing_key import RoutingKey

REPLICA_HEADER = "x-radixserve-replica"  # on every forwarded answer: the replica that served it
APP_EXIT_TIMEOUT_S = 10.0  # after the consumer stopped: time for the app to notice the disconnect and end


@dataclass
class ForwardedRequest:
    method: str
    path: str
    query_string: bytes = b""
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytes = b""
    routing: RoutingKey | None = None  # None: any replica will do
    prefill_replica: str | None = None  # disaggregated: the prefill replica the ingress chose for it
    tenant: str | None = None  # the caller's key digest, as the ingress authenticated it (None without keys)

    @property
    def prompt(self) -> str:
        """The routing key as text, for Ray Serve LLM's prefix router (it reads `.prompt`). Never
        empty: that router divides by its length, and its routing loop dies on a ZeroDivisionError."""
        text = self.routing.text if self.routing is not None else ""
        return text or f"{self.method} {self.path}"

    def header(self, name: str) -> str | None:
        wanted = name.lower().encode("latin-1")
        for key, value in self.headers:
            if key.lower() == wanted:
                return value.decode("latin-1")
        return None


@dataclass(frozen=True)
class ResponseHead:
    status: int
    headers: list[tuple[bytes, bytes]]
    replica: str  # the replica that answered

    @property
    def is_stream(self) -> bool:
        for key, value in self.headers:
            if key.lower() == b"content-type" and value.startswith(b"text/event-stream"):
                return True
        return False


async def serve_forwarded(app: Callable, request: ForwardedRequest, replica: str) -> AsyncIterator[ResponseHead | bytes]:
    """Run `app` on `request`: yields the ResponseHead, then body chunks. If the consumer
    stops early (the client went away, the generator is closed or cancelled), the app sees an
    http.disconnect, so a stream's engine request is aborted."""
    messages: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    gone = asyncio.Event()
    body_sent = False

    async def receive() -> dict[str, Any]:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    context = contextvars.copy_context()  # the app's task sees the ingress's prefill choice
    context.run(PREFILL_TARGET.set, request.prefill_replica)
    task = asyncio.get_running_loop().create_task(app(_scope(request), receive, messages.put), context=context)
    try:
        async for message in _until_complete(messages, task):
            if message["type"] == "http.response.start":
                yield ResponseHead(message["status"], [tuple(h) for h in message.get("headers", [])], replica)
            elif message["type"] == "http.response.body" and message.get("body"):
                yield bytes(message["body"])
    finally:
        gone.set()
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(asyncio.shield(task), APP_EXIT_TIMEOUT_S)
        if not task.done():
            task.cancel()


async def collect(chunks: AsyncIterator[ResponseHead | bytes]) -> tuple[ResponseHead, bytes]:
    """A whole response: its head and body."""
    head: ResponseHead | None = None
    body = bytearray()
    async for item in chunks:
        if isinstance(item, ResponseHead):
            head = item
        else:
            body += item
    if head is None:
        raise RuntimeError("the app ended without a response")
    return head, bytes(body)


async def _until_complete(messages: asyncio.Queue, task: asyncio.Future) -> AsyncIterator[dict[str, Any]]:
    """The app's messages up to the last body chunk; the app's exception if it fails first."""
    while True:
        getter = asyncio.ensure_future(messages.get())
        await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
        if not getter.done():
            getter.cancel()
            if messages.empty():
                task.result()  # raises the app's exception
                raise RuntimeError("the app ended without completing its response")
            continue
        message = getter.result()
        yield message
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            return


def _scope(request: ForwardedRequest) -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": request.method,
        "scheme": "http",
        "path": request.path,
        "raw_path": request.path.encode("utf-8"),
        "root_path": "",
        "query_string": request.query_string,
        "headers": list(request.headers),
        "client": ("127.0.0.1", 0),
        "server": ("127.0.0.1", 0),
        "state": {},
    }
