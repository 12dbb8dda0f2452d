"""Pure ASGI middleware (no response buffering, so streams and disconnects pass through):
bearer-token auth and per-endpoint status counting."""

from __future__ import annotations

import hmac
from collections.abc import Callable, Iterable
from typing import Any

from radixserve.server.errors import APIError

ASGIApp = Callable[..., Any]


class ApiKeyAuth:
    """Answers 401 to HTTP requests without `Authorization: Bearer <api_key>`, except on `open_paths`."""

    def __init__(self, app: ASGIApp, api_key: str | None, open_paths: Iterable[str] = ("/health",)):
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.open_paths = frozenset(open_paths)

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if self.expected is None or scope["type"] != "http" or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"authorization", b"")
        if hmac.compare_digest(given, self.expected):
            await self.app(scope, receive, send)
            return
        message = "missing API key: send 'Authorization: Bearer <key>'" if not given else "invalid API key"
        error = APIError(401, message, type="authentication_error", code="invalid_api_key",
                         headers={"WWW-Authenticate": "Bearer"})
        await error.response()(scope, receive, send)


class StatusCounter:
    """Calls `observe(endpoint, status)` once per HTTP response; unknown paths count as "other"."""

    def __init__(self, app: ASGIApp, observe: Callable[[str, int], None], endpoints: Iterable[str]):
        self.app = app
        self.observe = observe
        self.endpoints = frozenset(endpoints)

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        endpoint = scope["path"] if scope["path"] in self.endpoints else "other"
        status: list[int] = []

        async def send_and_note(message: dict) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        except Exception:
            status.append(500)  # the error middleware outside answers 500
            raise
        finally:
            self.observe(endpoint, status[0] if status else 499)
