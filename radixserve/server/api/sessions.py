"""Agent sessions over HTTP: an optional `session_id` on /generate, /v1/completions,
/v1/chat/completions and /v1/messages names an agent's conversation (its latest context is
kept ahead of unreferenced prefixes); these routes end a session and pin a shared prefix.

- POST /v1/sessions/{session_id}/close [{"cache_salt"}]: release the session's hold on the
  cache (its context stays cached as an ordinary entry). 404 if no such session is open.
- POST /v1/sessions/pin {"text" | "input_ids", "ttl_s", "cache_salt"}: keep the cached part
  of this prefix (a system prompt and tool list) ahead of other entries for ttl_s seconds.
- POST /v1/sessions/release {"session_id", "text" | "input_ids", "cache_salt"}: drop now the
  session's hold and the holds (agent hints' ttl_s, pins) on its context and on the prefix.

Sessions and pins live in the caller's cache namespace (API key and cache_salt), like the
prefixes they protect, and a session belongs to the key that opened it even where keys
share the cache: another key's close finds no such session (404). They order eviction;
they never reserve memory.
"""

from __future__ import annotations

import json

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from radixserve.server.api.serving import server_state
from radixserve.server.errors import APIError, bad_request
from radixserve.server.middleware import cache_namespace, owned_session_id
from radixserve.server.protocol.body import read_body, read_json
from radixserve.server.protocol.common import parse
from radixserve.server.protocol.sessions import CloseSessionRequest, PinPrefixRequest, ReleaseRequest

MAX_SESSION_ID_CHARS = 256


def routes() -> list[Route]:
    return [
        Route("/v1/sessions/pin", pin_prefix, methods=["POST"]),
        Route("/v1/sessions/release", release, methods=["POST"]),
        Route("/v1/sessions/{session_id}/close", close_session, methods=["POST"]),
    ]


async def close_session(request: Request) -> Response:
    session_id = request.path_params["session_id"]
    if not session_id or len(session_id) > MAX_SESSION_ID_CHARS:
        raise bad_request(f"session_id must have 1 to {MAX_SESSION_ID_CHARS} characters", param="session_id")
    raw = await read_body(request, 1 << 16)
    body = CloseSessionRequest()
    if raw.strip():
        try:
            body = parse(CloseSessionRequest, json.loads(raw))
        except ValueError as exc:
            raise bad_request(f"request body is not valid JSON: {exc}") from None
    salt = _salt(request, body.cache_salt)
    owned = owned_session_id(request.scope, session_id)
    closed = await server_state(request).engine.call(lambda engine: engine.close_session(owned, salt))
    if not closed:
        raise APIError(404, f"no open session {session_id!r}", type="not_found_error", param="session_id",
                       code="session_not_found")
    return JSONResponse({"id": session_id, "object": "session", "closed": True})


async def pin_prefix(request: Request) -> Response:
    body = parse(PinPrefixRequest, await read_json(request))
    prompt = body.prompt()
    salt = _salt(request, body.cache_salt)
    server = server_state(request)
    try:
        pinned = await server.engine.call(lambda engine: engine.pin_prefix(prompt, body.ttl_s, salt))
    except ValueError as exc:
        raise bad_request(str(exc), param="input_ids" if body.input_ids is not None else "text") from None
    return JSONResponse({"object": "session.pin", "pinned_tokens": pinned, "ttl_s": body.ttl_s})


async def release(request: Request) -> Response:
    body = parse(ReleaseRequest, await read_json(request))
    prompt = body.prompt()
    salt = _salt(request, body.cache_salt)
    owned = owned_session_id(request.scope, body.session_id)
    try:
        released = await server_state(request).engine.call(lambda engine: engine.release_hints(salt, owned, prompt))
    except ValueError as exc:
        raise bad_request(str(exc), param="input_ids" if body.input_ids is not None else "text") from None
    return JSONResponse({"object": "session.release", "released": released})


def _salt(request: Request, cache_salt: str | None) -> str | None:
    """The engine's cache salt for the caller, as the generation routes compute it."""
    if server_state(request).options.shared_cache_across_keys:
        return cache_salt
    return cache_namespace(request.scope, cache_salt)
