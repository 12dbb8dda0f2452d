"""Errors in Anthropic's shape for the /v1/messages routes:
{"type": "error", "error": {"type": "invalid_request_error", "message": ...}}.

Statuses follow Anthropic's API: 400, 401, 404, 413 and 500 as they are, 504 timeout_error,
and the server's 503 (queue full, shutting down, engine stopped) as 529 overloaded_error,
its Retry-After kept (the official client retries both after waiting).
"""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse

from radixserve.server.errors import APIError

ANTHROPIC_PREFIX = "/v1/messages"
OVERLOADED = 529
ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
    413: "request_too_large", 429: "rate_limit_error", 500: "api_error", 504: "timeout_error",
    OVERLOADED: "overloaded_error",
}


def speaks_anthropic(path: str) -> bool:
    return path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + "/")


def error_response(path: str, error: APIError) -> JSONResponse:
    """`error` in the shape the caller of `path` expects (OpenAI's everywhere else)."""
    if not speaks_anthropic(path):
        return error.response()
    return JSONResponse(anthropic_error_body(error), status_code=anthropic_status(error.status), headers=error.headers)


def anthropic_status(status: int) -> int:
    return OVERLOADED if status == 503 else status


def anthropic_error_body(error: APIError) -> dict[str, Any]:
    status = anthropic_status(error.status)
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}
