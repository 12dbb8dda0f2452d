"""POST /v1/chat/completions: the route, the job a request becomes (tools rendered and
constrained, see radixserve/server/tools/), and the encoder of each choice's output events as
a "chat.completion" or "chat.completion.chunk"s (the body: protocol/chat.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from radixserve.outputs import RequestOutput
from radixserve.engine.reply_ids import ReplyLookup
from radixserve.server.api.serving import caller_replies, in_namespace, serve_job, server_state
from radixserve.server.logprob_format import chat_logprobs
from radixserve.server.output.events import CallArguments, CallEnd, CallStart, Event, Finish, OutputEvents, TextDelta
from radixserve.server.output.ids import new_id, now_s
from radixserve.server.output.usage import Usage
from radixserve.server.protocol import ChatCompletionRequest, parse
from radixserve.server.protocol.agent_hints import read_hinted_json
from radixserve.server.protocol.common import ServedModel
from radixserve.server.protocol.jobs import GenerationJob
from radixserve.server.request_group import ChatPrompt, RequestGroup
from radixserve.server.token_text import TokenTexts
from radixserve.server.tools.parser import ToolCallParser
from radixserve.server.tools.serving import ToolCalling, ToolOutput


def routes() -> list[Route]:
    return [Route("/v1/chat/completions", chat_completions, methods=["POST"])]


async def chat_completions(request: Request) -> Response:
    state = server_state(request)
    body = parse(ChatCompletionRequest, await read_hinted_json(request))
    replies = caller_replies(request, body.cache_salt)
    job, tools = await chat_job(body, state.served, state.tools, replies)
    job = in_namespace(request, job)
    return await serve_job(request, job, ChatResponder(job, state.texts, tools),
                           on_finish=replies.record if replies is not None else None)


async def chat_job(
    body: ChatCompletionRequest, served: ServedModel, calling: ToolCalling, replies: ReplyLookup | None = None,
) -> tuple[GenerationJob, ToolOutput | None]:
    """The job of a chat request, and how to read tool calls out of its outputs (None:
    the request has no tools, its text is all content). `replies`: the caller's stored
    reply ids, spliced into the prompt where it re-sends them."""
    spec = await calling.spec(body)
    if not body.uses_tools:
        return _with_replies(body.to_job(served), replies), None
    prompt = await calling.prompt(body.history(), spec, replies)
    job = body.to_job(served, prompt, calling.constraint(spec))
    return job, ToolOutput(spec, calling.fmt) if spec.parses_calls else None


def _with_replies(job: GenerationJob, replies: ReplyLookup | None) -> GenerationJob:
    prompts = [ChatPrompt(p.messages, replies) if isinstance(p, ChatPrompt) else p for p in job.prompts]
    return replace(job, prompts=prompts)


class ChatResponder:
    """Encodes each choice's output events as a "chat.completion" or "chat.completion.chunk"s."""

    def __init__(self, job: GenerationJob, texts: TokenTexts, tools: ToolOutput | None = None):
        self.job = job
        self.texts = texts
        self.tools = tools
        self.id = new_id("chatcmpl-")
        self.created = now_s()

    def body(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        choices = []
        for index, output in enumerate(outputs):
            message, reason = _message(self._events().whole(output))
            choices.append({
                "index": index,
                "message": message,
                "logprobs": self._logprobs(output.logprobs or []),
                "finish_reason": reason,
                "stop_reason": output.stop_reason,
            })
        return self._object("chat.completion", choices, Usage.of_group(len(self.job.prompts), self.job.n, outputs))

    async def chunks(self, group: RequestGroup) -> AsyncIterator[dict[str, Any]]:
        """A role chunk per choice, content (and tool call) chunks as outputs arrive, then usage if asked."""
        for index in range(len(group.members)):
            yield self._chunk([self._delta_choice(index, {"role": "assistant", "content": ""}, None, None)])
        streams = [self._events() for _ in group.members]
        async for index, output in group.outputs():
            delta = output.delta
            if not (delta.text or delta.token_ids or output.finished):
                continue
            for chunk in self._step_chunks(index, streams[index].step(output), self._logprobs(delta.logprobs or [])):
                yield chunk
        if self.job.include_usage:
            yield self._chunk([], Usage.of_group(len(self.job.prompts), self.job.n, [m.latest for m in group.members]))

    def _events(self) -> OutputEvents:
        return OutputEvents(ToolCallParser(self.tools.fmt, self.tools.spec.names) if self.tools is not None else None)

    def _step_chunks(self, index: int, events: list[Event], logprobs: dict | None) -> list[dict[str, Any]]:
        """One chunk per delta of a step: its logprobs on the first, the finish reason on the last."""
        finish = events[-1] if events and isinstance(events[-1], Finish) else None
        reason = _finish_reason(finish) if finish is not None else None
        deltas = [d for d in map(_delta, events) if d is not None]
        if not deltas and (self.tools is None or logprobs is not None or reason is not None):
            deltas = [{}]
        return [
            self._chunk([self._delta_choice(index, delta, logprobs if i == 0 else None,
                                            reason if i == len(deltas) - 1 else None)])
            for i, delta in enumerate(deltas)
        ]

    def _logprobs(self, entries: list) -> dict[str, Any] | None:
        if self.job.logprobs is None:
            return None
        return chat_logprobs(self.texts, entries)

    def _delta_choice(self, index: int, delta: dict, logprobs: dict | None, reason: str | None) -> dict[str, Any]:
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}

    def _chunk(self, choices: list[dict[str, Any]], usage: Usage | None = None) -> dict[str, Any]:
        chunk = self._object("chat.completion.chunk", choices, usage)
        if self.job.include_usage and usage is None:  # as OpenAI streams them: usage null until the last chunk
            chunk["usage"] = None
        return chunk

    def _object(self, kind: str, choices: list[dict[str, Any]], usage: Usage | None) -> dict[str, Any]:
        body = {"id": self.id, "object": kind, "created": self.created, "model": self.job.model, "choices": choices}
        if usage is not None:
            body["usage"] = usage.openai()
        return body


def _message(events: list[Event]) -> tuple[dict[str, Any], str | None]:
    """The whole answer's message: its content (None when it made calls and said nothing)
    and calls, and its finish reason."""
    content = "".join(e.text for e in events if isinstance(e, TextDelta))
    starts = [e for e in events if isinstance(e, CallStart)]
    ends = [e for e in events if isinstance(e, CallEnd)]
    message: dict[str, Any] = {"role": "assistant", "content": content if content or not starts else None}
    if starts:
        message["tool_calls"] = [
            {"id": "call_" + s.id_hex, "type": "function", "function": {"name": s.name, "arguments": e.arguments}}
            for s, e in zip(starts, ends)
        ]
    finish = events[-1] if events and isinstance(events[-1], Finish) else None
    return message, _finish_reason(finish) if finish is not None else None


def _finish_reason(finish: Finish) -> str | None:
    return "tool_calls" if finish.reason == "stop" and finish.num_calls else finish.reason


def _delta(event: Event) -> dict[str, Any] | None:
    """A chat delta: content, a call's id and name, then its argument pieces."""
    if isinstance(event, TextDelta):
        return {"content": event.text}
    if isinstance(event, CallStart):
        call = {"index": event.index, "id": "call_" + event.id_hex, "type": "function",
                "function": {"name": event.name, "arguments": ""}}
        return {"tool_calls": [call]}
    if isinstance(event, CallArguments):
        return {"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]}
    return None  # CallEnd, Finish: nothing to send
