"""Pure ASGI middleware (no response buffering, so streams and disconnects pass through):
bearer-token auth and per-endpoint status counting, and the tenant a request acts for.

With API keys set, everything a request makes (stored responses, rids, sessions, cache
entries) belongs to its key's tenant: `tenant(scope)` names it, and only the same tenant,
or an admin key for the operations that span tenants (`may_act_for_all`), can reach it."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Iterable
from typing import Any

from radixserve.server.errors import APIError, error_response

ASGIApp = Callable[..., Any]


TENANT_SCOPE_KEY = "radixserve.tenant"  # set on the ASGI scope: a digest of the caller's API key
ADMIN_SCOPE_KEY = "radixserve.admin"  # set (True) on the scope of a call made with an admin key


class KeyRing:
    """The accepted API keys, and which one a request's headers carry: `Authorization: Bearer
    <key>` (the scheme case-insensitive, RFC 9110) or Anthropic's `x-api-key: <key>`; where a
    header repeats, the last one counts. Keys are compared in constant time against every key."""

    def __init__(self, api_keys: Iterable[str] = (), admin_keys: Iterable[str] = ()):
        admins = frozenset(admin_keys)
        keys = dict.fromkeys([*api_keys, *admins])
        self.keys = [(key.encode(), key_digest(key), key in admins) for key in keys]

    def __bool__(self) -> bool:
        return bool(self.keys)

    def check(self, headers: Iterable[tuple[bytes, bytes]]) -> tuple[str, bool]:
        """(the key's digest, whether it is an admin key); an APIError 401 for no accepted key."""
        named = {name.lower(): value for name, value in headers}
        given = named.get(b"authorization", b"")
        if not given and named.get(b"x-api-key"):
            given = b"Bearer " + named[b"x-api-key"]
        found = self._match(given)
        if found is not None:
            return found
        message = "missing API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'" if not given \
            else "invalid API key"
        raise APIError(401, message, type="authentication_error", code="invalid_api_key",
                       headers={"WWW-Authenticate": "Bearer"})

    def _match(self, header: bytes) -> tuple[str, bool] | None:
        scheme, _, token = header.strip().partition(b" ")
        token = token.strip()
        if scheme.lower() != b"bearer" or not token:
            return None
        found = None
        for key, digest, admin in self.keys:  # no early exit: the time taken does not tell which key matched
            if hmac.compare_digest(token, key):
                found = (digest, admin)
        return found


class ApiKeyAuth:
    """Answers 401 to HTTP requests without one of the KeyRing's keys, except on `open_paths`;
    no keys: everyone may call. An accepted call carries its key's digest on the scope (see
    `tenant`); a key that is also in `admin_keys` marks the call as an admin's (see
    `may_act_for_all`)."""

    def __init__(
        self, app: ASGIApp, api_keys: Iterable[str] = (), open_paths: Iterable[str] = ("/health",),
        admin_keys: Iterable[str] = (),
    ):
        self.app = app
        self.keyring = KeyRing(api_keys, admin_keys)
        self.open_paths = frozenset(open_paths)

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if not self.keyring or scope["type"] != "http" or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        try:
            scope[TENANT_SCOPE_KEY], scope[ADMIN_SCOPE_KEY] = self.keyring.check(scope["headers"])
        except APIError as error:
            await error_response(scope["path"], error)(scope, receive, send)
            return
        await self.app(scope, receive, send)


def key_digest(key: str) -> str:
    """A stable name for an API key that does not reveal it (16 hex digits of its SHA-256)."""
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def tenant(scope: dict) -> str | None:
    """The tenant a request acts for: its API key's digest; None when no keys are set
    (one trusted tenant)."""
    return scope.get(TENANT_SCOPE_KEY)


def may_act_for_all(scope: dict) -> bool:
    """Whether the request may touch every tenant's objects at once (flush every cache
    namespace, abort every rid): without keys everyone may; with keys only an admin key."""
    return tenant(scope) is None or bool(scope.get(ADMIN_SCOPE_KEY))


def tenant_namespace(scope: dict) -> str | None:
    """The cache namespace that holds everything this tenant cached (every cache_salt it
    used lies under it); None without keys."""
    digest = tenant(scope)
    return None if digest is None else f"key:{digest}"


def owned_session_id(scope: dict, session_id: str | None) -> str | None:
    """The engine's name for a client's session id: led by its tenant, so that no key can
    continue, close or count on another key's session, even where keys share the cache."""
    digest = tenant(scope)
    if session_id is None or digest is None:
        return session_id
    return f"{digest}:{session_id}"


def cache_namespace(scope: dict, cache_salt: str | None) -> str | None:
    """The engine's cache salt for a request: the caller's key digest (when keys are in use)
    combined with the body's cache_salt. Prefixes are shared only within one key (and one
    cache_salt): `cached_tokens` cannot tell a caller what another key's prompts were.
    The digest has a fixed length, so no cache_salt of one key can spell another's namespace."""
    namespace = tenant_namespace(scope)
    if namespace is None:
        return cache_salt
    return namespace if cache_salt is None else f"{namespace}/{cache_salt}"


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
