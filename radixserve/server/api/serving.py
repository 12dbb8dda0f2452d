"""What every API's routes share: the server's state, a job served as a stream or a whole
answer, the wait that notices a client going away, and the caller's cache namespace."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from radixserve.server.async_engine import AsyncEngine, FinishHook
from radixserve.server.metrics import ServerMetrics
from radixserve.server.middleware import cache_namespace, owned_session_id
from radixserve.server.options import ServerOptions
from radixserve.server.protocol import GenerationJob, NativeJob, ServedModel
from radixserve.server.api.anthropic_pins import RecentPins
from radixserve.server.reasoning import Reasoning
from radixserve.server.reply_store import NamespaceReplies, ReplyIdStore
from radixserve.server.request_group import RequestGroup
from radixserve.server.output.token_ids import TokenIdsResponder
from radixserve.server.response_store import ResponseStore
from radixserve.server.sse import EventStream, wait_for_disconnect
from radixserve.server.token_text import TokenTexts
from radixserve.server.tool_calling import ToolCalling

CLIENT_CLOSED = 499  # nginx's status for a client that went away before the answer


@dataclass
class ServerState:
    """What handlers share; `app.state.server`."""

    engine: AsyncEngine
    options: ServerOptions
    served: ServedModel
    texts: TokenTexts
    metrics: ServerMetrics
    max_model_len: int
    tools: ToolCalling
    reasoning: Reasoning  # --reasoning-parser
    cache_pins: RecentPins = field(default_factory=RecentPins)  # Anthropic's cache_control marks, pinned lately
    responses: ResponseStore = field(default_factory=ResponseStore)  # previous_response_id
    replies: ReplyIdStore = field(default_factory=ReplyIdStore)  # the ids of replies, to splice when re-sent


class Responder(Protocol):
    """An API's encoder of one job's outputs: the whole answer, or its stream of events."""

    def body(self, outputs: list[Any]) -> dict[str, Any]: ...

    def chunks(self, group: RequestGroup) -> Any: ...


def server_state(request: Request) -> ServerState:
    return request.app.state.server


async def serve_job(
    request: Request, job: GenerationJob, responder: Responder, stream: type[EventStream] = EventStream,
    on_finish: FinishHook | None = None,
) -> Response:
    group = await server_state(request).engine.submit(job.inputs(), on_finish=on_finish)
    if job.return_token_ids:
        responder = TokenIdsResponder(responder)
    if job.stream:
        return stream(responder.chunks(group), on_close=group.abort)
    outputs = await results_unless_disconnected(request, group)
    if outputs is None:
        return Response(status_code=CLIENT_CLOSED)
    return JSONResponse(responder.body(outputs))


async def results_unless_disconnected(request: Request, group: RequestGroup) -> list | None:
    """The group's final outputs, or None if the client went away first (the group is then
    aborted). Raises the group's APIError (timeout, engine failure)."""
    results = asyncio.ensure_future(group.results())
    watcher = asyncio.ensure_future(wait_for_disconnect(request.receive))
    try:
        await asyncio.wait({results, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not results.done():
            results.cancel()
        group.abort()
    if results.cancelled() or not results.done():
        return None
    return results.result()


def caller_replies(request: Request, cache_salt: str | None) -> NamespaceReplies | None:
    """The caller's stored reply ids (its key and cache_salt, even where keys share the
    cache), or None with --reply-token-reuse off."""
    state = server_state(request)
    if not state.options.reply_token_reuse:
        return None
    return state.replies.view(cache_namespace(request.scope, cache_salt))


def in_namespace(request: Request, job: GenerationJob | NativeJob) -> GenerationJob | NativeJob:
    """The job in its caller's namespace: the engine's cache salt is the caller's API-key
    namespace (unless keys share the cache) combined with the body's cache_salt, and its
    session id is the caller's own (always, shared cache or not). The body's agent hints
    (read_hinted_json) go with it."""
    session_id = owned_session_id(request.scope, job.session_id)
    hints = getattr(request.state, "agent_hints", None)
    if server_state(request).options.shared_cache_across_keys:
        return replace(job, session_id=session_id, hints=hints)
    return replace(job, cache_salt=cache_namespace(request.scope, job.cache_salt), session_id=session_id, hints=hints)
