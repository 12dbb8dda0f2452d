"""create_app: the Starlette app (routes, middleware, lifespan) in front of an AsyncEngine. Each
API's routes live in server/api/ (one module per API); this module adds health, models,
metrics, the OpenAPI schema, the debug endpoints and the error handlers."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from radixserve.engine.protocol import EngineProtocol
from radixserve.server.api import anthropic, chat, completions, native, responses, sessions, sglang
from radixserve.server.api.serving import ServerState, server_state
from radixserve.server.async_engine import AsyncEngine
from radixserve.request_error import InvalidRequest
from radixserve.server.errors import APIError, error_response, invalid_request, server_error
from radixserve.server.metrics import CONTENT_TYPE, ServerMetrics
from radixserve.server.middleware import ApiKeyAuth, StatusCounter, may_act_for_all
from radixserve.server.openapi import openapi_schema
from radixserve.server.options import ServerOptions
from radixserve.server.protocol import ServedModel
from radixserve.server.token_text import TokenTexts
from radixserve.server.reasoning import Reasoning
from radixserve.server.tool_calling import ToolCalling

log = logging.getLogger("radixserve.server")


def create_app(engine: EngineProtocol, options: ServerOptions | None = None) -> Starlette:
    """The app for `engine` (which it owns from startup on: the engine thread is the only
    one that calls it until shutdown). Serve with uvicorn; its lifespan starts and stops
    the engine thread."""
    options = options or ServerOptions()
    if options.shared_cache_across_keys and hasattr(engine, "isolate_drafts"):
        engine.isolate_drafts()  # keys share cache namespaces: another key's replies must not feed drafts
    async_engine = AsyncEngine(engine, options.max_queued_requests, options.request_timeout_s, options.retry_after_s)
    metrics = ServerMetrics(lambda: async_engine.latest_snapshot, lambda: _server_gauges(async_engine))
    async_engine.on_finished = metrics.observe_finished
    texts = TokenTexts(engine.tokenizer)  # the engine's tokenizer, read from the event loop too (no copy)
    state = ServerState(
        async_engine, options, _served_model(engine, options), texts, metrics,
        engine.max_model_len,
        ToolCalling(engine.tokenizer, options.tool_call_parser, options.chat_template, options.trust_request_chat_template),
        Reasoning(engine.tokenizer, options.reasoning_parser, options.chat_template),
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
        exception_handlers={APIError: _api_error, InvalidRequest: _invalid_request, HTTPException: _http_error,
                            Exception: _unexpected_error},
    )
    app.state.server = state
    return app


# ---- routes ------------------------------------------------------------------------------


def app_routes(options: ServerOptions) -> list[Route]:
    """Every route of the app (the cluster routes each: tests/cluster/test_cluster_router.py)."""
    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        *completions.routes(),  # OpenAI's
        *chat.routes(),
        *responses.routes(),
        *anthropic.routes(),  # Anthropic's Messages API: /v1/messages, /v1/messages/count_tokens
        *native.routes(),  # /generate
        Route("/metrics", metrics_endpoint, methods=["GET"]),
        *sglang.routes(),  # /get_model_info, /get_server_info, /abort_request, /flush_cache
        *sessions.routes(),  # /v1/sessions/{id}/close, /v1/sessions/pin
        Route("/openapi.json", openapi, methods=["GET"]),
    ]
    if options.enable_debug_endpoints:
        routes += [
            Route("/debug/check_integrity", debug_check_integrity, methods=["POST"]),
            Route("/debug/stats", debug_stats, methods=["GET"]),
        ]
    return routes


async def health(request: Request) -> Response:
    engine = server_state(request).engine
    if engine.healthy:
        return JSONResponse({"status": "ok"})
    reason = engine.broken_reason or "the engine is not running"
    return JSONResponse({"status": "unhealthy", "reason": reason}, status_code=503)


async def models(request: Request) -> Response:
    state = server_state(request)
    card = {
        "id": state.served.names[0],
        "object": "model",
        "created": int(time.time()),
        "owned_by": "radixserve",
        "max_model_len": state.max_model_len,
    }
    return JSONResponse({"object": "list", "data": [card]})


async def metrics_endpoint(request: Request) -> Response:
    return Response(server_state(request).metrics.render(), media_type=CONTENT_TYPE)


async def openapi(request: Request) -> Response:
    routes = {r.path: set(r.methods or ()) for r in request.app.routes if isinstance(r, Route)}
    return JSONResponse(openapi_schema(routes, auth=bool(server_state(request).options.all_api_keys)))


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
        stats = await server_state(request).engine.call(check)
    except AssertionError as exc:
        raise server_error(f"integrity check failed: {exc}") from None
    return JSONResponse({"ok": True, "stats": stats})


async def debug_stats(request: Request) -> Response:
    _require_admin(request)
    return JSONResponse(await server_state(request).engine.call(lambda engine: engine.stats()))


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
        "radixserve_grammar_cache_bytes": engine.engine.grammars.cache_size_bytes(),
    }


# ---- errors --------------------------------------------------------------------------------


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return error_response(request.url.path, exc)


async def _invalid_request(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, InvalidRequest)
    return error_response(request.url.path, invalid_request(exc))


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    message = f"{request.method} {request.url.path}: {exc.detail}"
    return error_response(request.url.path, APIError(exc.status_code, message, type=kind, headers=exc.headers))


async def _unexpected_error(request: Request, exc: Exception) -> Response:
    log.error("unexpected error answering %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(request.url.path, server_error(f"internal error: {type(exc).__name__}: {exc}"))
