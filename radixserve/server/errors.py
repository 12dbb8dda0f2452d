"""APIError: a failure the client sees as an OpenAI-style error body with an HTTP status."""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse


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
