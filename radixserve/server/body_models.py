"""The base classes of every request body (OpenAI's, the native ones) and `expects`: below
both protocol/ and tools/, which build their models on them."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, WrapValidator, model_validator
from pydantic_core import PydanticCustomError


class OpenAIModel(BaseModel):
    """Base of the OpenAI request bodies. Types are strict (no "3" for 3, no 1 for true),
    a JSON null counts as absent (the default applies), and fields this server does not
    know are ignored, as OpenAI-compatible servers do for the API's newer fields."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore", populate_by_name=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
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
