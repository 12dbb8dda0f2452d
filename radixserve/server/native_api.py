"""POST /generate: the native endpoint (text or token ids in, text, ids and timings out).

Body: {"text": str | [str], or "input_ids": [int] | [[int]], "sampling_params": {...},
"stream": bool, "cache_salt": str, "model": str (optional; checked when given)}. `sampling_params` takes SamplingParams' fields (its
defaults apply, e.g. max_tokens 16). A list input is a batch answered with a list.
Unknown fields, top-level or in sampling_params, are a 400.

meta_info carries "output_token_logprobs" ([logprob, token_id] per generated token) when
`logprobs` is set, and "input_token_logprobs" ([logprob or null, token_id] per prompt
token, null before `prompt_logprobs_start` and at index 0) when `prompt_logprobs` is set.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from radixserve.outputs import RequestOutput
from radixserve.sampling_params import SamplingParams
from radixserve.server.errors import bad_request
from radixserve.server.fields import Fields
from radixserve.server.openai_requests import ServedModel
from radixserve.server.request_group import GenerationInput, RequestGroup

KNOWN_FIELDS = ("text", "input_ids", "sampling_params", "stream", "cache_salt", "model")


@dataclass(frozen=True)
class NativeJob:
    prompts: list[str | list[int]]
    params: SamplingParams
    stream: bool
    batched: bool  # the input was a list of prompts: answer with a list
    cache_salt: str | None

    def inputs(self) -> list[GenerationInput]:
        return [GenerationInput(p, self.params, self.cache_salt) for p in self.prompts]


def parse_generate_request(body: Any, served: ServedModel) -> NativeJob:
    fields = Fields(body)
    unknown = sorted(set(fields.body) - set(KNOWN_FIELDS))
    if unknown:
        raise bad_request(f"unknown field(s): {', '.join(unknown)}", param=unknown[0])
    if fields.has("model"):
        served.check(fields)
    prompts, batched = _prompts(fields)
    if len(prompts) > served.max_prompts:
        raise bad_request(f"at most {served.max_prompts} prompts per request, got {len(prompts)}")
    params = _params(fields.object("sampling_params"))
    return NativeJob(prompts, params, fields.boolean("stream"), batched, fields.string("cache_salt"))


def result(output: RequestOutput, ttft_s: float | None, e2e_s: float | None) -> dict[str, Any]:
    """One prompt's answer (cumulative while streaming)."""
    meta: dict[str, Any] = {
        "id": output.request_id,
        "prompt_tokens": output.prompt_tokens,
        "completion_tokens": output.completion_tokens,
        "cached_tokens": output.cached_tokens,
        "finish_reason": output.finish_reason,
        "stop_reason": output.stop_reason,
        "ttft_s": ttft_s,
        "e2e_latency_s": e2e_s,
    }
    if output.logprobs is not None:
        meta["output_token_logprobs"] = [[e.logprob, e.token_id] for e in output.logprobs]
    if output.prompt_logprobs is not None:
        meta["input_token_logprobs"] = [
            [e.logprob if e is not None else None, token_id]
            for e, token_id in zip(output.prompt_logprobs, output.prompt_token_ids)
        ]
    return {"text": output.text, "output_ids": output.token_ids, "meta_info": meta}


def final_results(group: RequestGroup, outputs: list[RequestOutput]) -> list[dict[str, Any]]:
    return [_timed_result(group, i, o) for i, o in enumerate(outputs)]


async def stream_results(group: RequestGroup) -> AsyncIterator[dict[str, Any]]:
    """Cumulative results as they grow; with a batch each carries its "index"."""
    async for index, output in group.outputs():
        item = _timed_result(group, index, output)
        if len(group.members) > 1:
            item["index"] = index
        yield item


def _timed_result(group: RequestGroup, index: int, output: RequestOutput) -> dict[str, Any]:
    timing = group.timing(index)
    return result(output, timing.ttft_s, timing.e2e_s if output.finished else None)


def _prompts(fields: Fields) -> tuple[list[str | list[int]], bool]:
    text, ids = fields.raw("text"), fields.raw("input_ids")
    if (text is None) == (ids is None):
        raise bad_request("give exactly one of 'text' or 'input_ids'", param="text")
    if text is not None:
        if isinstance(text, str):
            return [text], False
        if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            return list(text), True
        raise bad_request("'text' must be a string or a non-empty list of strings", param="text")
    if isinstance(ids, list) and ids and all(_is_int(t) for t in ids):
        return [list(ids)], False
    if isinstance(ids, list) and ids and all(isinstance(p, list) and all(_is_int(t) for t in p) for p in ids):
        return [list(p) for p in ids], True
    raise bad_request("'input_ids' must be a non-empty list of token ids or of token-id lists", param="input_ids")


def _params(fields: Fields | None) -> SamplingParams:
    try:
        return SamplingParams.from_dict(dict(fields.body) if fields is not None else {})
    except (TypeError, ValueError) as exc:
        raise bad_request(f"sampling_params: {exc}", param="sampling_params") from None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
