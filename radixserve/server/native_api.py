"""POST /generate, the native endpoint: its answers (the body is protocol/generate.py).

An answer is {"text", "output_ids", "meta_info"} per prompt (a list for a batch).
meta_info carries "output_token_logprobs" ([logprob, token_id] per generated token) when
`logprobs` is set, and "input_token_logprobs" ([logprob or null, token_id] per prompt
token, null before `prompt_logprobs_start` and at index 0) when `prompt_logprobs` is set.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from radixserve.outputs import RequestOutput
from radixserve.server.request_group import RequestGroup


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
