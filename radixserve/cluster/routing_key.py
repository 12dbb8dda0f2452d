"""RoutingKey: what the router matches a request by: the start of its prompt, and its session.

The key approximates the prompt the replica will tokenize: a completion's prompt text (or
token ids), a chat's tools and messages in order, a response's instructions and input. It
only has to share a prefix wherever the real prompts do. The key is namespaced like the
replica's cache (the tenant, i.e. the API key's digest, and cache_salt), since prefixes are
never shared across namespaces; a session (or a stored response) is led by its tenant as on
the replica, so no key can move or probe another key's session. Plain Python, no Ray.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from radixserve.cluster.prefix_tree import Key

ROUTED_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/generate", "/v1/sessions/pin")


@dataclass(frozen=True)
class RoutingKey:
    key: Key  # a str, or a tuple of token ids (led by a namespace marker when namespaced)
    session_id: str | None = None

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
    if not isinstance(body, dict) or path not in ROUTED_PATHS:
        return None
    session = body.get("session_id")
    session_id = tenant_session(tenant, session) if isinstance(session, str) and session else None
    if path == "/v1/responses" and isinstance(body.get("previous_response_id"), str):
        session_id = session_id or response_session(tenant, body["previous_response_id"])
    prompt = _prompt(path, body)
    if prompt is None:
        return None
    namespace = _namespace(None if shared_cache else tenant, body.get("cache_salt"))
    if namespace:
        prompt = f"\x00{namespace}\x00" + prompt if isinstance(prompt, str) else (f"ns:{namespace}",) + prompt
    return RoutingKey(prompt, session_id)


def tenant_session(tenant: str | None, session_id: str) -> str:
    """The router's name for a client's session: led by its tenant (as the engine names it)."""
    return session_id if tenant is None else f"{tenant}:{session_id}"


def response_session(tenant: str | None, response_id: str) -> str:
    """The router's session for requests continuing the stored response `response_id`."""
    return tenant_session(tenant, "response:" + response_id)


def _prompt(path: str, body: dict) -> str | tuple[int, ...] | None:
    if path == "/v1/chat/completions":
        return _chat_text(body.get("messages"), body.get("tools"))
    if path == "/v1/responses":
        return _responses_text(body.get("instructions"), body.get("input"))
    if path in ("/generate", "/v1/sessions/pin"):  # a pinned prefix goes where requests with it will
        return _first_prompt(body.get("text") if body.get("text") is not None else body.get("input_ids"))
    return _first_prompt(body.get("prompt"))


def _first_prompt(prompt: Any) -> str | tuple[int, ...] | None:
    """A prompt (str or token ids), or the first of a batch of them."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return tuple(prompt)
        return _first_prompt(prompt[0])
    return None


def _chat_text(messages: Any, tools: Any) -> str | None:
    if not isinstance(messages, list) or not messages:
        return None
    parts = [_json(tools)] if tools else []
    for message in messages:
        if not isinstance(message, dict):
            return None
        parts.append(f"{message.get('role')}\x1e{_content_text(message.get('content'))}")
        if message.get("tool_calls"):
            parts.append(_json(message["tool_calls"]))
    return "\x1f".join(parts) + "\x1f"


def _responses_text(instructions: Any, items: Any) -> str | None:
    head = f"{instructions}\x1f" if isinstance(instructions, str) else ""
    if isinstance(items, str):
        return head + items
    if not isinstance(items, list):
        return None
    parts = []
    for item in items:
        if isinstance(item, dict):
            parts.append(f"{item.get('role', item.get('type'))}\x1e{_content_text(item.get('content', item.get('output')))}")
    return head + "\x1f".join(parts)


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") if isinstance(p, dict) and isinstance(p.get("text"), str) else "" for p in content)
    return _json(content)


def _json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, default=str)


def _namespace(tenant: str | None, cache_salt: Any) -> str:
    salt = cache_salt if isinstance(cache_salt, str) else ""
    return f"{tenant or ''}/{salt}" if (tenant or salt) else ""
