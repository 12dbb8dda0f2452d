"""Bodies and stream chunks of POST /v1/chat/completions."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from radixserve.outputs import RequestOutput
from radixserve.server.logprob_format import chat_logprobs
from radixserve.server.openai_common import DeltaTracker, finish_reason, now_s, response_id, usage
from radixserve.server.protocol.jobs import GenerationJob
from radixserve.server.request_group import RequestGroup
from radixserve.server.token_text import TokenTexts


class ChatResponder:
    """Turns a job's outputs into "chat.completion" / "chat.completion.chunk" objects."""

    def __init__(self, job: GenerationJob, texts: TokenTexts):
        self.job = job
        self.texts = texts
        self.id = response_id("chatcmpl")
        self.created = now_s()

    def body(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        choices = [
            {
                "index": index,
                "message": {"role": "assistant", "content": output.text},
                "logprobs": self._logprobs(output.logprobs or []),
                "finish_reason": finish_reason(output),
                "stop_reason": output.stop_reason,
            }
            for index, output in enumerate(outputs)
        ]
        return self._object("chat.completion", choices, usage(self.job, outputs))

    async def chunks(self, group: RequestGroup) -> AsyncIterator[dict[str, Any]]:
        """A role chunk per choice, content chunks as outputs arrive, then usage if asked."""
        for index in range(len(group.members)):
            yield self._chunk([self._delta_choice(index, {"role": "assistant", "content": ""}, None, None)])
        trackers = [DeltaTracker() for _ in group.members]
        async for index, output in group.outputs():
            delta = trackers[index].advance(output)
            if not (delta.text or delta.token_ids or output.finished):
                continue
            content = {"content": delta.text} if delta.text else {}
            choice = self._delta_choice(index, content, self._logprobs(delta.logprobs), finish_reason(output))
            yield self._chunk([choice])
        if self.job.include_usage:
            yield self._chunk([], usage(self.job, [m.latest for m in group.members]))

    def _logprobs(self, entries: list) -> dict[str, Any] | None:
        if self.job.logprobs is None:
            return None
        return chat_logprobs(self.texts, entries)

    def _delta_choice(self, index: int, delta: dict, logprobs: dict | None, reason: str | None) -> dict[str, Any]:
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}

    def _chunk(self, choices: list[dict[str, Any]], usage_: dict[str, Any] | None = None) -> dict[str, Any]:
        return self._object("chat.completion.chunk", choices, usage_)

    def _object(self, kind: str, choices: list[dict[str, Any]], usage_: dict[str, Any] | None) -> dict[str, Any]:
        body = {"id": self.id, "object": kind, "created": self.created, "model": self.job.model, "choices": choices}
        if usage_ is not None:
            body["usage"] = usage_
        return body
