"""RoutingKey: what the router matches a request by: the start of its prompt, and its session.

The prompt and session come from the server's own request models (server/protocol/routed.py:
the conversation the replica will render, a completion's prompt text or token ids), so the
router cannot drift from what the replicas parse. The key is namespaced like the replica's
cache (the tenant, i.e. the API key's digest, and cache_salt), since prefixes are never shared
across namespaces; a session (or a stored response) is led by its tenant as on the replica, so
no key can move or probe another key's session. OpenAI's `prompt_cache_key` is an affinity
key of its own: requests without a session that give the same key (in the same namespace)
go where the first went. Plain Python, no Ray.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from radixserve.cluster.prefix_tree import Key
from radixserve.server.protocol.routed import ROUTED, routed_request

ROUTED_PATHS = tuple(ROUTED)  # keyed by prompt and session
BROADCAST_PATHS = ("/flush_cache", "/abort_request", "/debug/check_integrity", "/debug/stats",
                   "/v1/sessions/release")  # sent to every replica
SESSION_CLOSE_PATH = "/v1/sessions/{session_id}/close"  # sent to every replica
UNKEYED_PATHS = ("/v1/messages/count_tokens",)  # any replica answers alike: it generates nothing


@dataclass(frozen=True)
class RoutingKey:
    key: Key  # a str, or a tuple of token ids (led by a namespace marker when namespaced)
    session_id: str | None = None
    blocks: tuple | None = None  # the prompt's block names as replicas publish them (KV events on)

    @property
    def text(self) -> str:
        """The key as text (for routers that match characters)."""
        if isinstance(self.key, str):
            return self.key
        return " ".join(str(t) for t in self.key)


def routing_key(path: str, body: Any, tenant: str | None = None, shared_cache: bool = False) -> RoutingKey | None:
    """The key of a request to `path` with the parsed JSON `body` from `tenant` (the caller's
    key digest; None without API keys); None when the body is not one the router understands
    (the replica will answer it with its own error)."""
    routed = routed_request(path, body)
    if routed is None:
        return None
    session_id = tenant_session(tenant, routed.session_id) if routed.session_id else None
    if routed.previous_response_id is not None:
        session_id = session_id or response_session(tenant, routed.previous_response_id)
    cache_key = body.get("prompt_cache_key") if isinstance(body, dict) else None
    if session_id is None and isinstance(cache_key, str) and cache_key:
        session_id = tenant_session(tenant, f"prompt_cache_key:{routed.cache_salt or ''}:{cache_key}")
    prompt = routed.prompt
    namespace = _namespace(None if shared_cache else tenant, routed.cache_salt)
    if namespace:
        prompt = f"\x00{namespace}\x00" + prompt if isinstance(prompt, str) else (f"ns:{namespace}",) + prompt
    return RoutingKey(prompt, session_id)


def tenant_session(tenant: str | None, session_id: str) -> str:
    """The router's name for a client's session: led by its tenant (as the engine names it)."""
    return session_id if tenant is None else f"{tenant}:{session_id}"


def response_session(tenant: str | None, response_id: str) -> str:
    """The router's session for requests continuing the stored response `response_id`."""
    return tenant_session(tenant, "response:" + response_id)


def _namespace(tenant: str | None, cache_salt: str | None) -> str:
    salt = cache_salt or ""
    return f"{tenant or ''}/{salt}" if (tenant or salt) else ""
