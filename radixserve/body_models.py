"""The base classes of every request body (OpenAI's, the native ones) and `expects`: below
both protocol/ and tools/, which build their models on them."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, ValidationError, WrapValidator, model_validator
from pydantic_core import PydanticCustomError


class OpenAIModel(BaseModel):
    """Base of the OpenAI request objects. Types are strict (no "3" for 3, no 1 for true), a
    JSON null counts as absent (the default applies). Inside a body (a message, a tool, a
    format) fields this server does not know are ignored: clients send back the objects the API
    returned, with its newer fields. A body itself is an OpenAIBody."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore", populate_by_name=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data


class OpenAIBody(OpenAIModel):
    """Base of the OpenAI request bodies: a field this server does not know is a 400 naming it
    (as OpenAI answers "Unrecognized request argument"), since it may change what the request
    means (a misspelt "temprature", another server's constraint field). `no_effect` names the
    API's fields that cannot change the answer here (billing, storage and caching hints); they
    are accepted and dropped."""

    model_config = ConfigDict(extra="forbid")
    no_effect: ClassVar[frozenset[str]] = frozenset()

    @model_validator(mode="before")
    @classmethod
    def _drop_no_effect(cls, data: Any) -> Any:
        if isinstance(data, dict) and cls.no_effect:
            return {k: v for k, v in data.items() if k not in cls.no_effect}
        return data


class NativeModel(BaseModel):
    """Base of the native (/generate) bodies: strict types, and an unknown field is a 400
    (a misspelt sampling option must not be silently dropped). null is a value here:
    it means None where the field allows it (`max_tokens: null` generates to the context)."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid", populate_by_name=True)


def expects(description: str) -> WrapValidator:
    """For a union type: one error saying what the field takes ("'prompt' must be <description>")
    instead of one error per member of the union."""

    def validate(value: Any, handler: Any) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError("wrong_type", "must be {expected}", {"expected": description}) from None

    return WrapValidator(validate)
