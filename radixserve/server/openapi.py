"""The OpenAPI 3.1 description of the server (GET /openapi.json): every route, request
bodies from the protocol models' JSON schema, each answer's status codes and error body."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from radixserve.server.protocol import ChatCompletionRequest, CompletionRequest, GenerateRequest
from radixserve.server.protocol.anthropic import CountTokensRequest, MessagesRequest
from radixserve.server.protocol.responses import ResponsesRequest

REF = "#/components/schemas/{model}"

ERROR_BODY = {
    "type": "object",
    "description": "OpenAI-style error",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}

ANTHROPIC_ERROR_BODY = {
    "type": "object",
    "description": "Anthropic-style error",
    "required": ["type", "error"],
    "properties": {
        "type": {"const": "error"},
        "error": {
            "type": "object",
            "required": ["type", "message"],
            "properties": {"type": {"type": "string"}, "message": {"type": "string"}},
        },
    },
}

ERROR_STATUSES = {
    400: "the body is malformed or a field is invalid (the error's param names it)",
    401: "missing or wrong API key (only when the server has keys)",
    404: "unknown model",
    413: "the body is larger than the server's cap (32 MiB)",
    500: "the engine failed on this request (the server keeps serving)",
    503: "the queue is full (Retry-After), the server is shutting down, or the engine stopped",
    504: "the request ran longer than --request-timeout",
    529: "overloaded (Anthropic's 503): the queue is full (Retry-After), the server is shutting down or the engine stopped",
}
JSON_OBJECT = {"type": "object"}
SSE_EVENT = {
    "type": "object",
    "description": "one server-sent event: data is a JSON chunk (or an error body); the last is [DONE]",
    "required": ["data"],
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
}
SSE = {"text/event-stream": {"schema": SSE_EVENT}}


@dataclass(frozen=True)
class Operation:
    method: str
    summary: str
    body: type[BaseModel] | None = None
    ok: dict[str, Any] = field(default_factory=lambda: {"application/json": {"schema": JSON_OBJECT}})
    errors: tuple[int, ...] = (401,)
    error_body: str = "ErrorResponse"


OPERATIONS = {
    "/health": Operation("get", "Liveness: 200 while the engine runs", errors=(503,)),
    "/v1/models": Operation("get", "The served model"),
    "/v1/completions": Operation(
        "post", "OpenAI completions (stream: server-sent events)", CompletionRequest,
        {"application/json": {"schema": JSON_OBJECT}, **SSE}, (400, 401, 404, 413, 500, 503, 504),
    ),
    "/v1/chat/completions": Operation(
        "post", "OpenAI chat completions (stream: server-sent events)", ChatCompletionRequest,
        {"application/json": {"schema": JSON_OBJECT}, **SSE}, (400, 401, 404, 413, 500, 503, 504),
    ),
    "/v1/responses": Operation(
        "post", "OpenAI Responses API (stream: typed server-sent events)", ResponsesRequest,
        {"application/json": {"schema": JSON_OBJECT}, **SSE}, (400, 401, 404, 413, 500, 503, 504),
    ),
    "/v1/messages": Operation(
        "post", "Anthropic Messages API (stream: Anthropic's server-sent events)", MessagesRequest,
        {"application/json": {"schema": JSON_OBJECT}, **SSE}, (400, 401, 404, 413, 500, 504, 529),
        "AnthropicErrorResponse",
    ),
    "/v1/messages/count_tokens": Operation(
        "post", "Anthropic token counting: the prompt's input_tokens", CountTokensRequest,
        errors=(400, 401, 404, 413), error_body="AnthropicErrorResponse",
    ),
    "/generate": Operation(
        "post", "Native generation: text or token ids in; text, ids and timings out", GenerateRequest,
        {"application/json": {"schema": {"type": ["object", "array"]}}, **SSE}, (400, 401, 404, 413, 500, 503, 504),
    ),
    "/metrics": Operation("get", "Prometheus metrics", ok={"text/plain": {"schema": {"type": "string"}}}),
    "/flush_cache": Operation("post", "Drop every unused prefix-cache entry"),
    "/openapi.json": Operation("get", "This description"),
    "/debug/check_integrity": Operation("post", "Check the block accounting (debug)", errors=(401, 500)),
    "/debug/stats": Operation("get", "Engine counters (debug)"),
}


def openapi_schema(routes: dict[str, set[str]], auth: bool = False) -> dict[str, Any]:
    """The description of `routes` (path -> HTTP methods, the app's routes); `auth`: the
    server requires API keys. A route missing from OPERATIONS gets a generic entry."""
    paths = {path: OPERATIONS.get(path) or _generic(methods) for path, methods in routes.items()}
    models = [op.body for op in paths.values() if op.body is not None]
    refs, defs = models_json_schema([(m, "validation") for m in models], ref_template=REF)
    schemas = {**defs.get("$defs", {}), "ErrorResponse": ERROR_BODY, "AnthropicErrorResponse": ANTHROPIC_ERROR_BODY}
    document: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "radixserve", "version": "1"},
        "paths": {
            path: {op.method: _operation(op, refs.get((op.body, "validation")) if op.body else None, auth)}
            for path, op in paths.items()
        },
        "components": {"schemas": schemas},
    }
    if auth:
        document["components"]["securitySchemes"] = {
            "bearer": {"type": "http", "scheme": "bearer"},
            "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"},  # Anthropic's header
        }
    return document


def _generic(methods: set[str]) -> Operation:
    method = "post" if "POST" in methods else "get"
    return Operation(method, "(undocumented)", errors=(400, 401, 404, 413, 500, 503) if method == "post" else (401,))


def _operation(op: Operation, body_ref: dict[str, Any] | None, auth: bool) -> dict[str, Any]:
    error = {"application/json": {"schema": {"$ref": REF.format(model=op.error_body)}}}
    statuses = [s for s in op.errors if auth or s != 401]
    if body_ref is not None:
        statuses = sorted(set(statuses) | {400, 413})
    responses: dict[str, Any] = {"200": {"description": "OK", "content": op.ok}}
    responses.update({str(s): {"description": ERROR_STATUSES[s], "content": error} for s in statuses})
    operation: dict[str, Any] = {"summary": op.summary, "responses": responses}
    if body_ref is not None:
        operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": body_ref}}}
    if auth and op.errors != (503,):
        operation["security"] = [{"bearer": []}, {"apiKey": []}]
    return operation
