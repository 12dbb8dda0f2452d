"""create_app: the Starlette app (routes, middleware, lifespan) in front of an AsyncEngine."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from dataclasses import dataclass, field, replace
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from radixserve.engine.protocol import EngineProtocol
from radixserve.server import anthropic_api, native_api, sessions_api, sglang_api
from radixserve.server.anthropic_errors import error_response
from radixserve.server.anthropic_output import MessagesResponder
from radixserve.server.anthropic_sse import AnthropicEventStream
from radixserve.server.async_engine import AsyncEngine
from radixserve.server.errors import APIError, server_error
from radixserve.server.metrics import CONTENT_TYPE, ServerMetrics
from radixserve.server.middleware import (
    ApiKeyAuth, StatusCounter, cache_namespace, may_act_for_all, owned_session_id, tenant,
)
from radixserve.server.openai_chat import ChatResponder, chat_job
from radixserve.server.openai_completions import CompletionResponder
from radixserve.server.openapi import openapi_schema
from radixserve.server.options import ServerOptions
from radixserve.server.protocol import (
    ChatCompletionRequest, CompletionRequest, GenerateRequest, GenerationJob, NativeJob, ServedModel, parse,
)
from radixserve.server.protocol.body import read_json
from radixserve.server.request_group import RequestGroup
from radixserve.server.response_store import ResponseStore
from radixserve.server.protocol.responses import ResponsesRequest
from radixserve.server.responses_api import ResponsesResponder, responses_job
from radixserve.server.sse import EventStream, wait_for_disconnect
from radixserve.server.token_text import TokenTexts
from radixserve.server.tools.serving import ToolCalling

log = logging.getLogger("radixserve.server")

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
    responses: ResponseStore = field(default_factory=ResponseStore)  # previous_response_id


def create_app(engine: EngineProtocol, options: ServerOptions | None = None) -> Starlette:
    """The app for `engine` (which it owns from startup on: the engine thread is the only
    one that calls it until shutdown). Serve with uvicorn; its lifespan starts and stops
    the engine thread."""
    options = options or ServerOptions()
    async_engine = AsyncEngine(engine, options.max_queued_requests, options.request_timeout_s, options.retry_after_s)
    metrics = ServerMetrics(lambda: async_engine.latest_snapshot, lambda: _server_gauges(async_engine))
    async_engine.on_finished = metrics.observe_finished
    state = ServerState(
        async_engine, options, _served_model(engine, options), TokenTexts(engine.tokenizer), metrics,
        engine.max_model_len, ToolCalling(engine.tokenizer, options.tool_call_parser),
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        async_engine.start()
        yield
        await async_engine.shutdown(options.shutdown_grace_s)

    routes = app_routes(options)
    middleware = [
        Middleware(StatusCounter, observe=metrics.observe_http, endpoints=[r.path for r in routes]),
        Middleware(ApiKeyAuth, api_keys=options.all_api_keys, admin_keys=options.admin_api_keys),
    ]
    app = Starlette(
        routes=routes,
        middleware=middleware,
        lifespan=lifespan,
        exception_handlers={APIError: _api_error, HTTPException: _http_error, Exception: _unexpected_error},
    )
    app.state.server = state
    return app


# ---- routes ------------------------------------------------------------------------------


def app_routes(options: ServerOptions) -> list[Route]:
    """Every route of the app (the cluster routes each: tests/cluster/test_cluster_router.py)."""
    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/responses", responses, methods=["POST"]),
        Route("/v1/messages", messages, methods=["POST"]),  # Anthropic's Messages API
        Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
        Route("/generate", generate, methods=["POST"]),
        Route("/metrics", metrics_endpoint, methods=["GET"]),
        *sglang_api.routes(),  # /get_model_info, /get_server_info, /abort_request, /flush_cache
        *sessions_api.routes(),  # /v1/sessions/{id}/close, /v1/sessions/pin
        Route("/openapi.json", openapi, methods=["GET"]),
    ]
    if options.enable_debug_endpoints:
        routes += [
            Route("/debug/check_integrity", debug_check_integrity, methods=["POST"]),
            Route("/debug/stats", debug_stats, methods=["GET"]),
        ]
    return routes


async def health(request: Request) -> Response:
    engine = _state(request).engine
    if engine.healthy:
        return JSONResponse({"status": "ok"})
    reason = engine.broken_reason or "the engine is not running"
    return JSONResponse({"status": "unhealthy", "reason": reason}, status_code=503)


async def models(request: Request) -> Response:
    state = _state(request)
    card = {
        "id": state.served.names[0],
        "object": "model",
        "created": int(time.time()),
        "owned_by": "radixserve",
        "max_model_len": state.max_model_len,
    }
    return JSONResponse({"object": "list", "data": [card]})


async def completions(request: Request) -> Response:
    state = _state(request)
    job = _in_namespace(request, parse(CompletionRequest, await read_json(request)).to_job(state.served))
    return await _serve_job(request, job, CompletionResponder(job, state.texts))


async def chat_completions(request: Request) -> Response:
    state = _state(request)
    job, tools = await chat_job(parse(ChatCompletionRequest, await read_json(request)), state.served, state.tools)
    job = _in_namespace(request, job)
    return await _serve_job(request, job, ChatResponder(job, state.texts, tools))


async def responses(request: Request) -> Response:
    state = _state(request)
    body = parse(ResponsesRequest, await read_json(request))
    job, responder = await responses_job(body, state.served, state.tools, state.responses.for_owner(tenant(request.scope)))
    return await _serve_job(request, _in_namespace(request, job), responder)


async def messages(request: Request) -> Response:
    state = _state(request)
    job, responder = await anthropic_api.messages_job(await read_json(request), state.served, state.tools)
    return await _serve_job(request, _in_namespace(request, job), responder, AnthropicEventStream)


async def count_tokens(request: Request) -> Response:
    state = _state(request)
    counted = await anthropic_api.count_tokens(await read_json(request), state.served, state.tools, state.engine.engine)
    return JSONResponse(counted)


async def generate(request: Request) -> Response:
    state = _state(request)
    job = _in_namespace(request, parse(GenerateRequest, await read_json(request)).to_job(state.served))
    return await native_api.respond(request, job, state.engine, state.texts, _results_unless_disconnected)


async def metrics_endpoint(request: Request) -> Response:
    return Response(_state(request).metrics.render(), media_type=CONTENT_TYPE)


async def openapi(request: Request) -> Response:
    routes = {r.path: set(r.methods or ()) for r in request.app.routes if isinstance(r, Route)}
    return JSONResponse(openapi_schema(routes, auth=bool(_state(request).options.all_api_keys)))


def _require_admin(request: Request) -> None:
    """The debug endpoints report on (and lock) every tenant's state: with keys, admin keys only."""
    if not may_act_for_all(request.scope):
        raise APIError(403, "the debug endpoints span every tenant: call them with an admin key (--admin-api-key)",
                       type="permission_error", code="admin_key_required")


async def debug_check_integrity(request: Request) -> Response:
    _require_admin(request)

    def check(engine: EngineProtocol) -> dict[str, Any]:
        engine.check_integrity()
        return engine.stats()

    try:
        stats = await _state(request).engine.call(check)
    except AssertionError as exc:
        raise server_error(f"integrity check failed: {exc}") from None
    return JSONResponse({"ok": True, "stats": stats})


async def debug_stats(request: Request) -> Response:
    _require_admin(request)
    return JSONResponse(await _state(request).engine.call(lambda engine: engine.stats()))


# ---- request plumbing --------------------------------------------------------------------


async def _serve_job(
    request: Request, job: Any, responder: CompletionResponder | ChatResponder | ResponsesResponder | MessagesResponder,
    stream: type[EventStream] = EventStream,
) -> Response:
    group = await _state(request).engine.submit(job.inputs())
    if job.stream:
        return stream(responder.chunks(group), on_close=group.abort)
    outputs = await _results_unless_disconnected(request, group)
    if outputs is None:
        return Response(status_code=CLIENT_CLOSED)
    return JSONResponse(responder.body(outputs))


async def _results_unless_disconnected(request: Request, group: RequestGroup) -> list | None:
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


def _in_namespace(request: Request, job: GenerationJob | NativeJob) -> GenerationJob | NativeJob:
    """The job in its caller's namespace: the engine's cache salt is the caller's API-key
    namespace (unless keys share the cache) combined with the body's cache_salt, and its
    session id is the caller's own (always, shared cache or not)."""
    session_id = owned_session_id(request.scope, job.session_id)
    if _state(request).options.shared_cache_across_keys:
        return replace(job, session_id=session_id)
    return replace(job, cache_salt=cache_namespace(request.scope, job.cache_salt), session_id=session_id)


def _state(request: Request) -> ServerState:
    return request.app.state.server


def _served_model(engine: EngineProtocol, options: ServerOptions) -> ServedModel:
    names = [options.served_model_name] if options.served_model_name else []
    names.append(engine.model_name)
    path = getattr(getattr(engine, "config", None), "model", None)
    if path:
        names += [str(path), os.path.basename(os.path.normpath(str(path)))]
    unique = tuple(dict.fromkeys(names))
    spec = getattr(getattr(engine, "loaded", None), "spec", None)
    vocab_size = getattr(spec, "vocab_size", None)
    return ServedModel(unique, options.max_n, options.max_prompts, options.max_queued_requests, vocab_size)


def _server_gauges(engine: AsyncEngine) -> dict[str, float]:
    return {
        "radixserve_server_requests_queued": engine.num_queued,
        "radixserve_server_requests_in_flight": engine.num_in_flight,
    }


# ---- errors --------------------------------------------------------------------------------


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return error_response(request.url.path, exc)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    message = f"{request.method} {request.url.path}: {exc.detail}"
    return error_response(request.url.path, APIError(exc.status_code, message, type=kind, headers=exc.headers))


async def _unexpected_error(request: Request, exc: Exception) -> Response:
    log.error("unexpected error answering %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(request.url.path, server_error(f"internal error: {type(exc).__name__}: {exc}"))
