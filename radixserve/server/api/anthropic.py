"""Anthropic's Messages API, a third spelling of the chat path: POST /v1/messages and
POST /v1/messages/count_tokens (see radixserve/server/protocol/anthropic.py for the
fields). The conversation renders through the same ToolCalling as chat completions, tool
calls are constrained by the same grammar and read back by the same parser, so a
conversation renders to the same tokens whichever API sent it (and hits the same cache).

The answer, a "message" object or its stream of events: one MessageBuilder turns the answer's
output events (server/output/events.py) into content blocks (thinking, text, tool_use) for
both, so a stream always assembles to the body. `thinking` enabled renders the template with
enable_thinking and bounds the reasoning by budget_tokens (the end marker is forced once
they are spent, reasoning/mode.py); disabled renders it with enable_thinking false.
The stream follows Anthropic's sequence, framed as Anthropic's API frames it (`event: <type>`
then `data: <json>`, an error as `event: error`, no closing [DONE]):

    message_start, content_block_start, ping, content_block_delta..., content_block_stop,
    (more blocks), message_delta (stop_reason, usage), message_stop

Usage counts as Anthropic's does: `cache_read_input_tokens` are the prompt tokens served
from the prefix cache, `cache_creation_input_tokens` those computed here and written to it
(whole blocks, output/usage.py), `input_tokens` the rest; the three add up to the prompt,
what count_tokens reports. `cache_control` marks pin the prefixes they end for their TTL
(anthropic_pins.py).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from radixserve.outputs import RequestOutput
from radixserve.engine.prompt_builder import ChatPrompt
from radixserve.engine.reply_ids import ReplyLookup
from radixserve.request_error import InvalidRequest
from radixserve.server.api.anthropic_pins import Pin, chained, marked_prefixes, pin_hook
from radixserve.server.api.serving import caller_replies, in_namespace, serve_job, server_state
from radixserve.server.errors import APIError, anthropic_error_body, bad_request, template_error
from radixserve.server.output.encoder import BlockEncoder
from radixserve.server.output.events import (
    CallArguments, CallEnd, CallStart, Event, Finish, OutputEvents, ReasoningDelta, TextDelta,
)
from radixserve.server.output.ids import new_id
from radixserve.server.output.usage import Usage
from radixserve.server.protocol.anthropic import Conversation, CountTokensRequest, MessagesRequest, parse
from radixserve.server.protocol.agent_hints import read_hinted_json
from radixserve.server.protocol.body import read_json
from radixserve.server.protocol.common import ServedModel
from radixserve.server.protocol.jobs import GenerationJob
from radixserve.reasoning.mode import ReasoningMode
from radixserve.server.reasoning import Reasoning, with_reasoning
from radixserve.server.request_group import RequestGroup
from radixserve.server.sse import EventStream
from radixserve.tools.definitions import ToolSpec
from radixserve.tools.history import HistoryMessage
from radixserve.tools.parser import ToolCallParser
from radixserve.server.tool_calling import ToolCalling

PING = {"type": "ping"}


def routes() -> list[Route]:
    return [
        Route("/v1/messages", messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", count_tokens_route, methods=["POST"]),
    ]


async def messages(request: Request) -> Response:
    state = server_state(request)
    engine = state.engine.engine
    block = engine.config.block_size if engine.config.enable_prefix_cache else None
    replies = caller_replies(request, None)
    job, responder = await messages_job(await read_hinted_json(request), state.served, state.tools, state.reasoning,
                                        block, engine, replies)
    job = in_namespace(request, job)
    pins = pin_hook(responder.pins, job.cache_salt, state.cache_pins)
    return await serve_job(request, job, responder, AnthropicEventStream,
                           on_finish=chained(pins, replies.record if replies is not None else None))


async def count_tokens_route(request: Request) -> Response:
    state = server_state(request)
    counted = await count_tokens(await read_json(request), state.served, state.tools, state.engine.engine,
                                 caller_replies(request, None))
    return JSONResponse(counted)


async def messages_job(
    body: Any, served: ServedModel, calling: ToolCalling, reasoning: Reasoning | None = None,
    cache_block: int | None = None, engine: Any = None, replies: ReplyLookup | None = None,
) -> tuple[GenerationJob, MessagesResponder]:
    """The engine job of a /v1/messages body and the responder that answers it.
    `reasoning`: the server's reasoning parser; `cache_block`: the prefix cache's block size
    (None: no prefix cache); `engine`: renders the prefixes cache_control marks (None: no pins);
    `replies`: the caller's stored reply ids, spliced where the conversation re-sends them."""
    request: MessagesRequest = parse(MessagesRequest, body)
    request.check_continuable()
    kwargs = request.template_kwargs()
    mode = await _reasoning_mode(request, reasoning, kwargs)
    spec, prompt = _prompt(request, calling, kwargs, replies)
    job = with_reasoning(request.to_job(served, prompt), mode)
    parser = ToolCallParser(calling.fmt, spec.names, spec.schemas) if spec.parses_calls else None
    pins = []
    if engine is not None and cache_block is not None:
        render = lambda history: _conversation_prompt(request, history, spec, calling, kwargs, replies)  # noqa: E731
        pins = await marked_prefixes(request.cache_marks(), render, engine)
    return job, MessagesResponder(job, parser, list(request.stop_sequences or []), mode, cache_block, pins)


async def _reasoning_mode(
    request: MessagesRequest, reasoning: Reasoning | None, kwargs: dict[str, Any],
) -> ReasoningMode | None:
    """How the answer reasons; thinking enabled needs a reasoning parser and a budget below max_tokens."""
    mode = await reasoning.mode_async(kwargs, request.thinking_budget) if reasoning is not None else None
    budget = request.thinking_budget
    if budget is not None and mode is None:
        raise bad_request("'thinking' needs a model whose reasoning the server reads: start it with "
                          "--reasoning-parser (or a chat template that reasons)", param="thinking")
    if budget is not None and budget >= request.max_tokens:
        raise bad_request(f"'thinking.budget_tokens' ({budget}) must be less than max_tokens ({request.max_tokens})",
                          param="thinking.budget_tokens")
    return mode


async def count_tokens(
    body: Any, served: ServedModel, calling: ToolCalling, engine: Any, replies: ReplyLookup | None = None,
) -> dict[str, Any]:
    """{"input_tokens": n}: the prompt a /v1/messages request with this conversation would have."""
    request: CountTokensRequest = parse(CountTokensRequest, body)
    served.check_model(request.model)
    kwargs = request.template_kwargs()
    _, prompt = _prompt(request, calling, kwargs, replies)
    try:
        built = await asyncio.to_thread(engine.build_prompt, prompt)  # one hop, as a prepare worker builds it
    except InvalidRequest:
        raise
    except Exception as exc:
        if (refused := template_error(exc)) is not None:
            raise refused from None
        raise
    return {"input_tokens": len(built.token_ids)}


def _prompt(
    request: Conversation, calling: ToolCalling, kwargs: dict[str, Any], replies: ReplyLookup | None = None,
) -> tuple[ToolSpec, ChatPrompt]:
    """As chat completions builds it: plain role/content turns without tools, else the
    tool-aware rendering (which checks that every result answers an earlier call)."""
    request.check_supported()
    spec = calling.spec(request)
    return spec, _conversation_prompt(request, request.history(), spec, calling, kwargs, replies)


def _conversation_prompt(
    request: Conversation, history: list[HistoryMessage], spec: ToolSpec, calling: ToolCalling, kwargs: dict[str, Any],
    replies: ReplyLookup | None = None,
) -> ChatPrompt:
    if not request.uses_tools and calling.template is None:  # --chat-template: the tool-aware rendering
        return ChatPrompt(tuple(_plain_turn(m) for m in history), replies=replies, template_kwargs=kwargs or None)
    return calling.prompt(history, spec, replies, kwargs or None)


def _plain_turn(message: HistoryMessage) -> dict[str, Any]:
    """A turn without tools for the template: role and content, and an assistant's thinking
    sent back as its reasoning_content."""
    turn: dict[str, Any] = {"role": message.role, "content": message.content or ""}
    if message.reasoning is not None:
        turn["reasoning_content"] = message.reasoning
    return turn


# ---- the answer --------------------------------------------------------------------------


class MessageBuilder(BlockEncoder):
    """Content blocks (text, tool_use) from one answer's events, and the content_block_*
    events that announce them."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks: list[dict[str, Any]] = []

    def _apply(self, event: Event) -> list[dict[str, Any]]:
        if isinstance(event, ReasoningDelta):
            events = [] if self._open is not None and self._open["type"] == "thinking" else (
                self._close() + self._start({"type": "thinking", "thinking": "", "signature": ""}))
            self._open["thinking"] += event.text
            return events + [self._delta({"type": "thinking_delta", "thinking": event.text})]
        if isinstance(event, TextDelta):
            events = [] if self._open is not None and self._open["type"] == "text" else (
                self._close() + self._start({"type": "text", "text": ""}))
            self._open["text"] += event.text
            return events + [self._delta({"type": "text_delta", "text": event.text})]
        if isinstance(event, CallStart):
            block = {"type": "tool_use", "id": "toolu_" + event.id_hex, "name": event.name, "input": {}}
            return self._close() + self._start(block)
        if isinstance(event, CallArguments):
            return [self._delta({"type": "input_json_delta", "partial_json": event.text})]
        if isinstance(event, CallEnd):
            self._open["input"] = _arguments_object(event.arguments)
            return self._close()
        assert isinstance(event, Finish)
        return self._close()

    def _start(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        self.blocks.append(block)
        self._open = block
        return [{"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": dict(block)}]

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta}

    def _close(self) -> list[dict[str, Any]]:
        block, self._open = self._open, None
        if block is None:
            return []
        return [{"type": "content_block_stop", "index": self.blocks.index(block)}]


class MessagesResponder:
    """Encodes the events of the job's one engine request as a "message" object, or its events."""

    def __init__(
        self, job: GenerationJob, parser: ToolCallParser | None, stop_sequences: list[str],
        reasoning: ReasoningMode | None = None, cache_block: int | None = None, pins: list[Pin] | None = None,
    ):
        self.job = job
        self.parser = parser
        self.stop_sequences = stop_sequences
        self.reasoning = reasoning  # None: no thinking blocks are read
        self.cache_block = cache_block  # the prefix cache's block size (None: no prefix cache)
        self.pins = pins or []  # what cache_control marks: pinned once the request finishes
        self.id = new_id("msg_", 24)

    def body(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        output = outputs[0]
        builder = MessageBuilder()
        builder.apply(OutputEvents(self.parser, self.reasoning).whole(output))
        return {**self._message(builder.blocks, output), **self._stop(builder.finish)}

    async def chunks(self, group: RequestGroup) -> AsyncIterator[dict[str, Any]]:
        builder, events = MessageBuilder(), OutputEvents(self.parser, self.reasoning)
        started, pinged = False, False
        async for _, output in group.outputs():
            if not started:  # the first output: the prompt's usage is known
                started = True
                yield {"type": "message_start", "message": {
                    **self._message([], output), "stop_reason": None, "stop_sequence": None}}
            for event in builder.apply(events.step(output)):
                yield event
                if not pinged and event["type"] == "content_block_start":
                    yield PING
                    pinged = True
            if builder.finish is not None:
                if not pinged:
                    yield PING
                    pinged = True
                yield {"type": "message_delta", "delta": self._stop(builder.finish),
                       "usage": builder.finish.usage.anthropic(self.cache_block)}
                yield {"type": "message_stop"}

    def _message(self, blocks: list[dict[str, Any]], output: RequestOutput) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.job.model,
                "content": blocks, "usage": Usage.of(output).anthropic(self.cache_block)}

    def _stop(self, finish: Finish | None) -> dict[str, Any]:
        """stop_reason and stop_sequence."""
        if finish is not None and finish.reason == "length":
            return {"stop_reason": "max_tokens", "stop_sequence": None}
        if finish is not None and finish.num_calls:
            return {"stop_reason": "tool_use", "stop_sequence": None}
        if finish is not None and isinstance(finish.stop_reason, str) and finish.stop_reason in self.stop_sequences:
            return {"stop_reason": "stop_sequence", "stop_sequence": finish.stop_reason}
        return {"stop_reason": "end_turn", "stop_sequence": None}



class AnthropicEventStream(EventStream):
    end = b""

    def frame(self, payload: dict[str, Any]) -> bytes:
        data = json.dumps(payload, ensure_ascii=False)
        return f"event: {payload['type']}\ndata: {data}\n\n".encode("utf-8")

    def error_frame(self, error: APIError) -> bytes:
        return self.frame(anthropic_error_body(error))


def _arguments_object(text: str) -> dict[str, Any]:
    """A call's input. Only a call cut short by max_tokens has arguments that do not parse:
    its input is then {} (its streamed input_json_delta fragments still hold what was generated)."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return {}
    return value if isinstance(value, dict) else {}
