"""read_json: a request body as JSON, within the size cap, before any model sees it.

The cap holds while reading: a declared Content-Length over it is refused before a byte of
the body is read, and a chunked body is read only up to it (the rest is never buffered).
"""

from __future__ import annotations

import json
import re
from typing import Any

from starlette.requests import Request

from radixserve.server.errors import APIError, bad_request

MAX_BODY_BYTES = 32 << 20
_ESCAPED_SURROGATE = re.compile(r"\\u[dD][89abcdefABCDEF]")


async def read_json(request: Request, limit: int = MAX_BODY_BYTES) -> Any:
    """The body as JSON; 413 when larger than `limit`; 400 for a body that is empty, not
    UTF-8, not JSON, holds a number too long to read or a lone UTF-16 surrogate."""
    raw = await read_body(request, limit)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad_request(f"request body is not valid UTF-8 (byte {exc.start}: {raw[exc.start:exc.start + 1]!r})")
    if not text.strip():
        raise bad_request("request body is empty; expected a JSON object")
    try:
        body = json.loads(text, parse_constant=_refuse_constant, parse_float=_number)
    except json.JSONDecodeError as exc:
        raise bad_request(f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise bad_request("request body is nested too deeply") from None
    except ValueError as exc:  # an integer of thousands of digits (Python's int conversion limit)
        raise bad_request(f"request body holds a number that cannot be read: {exc}") from None
    if _ESCAPED_SURROGATE.search(text):
        _refuse_lone_surrogates(body)
    return body


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(limit: int) -> APIError:
    return APIError(413, f"request body is larger than {limit} bytes", code="body_too_large")


def _refuse_lone_surrogates(body: Any) -> None:
    """A \\ud800-style escape without its pair decodes to a string no tokenizer can encode."""
    stack: list[tuple[str, Any]] = [("", body)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if not value.isascii():
                try:
                    value.encode("utf-8")
                except UnicodeEncodeError as exc:
                    where = f"'{path}'" if path else "the body"
                    raise bad_request(
                        f"{where} holds a lone UTF-16 surrogate ({value[exc.start]!r} at character {exc.start}), "
                        "which is not valid Unicode",
                        param=path or None,
                    ) from None
        elif isinstance(value, dict):
            for key, item in value.items():
                stack.append((f"{path}.{key}" if path else str(key), item))
                stack.append((path, key))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", item) for i, item in enumerate(value))


def _number(text: str) -> int | float:
    """A JSON number with a fraction or exponent: an int when it is integral (3.0, 1e3), so
    that integer fields take it as JSON Schema does; float fields take ints anyway."""
    value = float(text)
    return int(value) if value.is_integer() else value


def _refuse_constant(name: str) -> Any:
    raise bad_request(f"request body is not valid JSON: {name} is not a JSON number")
