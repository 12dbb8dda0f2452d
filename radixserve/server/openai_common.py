"""Pieces both OpenAI endpoints share: usage, stream deltas, response ids."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from radixserve.outputs import RequestOutput
from radixserve.server.protocol.jobs import GenerationJob


def response_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


def usage(job: GenerationJob, outputs: list[RequestOutput | None]) -> dict[str, Any]:
    """Token counts. Each prompt counts once however many samples it has (sample 0 stands
    for it, cached tokens included); completion tokens add up over every sample."""
    firsts = [outputs[p * job.n] for p in range(len(job.prompts))]
    prompt_tokens = sum(o.prompt_tokens for o in firsts if o is not None)
    cached = sum(o.cached_tokens for o in firsts if o is not None)
    completion = sum(o.completion_tokens for o in outputs if o is not None)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def finish_reason(output: RequestOutput) -> str | None:
    return output.finish_reason if output.finished else None


@dataclass
class Delta:
    text: str
    token_ids: list[int]
    logprobs: list[Any]
    first: bool


class DeltaTracker:
    """What one member has that the client has not been sent yet. Outputs are cumulative;
    a running output's text only grows (a possible stop string is held back)."""

    def __init__(self) -> None:
        self.sent_chars = 0
        self.sent_tokens = 0
        self.started = False

    def advance(self, output: RequestOutput) -> Delta:
        text = output.text[self.sent_chars:]
        token_ids = output.token_ids[self.sent_tokens:]
        logprobs = (output.logprobs or [])[self.sent_tokens:]
        first = not self.started
        self.sent_chars = max(self.sent_chars, len(output.text))
        self.sent_tokens = len(output.token_ids)
        self.started = True
        return Delta(text, token_ids, logprobs, first)
