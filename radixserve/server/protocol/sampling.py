"""The fields /v1/completions and /v1/chat/completions share: model, n, streaming, the
sampling options (OpenAI's and the usual open-server extensions) and what makes them a
SamplingParams."""

from __future__ import annotations

from dataclasses import replace
from typing import Annotated, Any

from pydantic import Field

from radixserve.sampling_params import MAX_LOGPROBS, SamplingParams
from radixserve.server.errors import bad_request
from radixserve.server.protocol.common import MAX_SEED, Integer, OpenAIBody, OpenAIModel, ServedModel, expects

MAX_STOP_STRINGS = 16
MAX_CHOICES = 64

NonEmptyString = Annotated[str, Field(min_length=1)]
SessionId = Annotated[str, Field(min_length=1, max_length=256)]
StopStrings = Annotated[
    NonEmptyString | Annotated[list[NonEmptyString], Field(max_length=MAX_STOP_STRINGS)],
    expects(f"a string or a list of strings (non-empty, at most {MAX_STOP_STRINGS})"),
]
TokenId = Annotated[Integer, Field(ge=0)]
Logprobs = Annotated[Integer, Field(ge=0, le=MAX_LOGPROBS)]


class StreamOptions(OpenAIModel):
    include_usage: bool = False


# Fields of the OpenAI API that cannot change an answer here: accepted and dropped.
NO_EFFECT_FIELDS = frozenset({
    "service_tier", "prompt_cache_key", "prompt_cache_retention", "prompt_cache_options", "safety_identifier",
    "prediction",  # predicted outputs only make a known answer faster; the answer is the same
})


class OpenAISamplingFields(OpenAIBody):
    """Fields of both OpenAI generation bodies (each body class adds its own)."""

    no_effect = NO_EFFECT_FIELDS

    model: str
    n: Integer = Field(1, ge=1, description="samples per prompt (at most the server's --max-n)")
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    seed: Integer | None = Field(None, ge=0, le=MAX_SEED)
    stop: StopStrings | None = None
    logit_bias: dict[str, Any] | None = Field(None, description="not supported: must be absent or empty")
    # Extensions beyond the OpenAI API (as other open servers accept them):
    top_k: Integer = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=100.0)
    min_tokens: Integer = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] = Field(default_factory=list)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    regex: str | None = None
    choices: Annotated[list[NonEmptyString], Field(min_length=1, max_length=MAX_CHOICES)] | None = None
    stop_regex: StopStrings | None = Field(None, description="stops like a stop string at a match of any pattern")
    # vLLM's spellings of the same constraints:
    guided_json: dict[str, Any] | str | None = Field(None, description="vLLM's name for a JSON-schema constraint")
    guided_regex: str | None = Field(None, description="vLLM's name for regex")
    guided_choice: Annotated[list[NonEmptyString], Field(min_length=1, max_length=MAX_CHOICES)] | None = Field(
        None, description="vLLM's name for choices")
    cache_salt: str | None = Field(None, description="requests share cached prefixes only with the same salt")
    session_id: SessionId | None = Field(
        None, description="an agent conversation: its latest context is kept ahead of other cached prefixes"
    )
    speculative: bool | None = Field(
        None, description="prompt-lookup speculative decoding for this request (same output); null: the server's --speculative"
    )
    return_token_ids: bool = Field(False, description="vLLM's: the answer carries the prompt's and each choice's token ids")
    # Accepted and ignored (type-checked all the same):
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None

    def sampling_params(
        self, served: ServedModel, max_tokens: int | None, logprobs: int | None, **constraint: Any
    ) -> SamplingParams:
        if self.logit_bias:
            raise bad_request("'logit_bias' is not supported", param="logit_bias")
        served.check_n(self.n)
        served.check_seed(self.seed, self.n)
        served.check_token_ids(self.stop_token_ids, "stop_token_ids")
        values = dict(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
            seed=self.seed,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            logprobs=logprobs,
            top_k=self.top_k,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos,
            stop_token_ids=list(self.stop_token_ids),
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            regex=self.regex,
            choices=self.choices,
            stop_regex=[self.stop_regex] if isinstance(self.stop_regex, str) else list(self.stop_regex or []),
            speculative=self.speculative,
        )
        values.update(self._guided(constraint))
        values.update(constraint)
        try:
            return SamplingParams(**values)
        except ValueError as exc:
            message = str(exc)
            name = message.split(" ", 1)[0]
            raise bad_request(message, param=name if name in values else None) from None

    def _guided(self, constraint: dict[str, Any]) -> dict[str, Any]:
        """vLLM's guided_* fields as the constraints they name. Beside another constraint (this
        server's own spelling, a second guided field, response_format or tools), a 400."""
        guided = {name: value for name, value in (("json_schema", self.guided_json), ("regex", self.guided_regex),
                                                  ("choices", self.guided_choice)) if value is not None}
        if guided and (len(guided) > 1 or constraint or self.regex is not None or self.choices is not None):
            field = next(f"guided_{k}" for k in ("json", "regex", "choice") if getattr(self, f"guided_{k}") is not None)
            raise bad_request(f"'{field}' cannot be combined with another constraint (regex, choices, guided_json, "
                              "guided_regex, guided_choice, response_format, tool calls)", param=field)
        return guided

    def samples(self, params: SamplingParams) -> list[SamplingParams]:
        """One params per sample index: sample i has seed + i when seeded."""
        if params.seed is None:
            return [params] * self.n
        return [replace(params, seed=params.seed + i) for i in range(self.n)]

    def stream_flags(self) -> tuple[bool, bool]:
        """(stream, include_usage)."""
        if self.stream_options is not None and not self.stream:
            raise bad_request("'stream_options' is only allowed when 'stream' is true", param="stream_options")
        return self.stream, self.stream_options is not None and self.stream_options.include_usage
