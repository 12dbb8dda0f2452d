"""POST /generate, the native endpoint: the request body and the job it becomes.

Body: {"text": str | [str], or "input_ids": [int] | [[int]], "sampling_params": {...},
"stream": bool, "cache_salt": str, "model": str (optional; checked when given)}. A list
input is a batch answered with a list. `sampling_params` takes SamplingParams' fields with
its defaults (e.g. max_tokens 16). Unknown fields, top-level or in sampling_params, are a 400.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field

from radixserve.sampling_params import SamplingParams
from radixserve.server.errors import bad_request
from radixserve.server.protocol.common import MAX_SEED, NativeModel, ServedModel, expects
from radixserve.server.protocol.jobs import NativeJob
from radixserve.server.protocol.sampling import MAX_CHOICES, Logprobs, NonEmptyString, StopStrings, TokenId

TokenIds = Annotated[list[int], Field(min_length=1)]


class GenerateSamplingParams(NativeModel):
    """SamplingParams' fields, with its defaults and bounds (see radixserve.SamplingParams)."""

    max_tokens: int | None = Field(16, ge=1, description="null: up to the model's context")
    min_tokens: int = Field(0, ge=0)
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_k: int = Field(0, ge=-1)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=100.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: StopStrings | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: Logprobs | None = None
    prompt_logprobs: Logprobs | None = None
    prompt_logprobs_start: int = Field(0, ge=0)
    skip_special_tokens: bool = True
    regex: str | None = None
    json_schema: Annotated[dict[str, Any] | str, expects("an object or a JSON string")] | None = None
    json_object: bool = False
    choices: Annotated[list[NonEmptyString], Field(min_length=1, max_length=MAX_CHOICES)] | None = None

    def to_sampling_params(self) -> SamplingParams:
        try:
            return SamplingParams(**self.model_dump())
        except ValueError as exc:
            raise bad_request(f"sampling_params: {exc}", param="sampling_params") from None


class GenerateRequest(NativeModel):
    """The body of POST /generate."""

    text: Annotated[str | Annotated[list[str], Field(min_length=1)],
                    expects("a string or a non-empty list of strings")] | None = None
    input_ids: Annotated[TokenIds | Annotated[list[TokenIds], Field(min_length=1)],
                         expects("a non-empty list of token ids or of token-id lists")] | None = None
    sampling_params: GenerateSamplingParams | None = None
    stream: bool = False
    cache_salt: str | None = Field(None, description="requests share cached prefixes only with the same salt")
    model: str | None = Field(None, description="checked when given")

    def to_job(self, served: ServedModel) -> NativeJob:
        if self.model is not None:
            served.check_model(self.model)
        prompts, batched = self._prompts()
        served.check_group(len(prompts), 1, "text" if self.text is not None else "input_ids")
        sampling = self.sampling_params or GenerateSamplingParams()
        served.check_seed(sampling.seed, 1)
        served.check_token_ids(sampling.stop_token_ids or [], "sampling_params.stop_token_ids")
        return NativeJob(prompts, sampling.to_sampling_params(), self.stream, batched, self.cache_salt)

    def _prompts(self) -> tuple[list[str | list[int]], bool]:
        if (self.text is None) == (self.input_ids is None):
            raise bad_request("give exactly one of 'text' or 'input_ids'", param="text")
        if isinstance(self.text, str):
            return [self.text], False
        if self.text is not None:
            return list(self.text), True
        if isinstance(self.input_ids[0], int):
            return [list(self.input_ids)], False
        return [list(p) for p in self.input_ids], True
