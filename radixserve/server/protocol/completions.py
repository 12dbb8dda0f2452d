"""POST /v1/completions: the request body and the job it becomes."""

from __future__ import annotations

from dataclasses import replace
from typing import Annotated

from pydantic import ConfigDict, Field

from radixserve.server.errors import bad_request
from radixserve.server.protocol.common import Integer, ServedModel, expects
from radixserve.server.protocol.jobs import GenerationJob, Prompt
from radixserve.server.protocol.sampling import Logprobs, OpenAISamplingFields

CompletionPrompt = Annotated[
    str | list[str] | list[Integer] | list[list[Integer]],
    expects("a string, a list of strings, a list of token ids, or a list of token-id lists"),
]


class CompletionRequest(OpenAISamplingFields):
    """The body of POST /v1/completions (OpenAI's legacy completions)."""

    model_config = ConfigDict(json_schema_extra={"examples": [
        {"model": "default", "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0},
        {"model": "default", "prompt": ["1, 2, 3,", "a, b, c,"], "max_tokens": 4, "n": 2, "seed": 7, "logprobs": 1},
    ]})

    prompt: CompletionPrompt
    max_tokens: Integer | None = Field(None, ge=1, description="default: up to the model's context")
    echo: bool = False
    logprobs: Logprobs | None = Field(None, description="alternatives per token (0: the chosen token only)")
    best_of: Integer | None = Field(None, ge=1, description="only n (the default) is supported")
    suffix: str | None = Field(None, description="not supported: must be absent or empty")

    def to_job(self, served: ServedModel) -> GenerationJob:
        model = served.check_model(self.model)
        prompts = self.prompts()
        if self.suffix:
            raise bad_request("'suffix' is not supported", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request("'best_of' other than n is not supported", param="best_of")
        served.check_group(len(prompts), self.n, "prompt")
        params = self.sampling_params(served, self.max_tokens, self.logprobs)
        if self.echo and self.logprobs is not None:
            params = replace(params, prompt_logprobs=self.logprobs)
        stream, include_usage = self.stream_flags()
        return GenerationJob(
            model, prompts, self.samples(params), self.n, stream, include_usage, self.echo, self.logprobs,
            self.cache_salt, session_id=self.session_id, return_token_ids=self.return_token_ids,
        )

    def prompts(self) -> list[Prompt]:
        value = self.prompt
        if isinstance(value, str) or (value and isinstance(value[0], int)):
            prompts: list[Prompt] = [value]
        else:
            prompts = list(value)
        if not prompts or any(len(p) == 0 for p in prompts):
            raise bad_request("'prompt' is empty", param="prompt")
        return prompts
