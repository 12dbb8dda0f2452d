"""RadixReplica: one Ray Serve replica = one radixserve Engine behind its own server app.

The replica builds the engine from its engine options and the app with
`radixserve.server.create_app` (the very app `radixserve serve` runs), starts the app's
lifespan (the engine thread) and serves forwarded requests through it in-process.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

from ray import serve

from radixserve.cluster.forwarding import ForwardedRequest, ResponseHead, collect, serve_forwarded
from radixserve.cluster.kv_feed import replica_engine_kwargs
from radixserve.server.options import ServerOptions


class RadixReplica:
    role = "colocated"  # prefill and decode replicas: pd_replica.py

    async def __init__(self, engine_kwargs: dict[str, Any], server_options: ServerOptions):
        from radixserve.engine import Engine
        from radixserve.server.app import create_app

        from ray.util import get_node_ip_address

        self.replica = serve.get_replica_context().replica_id.unique_id
        self.options = server_options
        self.app = create_app(Engine(**replica_engine_kwargs(engine_kwargs, get_node_ip_address())), server_options)
        self._lifespan = contextlib.AsyncExitStack()
        await self._lifespan.enter_async_context(self.app.router.lifespan_context(self.app))

    async def forward(self, request: ForwardedRequest) -> AsyncIterator[ResponseHead | bytes]:
        """The app's answer to `request`: a ResponseHead, then body chunks (a Ray stream)."""
        async for item in serve_forwarded(self.app, request, self.replica):
            yield item

    async def call(self, request: ForwardedRequest) -> tuple[ResponseHead, bytes]:
        """The app's whole answer to `request` (for broadcasts: /health, /metrics, ...); /health
        names the replica's role."""
        head, body = await collect(serve_forwarded(self.app, request, self.replica))
        if request.path == "/health":
            with contextlib.suppress(ValueError, TypeError):
                body = json.dumps({**json.loads(body), "role": self.role}).encode()
        return head, body

    def kv_events(self) -> tuple[str, str | None, str | None]:
        """(this replica, its KV event stream's endpoint, its replay endpoint); (id, None, None) with events off."""
        publisher = self.app.state.server.engine.engine.kv_events
        if publisher is None:
            return self.replica, None, None
        return self.replica, publisher.endpoint, publisher.replay_endpoint

    def check_health(self) -> None:
        """Ray's health probe: a broken engine fails it, and Ray replaces the replica."""
        engine = self.app.state.server.engine
        if not engine.healthy:
            raise RuntimeError(f"replica {self.replica}: {engine.broken_reason or 'the engine is not running'}")

    async def __del__(self) -> None:
        await self._lifespan.aclose()  # the engine's graceful shutdown (options.shutdown_grace_s)
