"""POST /generate, the native endpoint: the request body and the job it becomes.

Body: {"text": str | [str], or "input_ids": [int] | [[int]], "sampling_params": {...},
"stream": bool, "cache_salt": str, "model": str (optional; checked when given)}. A list
input is a batch answered with a list. `sampling_params` takes SamplingParams' fields with
its defaults (e.g. max_tokens 16). Unknown fields, top-level or in sampling_params, are a 400.

SGLang's spelling is accepted beside it (what `sgl.RuntimeEndpoint` sends): in
sampling_params `max_new_tokens` (0: prefill only), `min_new_tokens`, `n`, `stop_regex`,
`spaces_between_special_tokens`; top level `rid`, `return_logprob`, `logprob_start_len`,
`top_logprobs_num`, `return_text_in_logprobs`. The answer is api/native.py's.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import ConfigDict, Field

from dataclasses import replace

from radixserve.sampling_params import SamplingParams
from radixserve.server.errors import bad_request
from radixserve.server.protocol.common import MAX_SEED, Integer, NativeModel, ServedModel, expects
from radixserve.server.protocol.jobs import NativeJob
from radixserve.server.protocol.sampling import MAX_CHOICES, Logprobs, NonEmptyString, SessionId, StopStrings, TokenId

TokenIds = Annotated[list[Integer], Field(min_length=1)]


class GenerateSamplingParams(NativeModel):
    """SamplingParams' fields, with its defaults and bounds (see radixserve.SamplingParams)."""

    max_tokens: Integer | None = Field(16, ge=0, description="null: up to the model's context; 0: prefill only")
    min_tokens: Integer = Field(0, ge=0)
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_k: Integer = Field(0, ge=-1)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=100.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    seed: Integer | None = Field(None, ge=0, le=MAX_SEED)
    stop: StopStrings | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: Logprobs | None = None
    prompt_logprobs: Logprobs | None = None
    prompt_logprobs_start: Integer = Field(0, ge=0)
    skip_special_tokens: bool = True
    regex: str | None = None
    json_schema: Annotated[dict[str, Any] | str, expects("an object or a JSON string")] | None = None
    json_object: bool = False
    choices: Annotated[list[NonEmptyString], Field(min_length=1, max_length=MAX_CHOICES)] | None = None
    structural_tag: Annotated[dict[str, Any] | str, expects("an object or a JSON string")] | None = Field(
        None, description="an xgrammar structural tag (SGLang's field; the DSL's tool calls send their grammar in it)")
    stop_regex: StopStrings | None = Field(None, description="stop at the earliest match of a regex (or of any of a list)")
    speculative: bool | None = Field(
        None, description="prompt-lookup speculative decoding for this request (same output); null: the server's --speculative"
    )
    # SGLang's names:
    max_new_tokens: int | None = Field(None, ge=0, description="SGLang's max_tokens (0: prefill only)")
    min_new_tokens: int | None = Field(None, ge=0, description="SGLang's min_tokens")
    n: int = Field(1, ge=1, description="samples per prompt (at most the server's --max-n)")
    spaces_between_special_tokens: bool = Field(
        True, description="accepted for SGLang clients; the detokenizer never adds spaces between special tokens"
    )

    def to_sampling_params(self) -> SamplingParams:
        values = self.model_dump(exclude=set(_SGLANG_ONLY))
        for sglang, native in (("max_new_tokens", "max_tokens"), ("min_new_tokens", "min_tokens")):
            if getattr(self, sglang) is None:
                continue
            if native in self.model_fields_set:
                raise bad_request(f"give one of '{native}' and '{sglang}'", param=f"sampling_params.{sglang}")
            values[native] = getattr(self, sglang)
        try:
            return SamplingParams(**values)
        except ValueError as exc:
            raise bad_request(f"sampling_params: {exc}", param="sampling_params") from None


_SGLANG_ONLY = ("max_new_tokens", "min_new_tokens", "n", "spaces_between_special_tokens")


class GenerateRequest(NativeModel):
    """The body of POST /generate."""

    model_config = ConfigDict(json_schema_extra={"examples": [
        {"text": "The capital of France is", "sampling_params": {"max_tokens": 8, "temperature": 0}},
        {"input_ids": [[1, 2, 3], [4, 5]], "sampling_params": {"max_tokens": 2, "logprobs": 0}, "stream": True},
    ]})

    text: Annotated[str | Annotated[list[str], Field(min_length=1)],
                    expects("a string or a non-empty list of strings")] | None = None
    input_ids: Annotated[TokenIds | Annotated[list[TokenIds], Field(min_length=1)],
                         expects("a non-empty list of token ids or of token-id lists")] | None = None
    sampling_params: GenerateSamplingParams | None = None
    stream: bool = False
    cache_salt: str | None = Field(None, description="requests share cached prefixes only with the same salt")
    session_id: SessionId | None = Field(
        None, description="an agent conversation: its latest context is kept ahead of other cached prefixes"
    )
    model: str | None = Field(None, description="checked when given")
    # SGLang's request fields:
    rid: Annotated[NonEmptyString | list[NonEmptyString], expects("a string or a list of strings")] | None = Field(
        None, description="the client's id of each prompt (POST /abort_request {rid} ends the call)"
    )
    return_logprob: bool = False
    logprob_start_len: int = Field(
        -1, ge=-1, description="first prompt position with logprobs; -1: none (all for a prefill-only request)"
    )
    top_logprobs_num: Logprobs = 0
    return_text_in_logprobs: bool = False

    def to_job(self, served: ServedModel) -> NativeJob:
        if self.model is not None:
            served.check_model(self.model)
        prompts, batched = self.prompts()
        served.check_group(len(prompts), 1, "text" if self.text is not None else "input_ids")
        sampling = self.sampling_params or GenerateSamplingParams()
        served.check_n(sampling.n)
        served.check_group(len(prompts), sampling.n, "text" if self.text is not None else "input_ids")
        served.check_seed(sampling.seed, sampling.n)
        served.check_token_ids(sampling.stop_token_ids or [], "sampling_params.stop_token_ids")
        params = self._with_logprobs(sampling.to_sampling_params())
        return NativeJob(
            prompts, params, self.stream, batched, self.cache_salt, n=sampling.n, rids=self._rids(len(prompts)),
            return_logprob=self.return_logprob, return_text_in_logprobs=self.return_text_in_logprobs,
            session_id=self.session_id,
        )

    def _with_logprobs(self, params: SamplingParams) -> SamplingParams:
        """SGLang's return_logprob as SamplingParams' logprobs and prompt logprobs."""
        if not self.return_logprob:
            return params
        if params.logprobs is not None or params.prompt_logprobs is not None:
            raise bad_request(
                "give logprobs either as 'return_logprob' or as sampling_params 'logprobs' / 'prompt_logprobs'",
                param="return_logprob",
            )
        start = self.logprob_start_len
        if start == -1:
            start = 0 if params.prefill_only else None
        k = self.top_logprobs_num
        prompt = {} if start is None else {"prompt_logprobs": k, "prompt_logprobs_start": start}
        try:
            return replace(params, logprobs=k, **prompt)
        except ValueError as exc:
            raise bad_request(str(exc), param="logprob_start_len") from None

    def _rids(self, num_prompts: int) -> list[str] | None:
        if self.rid is None:
            return None
        rids = [self.rid] if isinstance(self.rid, str) else list(self.rid)
        if len(rids) != num_prompts:
            raise bad_request(f"'rid' must give one id per prompt ({num_prompts}), got {len(rids)}", param="rid")
        if len(set(rids)) != len(rids):
            raise bad_request("'rid' holds the same id twice", param="rid")
        return rids

    def prompts(self) -> tuple[list[str | list[int]], bool]:
        if (self.text is None) == (self.input_ids is None):
            raise bad_request("give exactly one of 'text' or 'input_ids'", param="text")
        if isinstance(self.text, str):
            return [self.text], False
        if self.text is not None:
            return list(self.text), True
        if isinstance(self.input_ids[0], int):
            return [list(self.input_ids)], False
        return [list(p) for p in self.input_ids], True
