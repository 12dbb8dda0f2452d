"""Bodies and stream chunks of POST /v1/chat/completions (tool calls included)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

from radixserve.outputs import RequestOutput
from radixserve.server.logprob_format import chat_logprobs
from radixserve.server.openai_common import DeltaTracker, finish_reason, now_s, response_id, usage
from radixserve.server.protocol.chat import ChatCompletionRequest
from radixserve.server.protocol.common import ServedModel
from radixserve.server.protocol.jobs import GenerationJob
from radixserve.server.request_group import RequestGroup
from radixserve.server.token_text import TokenTexts
from radixserve.server.tools.parser import (
    ArgumentsDelta, CallStarted, ContentDelta, Event, ParsedOutput, ToolCallParser, parse_tool_calls,
)
from radixserve.server.tools.serving import ToolCalling, ToolOutput


async def chat_job(body: ChatCompletionRequest, served: ServedModel, calling: ToolCalling) -> tuple[GenerationJob, ToolOutput | None]:
    """The job of a chat request, and how to read tool calls out of its outputs (None:
    the request has no tools, its text is all content)."""
    # Checking the tools compiles their schemas: off the event loop when there are any.
    spec = await asyncio.to_thread(body.tool_spec) if body.tools else body.tool_spec()
    if not body.uses_tools:
        return body.to_job(served), None
    prompt = await calling.prompt(body.history(), spec)
    job = body.to_job(served, prompt, calling.constraint(spec))
    return job, ToolOutput(spec, calling.fmt) if spec.parses_calls else None


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_finish_reason(output: RequestOutput, num_calls: int) -> str | None:
    reason = finish_reason(output)
    return "tool_calls" if reason == "stop" and num_calls else reason


class ChatResponder:
    """Turns a job's outputs into "chat.completion" / "chat.completion.chunk" objects."""

    def __init__(self, job: GenerationJob, texts: TokenTexts, tools: ToolOutput | None = None):
        self.job = job
        self.texts = texts
        self.tools = tools
        self.id = response_id("chatcmpl")
        self.created = now_s()

    def body(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        choices = []
        for index, output in enumerate(outputs):
            message, reason = self._message(output)
            choices.append({
                "index": index,
                "message": message,
                "logprobs": self._logprobs(output.logprobs or []),
                "finish_reason": reason,
                "stop_reason": output.stop_reason,
            })
        return self._object("chat.completion", choices, usage(self.job, outputs))

    async def chunks(self, group: RequestGroup) -> AsyncIterator[dict[str, Any]]:
        """A role chunk per choice, content (and tool call) chunks as outputs arrive, then usage if asked."""
        for index in range(len(group.members)):
            yield self._chunk([self._delta_choice(index, {"role": "assistant", "content": ""}, None, None)])
        trackers = [DeltaTracker() for _ in group.members]
        streams = [_CallStream(self.tools) if self.tools is not None else None for _ in group.members]
        async for index, output in group.outputs():
            delta = trackers[index].advance(output)
            if not (delta.text or delta.token_ids or output.finished):
                continue
            logprobs = self._logprobs(delta.logprobs)
            if streams[index] is None:
                content = {"content": delta.text} if delta.text else {}
                yield self._chunk([self._delta_choice(index, content, logprobs, finish_reason(output))])
                continue
            for chunk in self._tool_chunks(index, streams[index], delta.text, output, logprobs):
                yield chunk
        if self.job.include_usage:
            yield self._chunk([], usage(self.job, [m.latest for m in group.members]))

    def _message(self, output: RequestOutput) -> tuple[dict[str, Any], str | None]:
        if self.tools is None:
            return {"role": "assistant", "content": output.text}, finish_reason(output)
        parsed: ParsedOutput = parse_tool_calls(output.text, self.tools.fmt, self.tools.spec.names)
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
        if parsed.calls:
            message["tool_calls"] = [
                {"id": call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in parsed.calls
            ]
        return message, tool_finish_reason(output, len(parsed.calls))

    def _tool_chunks(
        self, index: int, stream: "_CallStream", text: str, output: RequestOutput, logprobs: dict | None
    ) -> list[dict[str, Any]]:
        deltas = stream.feed(text, output.finished)
        reason = tool_finish_reason(output, stream.parser.num_calls) if output.finished else None
        if not deltas:
            deltas = [{}] if logprobs is not None or reason is not None else []
        chunks = []
        for i, delta in enumerate(deltas):
            last = i == len(deltas) - 1
            chunks.append(self._chunk([self._delta_choice(
                index, delta, logprobs if i == 0 else None, reason if last else None
            )]))
        return chunks

    def _logprobs(self, entries: list) -> dict[str, Any] | None:
        if self.job.logprobs is None:
            return None
        return chat_logprobs(self.texts, entries)

    def _delta_choice(self, index: int, delta: dict, logprobs: dict | None, reason: str | None) -> dict[str, Any]:
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}

    def _chunk(self, choices: list[dict[str, Any]], usage_: dict[str, Any] | None = None) -> dict[str, Any]:
        chunk = self._object("chat.completion.chunk", choices, usage_)
        if self.job.include_usage and usage_ is None:  # as OpenAI streams them: usage null until the last chunk
            chunk["usage"] = None
        return chunk

    def _object(self, kind: str, choices: list[dict[str, Any]], usage_: dict[str, Any] | None) -> dict[str, Any]:
        body = {"id": self.id, "object": kind, "created": self.created, "model": self.job.model, "choices": choices}
        if usage_ is not None:
            body["usage"] = usage_
        return body


class _CallStream:
    """One choice's parser, its events as chat deltas: a call's id and name first, then
    its argument fragments."""

    def __init__(self, tools: ToolOutput):
        self.parser = ToolCallParser(tools.fmt, tools.spec.names)

    def feed(self, text: str, finished: bool) -> list[dict[str, Any]]:
        events = self.parser.feed(text) if text else []
        if finished:
            events += self.parser.finish()
        return [_delta(e) for e in events]


def _delta(event: Event) -> dict[str, Any]:
    if isinstance(event, ContentDelta):
        return {"content": event.text}
    if isinstance(event, CallStarted):
        call = {"index": event.index, "id": call_id(), "type": "function",
                "function": {"name": event.name, "arguments": ""}}
        return {"tool_calls": [call]}
    assert isinstance(event, ArgumentsDelta)
    return {"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]}
