"""APIError: a failure the client sees as an error body with an HTTP status: OpenAI's shape
({"error": {"message", "type", "param", "code"}}) everywhere but on the /v1/messages routes,
which answer in Anthropic's: {"type": "error", "error": {"type": "invalid_request_error",
"message": ...}}, statuses as Anthropic's API gives them (400, 401, 404, 413 and 500 as they
are, 504 timeout_error, and the server's 503 (queue full, shutting down, engine stopped) as 529
overloaded_error, its Retry-After kept: the official client retries both after waiting)."""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse

from radixserve.request_error import InvalidRequest


class APIError(Exception):
    """An error answered as {"error": {"message", "type", "param", "code"}} with `status`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def invalid_request(exc: InvalidRequest) -> APIError:
    """The 400 of a request the layers below refused, naming the field they named."""
    return bad_request(exc.message, param=exc.param, code=exc.code)


def server_error(message: str) -> APIError:
    return APIError(500, message, type="server_error", code="internal_error")


def unavailable(message: str, code: str, retry_after_s: int | None = None) -> APIError:
    headers = {"Retry-After": str(retry_after_s)} if retry_after_s is not None else None
    return APIError(503, message, type="server_overloaded", code=code, headers=headers)


def template_error(exc: BaseException) -> APIError | None:
    """A 400 for an exception raised while a chat template renders messages (its
    raise_exception, or a value it cannot render); None for any other exception."""
    if isinstance(exc, (ValueError, TypeError)) or type(exc).__module__.startswith("jinja2"):
        return bad_request(f"the chat template could not render these messages: {exc}", param="messages")
    return None


# ---- Anthropic's shape on its routes ------------------------------------------------------

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
