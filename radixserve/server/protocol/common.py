"""What every request model shares: the base classes, the served model and its limits, and
the translation of a pydantic ValidationError into an OpenAI-style 400 naming the field."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from radixserve.body_models import NativeModel, OpenAIBody, OpenAIModel, expects  # noqa: F401 - their home for callers
from radixserve.server.errors import APIError, bad_request

Model = TypeVar("Model", bound=BaseModel)

MAX_SEED = 2**64 - 1  # seeds are unsigned 64-bit; sample i of n uses seed + i

# An integer field. JSON has one number type: read_json reads 3.0 as the integer 3 (as JSON
# Schema counts it), so the strict int check refuses only numbers that are not integers.
Integer = int


@dataclass(frozen=True)
class ServedModel:
    """What the server answers to in the `model` field, and the limits a body must fit."""

    names: tuple[str, ...]  # the first is the name responses carry
    max_n: int
    max_prompts: int
    max_group: int  # engine requests (prompts x n) one HTTP request may need: the queue's size
    vocab_size: int | None = None

    def check_model(self, model: str) -> str:
        if model not in self.names:
            raise APIError(
                404,
                f"the model '{model}' does not exist; this server serves '{self.names[0]}'",
                param="model",
                code="model_not_found",
            )
        return self.names[0]

    def check_n(self, n: int) -> None:
        if n > self.max_n:
            raise bad_request(f"'n' must be <= {self.max_n}, got {n}", param="n")

    def check_group(self, num_prompts: int, n: int, prompt_param: str) -> None:
        """A request needing more engine requests than the queue holds could never be
        accepted: a 400, not a 503 to retry."""
        if num_prompts > self.max_prompts:
            raise bad_request(f"at most {self.max_prompts} prompts per request, got {num_prompts}", param=prompt_param)
        if num_prompts * n > self.max_group:
            raise bad_request(
                f"this request needs {num_prompts * n} engine requests ({num_prompts} prompt(s) x n={n}); "
                f"the server queues at most {self.max_group} (--max-queued-requests)",
                param="n" if n > 1 else prompt_param,
                code="request_too_large",
            )

    def check_token_ids(self, ids: list[int], param: str) -> None:
        if self.vocab_size is None:
            return
        for token in ids:
            if token >= self.vocab_size:
                raise bad_request(f"'{param}' holds token id {token}; the vocabulary has {self.vocab_size}", param=param)

    def check_seed(self, seed: int | None, n: int) -> None:
        if seed is not None and seed + n - 1 > MAX_SEED:
            raise bad_request(f"'seed' + n - 1 must be <= 2**64 - 1 (sample i uses seed + i), got {seed}", param="seed")


def parse(model: type[Model], body: Any) -> Model:
    """`body` (parsed JSON) as `model`; an APIError 400 naming the first bad field otherwise."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc) from None


def validation_error(exc: ValidationError) -> APIError:
    errors = exc.errors(include_url=False)
    extra = [_path(e["loc"]) for e in errors if e["type"] == "extra_forbidden"]
    if extra:
        return bad_request(f"unknown field(s): {', '.join(sorted(extra))} (not supported by this server)",
                           param=sorted(extra)[0])
    error = errors[0]
    path = _path(error["loc"])
    if not path:
        return bad_request(f"request body must be a JSON object, got {_json_type(error['input'])}")
    return bad_request(f"'{path}' {_problem(error)}", param=path)


# Pydantic error type -> what the field must be. Range and length errors are worded below.
_TYPE_WORDS = {
    "int_type": "an integer", "int_parsing": "an integer", "int_from_float": "an integer",
    "float_type": "a number", "float_parsing": "a number", "finite_number": "a finite number",
    "string_type": "a string", "bool_type": "a boolean", "bool_parsing": "a boolean",
    "list_type": "an array", "dict_type": "an object", "model_type": "an object",
    "model_attributes_type": "an object",
}


def _problem(error: dict[str, Any]) -> str:
    kind, ctx, value = error["type"], error.get("ctx") or {}, error.get("input")
    if kind == "missing":
        return "is required"
    if kind in _TYPE_WORDS:
        return f"must be {_TYPE_WORDS[kind]}, got {_json_type(value)} {_preview(value)}"
    if kind == "wrong_type":
        return f"must be {ctx['expected']}, got {_json_type(value)} {_preview(value)}"
    if kind == "literal_error":
        return f"must be one of {ctx['expected']}, got {_preview(value)}"
    bounds = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=", "less_than": "<"}
    if kind in bounds:
        limit = next(iter(ctx.values()))
        return f"must be {bounds[kind]} {limit}, got {_preview(value)}"
    if kind in ("too_short", "string_too_short"):
        size = ctx.get("min_length", 1)
        return "must not be empty" if size == 1 else f"must have at least {size} items"
    if kind in ("too_long", "string_too_long"):
        unit = "characters" if kind == "string_too_long" else "entries"
        return f"takes at most {ctx.get('max_length')} {unit}"
    return f"is invalid: {error['msg']}"


def _path(loc: tuple[Any, ...]) -> str:
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


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
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
