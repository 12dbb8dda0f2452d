"""Fields: typed reads of a JSON request object, each failure a 400 that names the field."""

from __future__ import annotations

import json
import math
from typing import Any

from radixserve.server.errors import bad_request


class Fields:
    """A JSON object read field by field. A JSON null counts as absent (the default applies)."""

    def __init__(self, body: Any, where: str = "request body"):
        if not isinstance(body, dict):
            raise bad_request(f"{where} must be a JSON object, got {_json_type(body)}")
        self.body = body

    def has(self, name: str) -> bool:
        return self.body.get(name) is not None

    def raw(self, name: str, required: bool = False) -> Any:
        value = self.body.get(name)
        if value is None and required:
            raise bad_request(f"'{name}' is required", param=name)
        return value

    def string(self, name: str, default: str | None = None, required: bool = False) -> str | None:
        value = self.raw(name, required)
        if value is None:
            return default
        if not isinstance(value, str):
            raise _wrong_type(name, "a string", value)
        return value

    def boolean(self, name: str, default: bool = False) -> bool:
        value = self.raw(name)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise _wrong_type(name, "a boolean", value)
        return value

    def integer(
        self, name: str, default: int | None = None, minimum: int | None = None, maximum: int | None = None
    ) -> int | None:
        value = self.raw(name)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            raise _wrong_type(name, "an integer", value)
        _check_range(name, value, minimum, maximum)
        return value

    def number(
        self, name: str, default: float | None = None, minimum: float | None = None, maximum: float | None = None
    ) -> float | None:
        value = self.raw(name)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise _wrong_type(name, "a number", value)
        _check_range(name, value, minimum, maximum)
        return float(value)

    def object(self, name: str) -> "Fields | None":
        value = self.raw(name)
        if value is None:
            return None
        if not isinstance(value, dict):
            raise _wrong_type(name, "an object", value)
        return Fields(value, where=f"'{name}'")

    def strings(self, name: str, max_items: int) -> list[str]:
        """A string or a list of strings (as `stop` takes); empty when absent."""
        value = self.raw(name)
        if value is None:
            return []
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
            raise _wrong_type(name, "a string or a list of strings", value)
        if len(items) > max_items:
            raise bad_request(f"'{name}' takes at most {max_items} entries, got {len(items)}", param=name)
        if any(not s for s in items):
            raise bad_request(f"'{name}' entries must be non-empty strings", param=name)
        return items

    def integers(self, name: str) -> list[int]:
        value = self.raw(name)
        if value is None:
            return []
        if not isinstance(value, list) or not all(_is_int(v) for v in value):
            raise _wrong_type(name, "a list of integers", value)
        return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_range(name: str, value: float, minimum: float | None, maximum: float | None) -> None:
    if minimum is not None and value < minimum:
        raise bad_request(f"'{name}' must be >= {minimum}, got {value}", param=name)
    if maximum is not None and value > maximum:
        raise bad_request(f"'{name}' must be <= {maximum}, got {value}", param=name)


def _wrong_type(name: str, expected: str, value: Any):
    return bad_request(f"'{name}' must be {expected}, got {_json_type(value)} {_preview(value)}", param=name)


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def _preview(value: Any, limit: int = 40) -> str:
    text = json.dumps(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
