"""POST /v1/chat/completions: the route, the job a request becomes (tools rendered and
constrained, see radixserve/tools/), and the encoder of each choice's output events as
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
from radixserve.server.errors import bad_request
from radixserve.server.logprob_format import chat_logprobs
from radixserve.server.output.events import (
    CallArguments, CallEnd, CallStart, Event, Finish, OutputEvents, ReasoningDelta, TextDelta,
)
from radixserve.server.output.ids import new_id, now_s
from radixserve.server.output.usage import Usage
from radixserve.server.protocol import ChatCompletionRequest, parse
from radixserve.server.protocol.agent_hints import read_hinted_json
from radixserve.server.protocol.common import ServedModel
from radixserve.server.protocol.jobs import GenerationJob
from radixserve.reasoning.mode import ReasoningMode
from radixserve.server.reasoning import Reasoning, with_reasoning
from radixserve.server.request_group import RequestGroup
from radixserve.server.token_text import TokenTexts
from radixserve.tools.definitions import NO_TOOLS, ToolSpec
from radixserve.tools.parser import ToolCallParser
from radixserve.server.tool_calling import ToolCalling, ToolOutput


def routes() -> list[Route]:
    return [Route("/v1/chat/completions", chat_completions, methods=["POST"])]


async def chat_completions(request: Request) -> Response:
    state = server_state(request)
    body = parse(ChatCompletionRequest, await read_hinted_json(request))
    replies = caller_replies(request, body.cache_salt)
    calling = state.tools.for_template(body.chat_template)  # a request's own template: refused before anything renders it
    reasoning = await chat_reasoning(body, state.reasoning.for_template(body.chat_template))
    job, tools = await chat_job(body, state.served, calling, replies)
    job = in_namespace(request, with_reasoning(job, reasoning))
    return await serve_job(request, job, ChatResponder(job, state.texts, tools, reasoning),
                           on_finish=replies.record if replies is not None else None)


async def chat_job(
    body: ChatCompletionRequest, served: ServedModel, calling: ToolCalling, replies: ReplyLookup | None = None,
) -> tuple[GenerationJob, ToolOutput | None]:
    """The job of a chat request, and how to read tool calls out of its outputs (None:
    the request has no tools, its text is all content). Its prompt is a ChatPrompt that a
    prepare worker builds (the template, the tools' grammar: engine/prompt_builder.py).
    `replies`: the caller's stored reply ids, spliced into the prompt where it re-sends them."""
    calling = calling.for_template(body.chat_template)
    spec = calling.spec(body)
    kwargs = body.template_kwargs() or None
    if body.prompt_token_ids is not None:
        return _given_ids(body, served, calling, spec)
    if not body.uses_tools and calling.template is None:  # plain turns through the model's own template
        job = body.to_job(served)
        return replace(job, prompts=[replace(p, replies=replies, template_kwargs=kwargs) for p in job.prompts]), None
    job = body.to_job(served, calling.prompt(body.history(), spec, replies, kwargs), spec.parses_calls)
    return job, ToolOutput(spec, calling.fmt) if spec.parses_calls else None


async def chat_reasoning(body: ChatCompletionRequest, reasoning: Reasoning) -> ReasoningMode | None:
    """How the request's answer reasons (None: all of it is content)."""
    mode = await reasoning.mode_async(body.template_kwargs(), body.thinking_token_budget)
    if mode is None and body.thinking_token_budget is not None:
        raise bad_request("'thinking_token_budget' needs a model whose reasoning the server reads: start it with "
                          "--reasoning-parser (or a chat template that reasons)", param="thinking_token_budget")
    return mode


def _given_ids(
    body: ChatCompletionRequest, served: ServedModel, calling: ToolCalling, spec: ToolSpec,
) -> tuple[GenerationJob, ToolOutput | None]:
    """The client's prompt ids in place of the rendered messages (a trainer's tokens in, tokens
    out); the request's tools still constrain and parse the answer, its reasoning still splits."""
    spec = spec if body.uses_tools else NO_TOOLS
    job = body.to_job(served, calling.given(list(body.prompt_token_ids), spec), spec.parses_calls)
    return job, ToolOutput(spec, calling.fmt) if spec.parses_calls else None


class ChatResponder:
    """Encodes each choice's output events as a "chat.completion" or "chat.completion.chunk"s."""

    def __init__(
        self, job: GenerationJob, texts: TokenTexts, tools: ToolOutput | None = None, reasoning: ReasoningMode | None = None,
    ):
        self.job = job
        self.texts = texts
        self.tools = tools
        self.reasoning = reasoning  # None: no reasoning block is read
        self.id = new_id("chatcmpl-")
        self.created = now_s()

    def body(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        choices, finishes = [], []
        for index, output in enumerate(outputs):
            events = self._events().whole(output)
            finishes += [e for e in events if isinstance(e, Finish)]
            message, reason = _message(events)
            choices.append({
                "index": index,
                "message": message,
                "logprobs": self._logprobs(output.logprobs or []),
                "finish_reason": reason,
                "stop_reason": output.stop_reason,
            })
        usage = Usage.of_group(len(self.job.prompts), self.job.n, outputs)
        return self._object("chat.completion", choices, self._with_reasoning(usage, finishes))

    async def chunks(self, group: RequestGroup) -> AsyncIterator[dict[str, Any]]:
        """A role chunk per choice, content (and tool call) chunks as outputs arrive, then usage if asked."""
        for index in range(len(group.members)):
            yield self._chunk([self._delta_choice(index, {"role": "assistant", "content": ""}, None, None)])
        streams = [self._events() for _ in group.members]
        finishes: list[Finish] = []
        async for index, output in group.outputs():
            delta = output.delta
            if not (delta.text or delta.token_ids or output.finished):
                continue
            events = streams[index].step(output)
            finishes += [e for e in events if isinstance(e, Finish)]
            for chunk in self._step_chunks(index, events, self._logprobs(delta.logprobs or [])):
                yield chunk
        if self.job.include_usage:
            usage = Usage.of_group(len(self.job.prompts), self.job.n, [m.latest for m in group.members])
            yield self._chunk([], self._with_reasoning(usage, finishes))

    def _events(self) -> OutputEvents:
        parser = ToolCallParser(self.tools.fmt, self.tools.spec.names, self.tools.spec.schemas) if self.tools is not None else None
        return OutputEvents(parser, self.reasoning)

    def _with_reasoning(self, usage: Usage, finishes: list[Finish]) -> Usage:
        """Every choice's reasoning tokens added up (when a reasoning parser reads them)."""
        if self.reasoning is None:
            return usage
        return usage.with_reasoning(sum(f.usage.reasoning_tokens or 0 for f in finishes))

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
    """The whole answer's message: its reasoning, its content (None when it made calls or
    only reasoned, and said nothing) and calls, and its finish reason."""
    content = "".join(e.text for e in events if isinstance(e, TextDelta))
    reasoning = [e.text for e in events if isinstance(e, ReasoningDelta)]
    starts = [e for e in events if isinstance(e, CallStart)]
    ends = [e for e in events if isinstance(e, CallEnd)]
    message: dict[str, Any] = {"role": "assistant", "content": content if content or not (starts or reasoning) else None}
    if reasoning:
        message["reasoning_content"] = "".join(reasoning)
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
    """A chat delta: reasoning, content, a call's id and name, then its argument pieces."""
    if isinstance(event, TextDelta):
        return {"content": event.text}
    if isinstance(event, ReasoningDelta):
        return {"reasoning_content": event.text}
    if isinstance(event, CallStart):
        call = {"index": event.index, "id": "call_" + event.id_hex, "type": "function",
                "function": {"name": event.name, "arguments": ""}}
        return {"tool_calls": [call]}
    if isinstance(event, CallArguments):
        return {"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]}
    return None  # CallEnd, Finish: nothing to send
