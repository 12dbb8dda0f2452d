"""The answer of POST /v1/messages: a "message" object, or its stream of events.

One MessageBuilder turns the generated text into content blocks (text, tool_use) for both,
so a stream always assembles to the body. The stream follows Anthropic's sequence:

    message_start, content_block_start, ping, content_block_delta..., content_block_stop,
    (more blocks), message_delta (stop_reason, usage), message_stop

Usage counts as Anthropic's does: `input_tokens` are the prompt tokens computed for this
request, `cache_read_input_tokens` those served from the prefix cache (their sum is the
prompt, what count_tokens reports); the cache is written as a side effect, so
`cache_creation_input_tokens` is 0.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from radixserve.outputs import RequestOutput
from radixserve.server.protocol.jobs import GenerationJob
from radixserve.server.request_group import RequestGroup
from radixserve.server.tools.parser import ArgumentsDelta, CallStarted, ContentDelta, Event, ToolCallParser, text_events

PING = {"type": "ping"}


class MessageBuilder:
    """Content blocks from the text as it grows (`parser` None: all of it is text), and the
    content_block_* events that announce them."""

    def __init__(self, parser: ToolCallParser | None):
        self.parser = parser
        self.blocks: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None
        self._arguments: list[str] = []

    def feed(self, text: str, final: bool) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        for event in text_events(self.parser, text, final):
            events += self._apply(event)
        if final:
            events += self._close()
        return events

    @property
    def num_calls(self) -> int:
        return sum(1 for b in self.blocks if b["type"] == "tool_use")

    def _apply(self, event: Event) -> list[dict[str, Any]]:
        if isinstance(event, ContentDelta):
            events = [] if self._open is not None and self._open["type"] == "text" else (
                self._close() + self._start({"type": "text", "text": ""}))
            self._open["text"] += event.text
            return events + [self._delta({"type": "text_delta", "text": event.text})]
        if isinstance(event, CallStarted):
            block = {"type": "tool_use", "id": tool_use_id(), "name": event.name, "input": {}}
            return self._close() + self._start(block)
        assert isinstance(event, ArgumentsDelta) and self._open is not None
        self._arguments.append(event.text)
        return [self._delta({"type": "input_json_delta", "partial_json": event.text})]

    def _start(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        self.blocks.append(block)
        self._open = block
        self._arguments = []
        return [{"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": dict(block)}]

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta}

    def _close(self) -> list[dict[str, Any]]:
        block, self._open = self._open, None
        if block is None:
            return []
        if block["type"] == "tool_use":
            block["input"] = _arguments_object("".join(self._arguments))
        return [{"type": "content_block_stop", "index": self.blocks.index(block)}]


class MessagesResponder:
    """Builds the "message" object, and its events, from the job's one engine request."""

    def __init__(self, job: GenerationJob, parser: ToolCallParser | None, stop_sequences: list[str]):
        self.job = job
        self.parser = parser
        self.stop_sequences = stop_sequences
        self.id = f"msg_{uuid.uuid4().hex[:24]}"

    def body(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        output = outputs[0]
        builder = MessageBuilder(self.parser)
        builder.feed(output.text, final=True)
        return {**self._message(builder.blocks, output), **self._stop(output, builder)}

    async def chunks(self, group: RequestGroup) -> AsyncIterator[dict[str, Any]]:
        builder = MessageBuilder(self.parser)
        sent, started, pinged = 0, False, False
        async for _, output in group.outputs():
            if not started:  # the first output: the prompt's usage is known
                started = True
                yield {"type": "message_start", "message": {
                    **self._message([], output), "stop_reason": None, "stop_sequence": None}}
            events = builder.feed(output.text[sent:], final=output.finished)
            sent = max(sent, len(output.text))
            for event in events:
                yield event
                if not pinged and event["type"] == "content_block_start":
                    yield PING
                    pinged = True
            if output.finished:
                if not pinged:
                    yield PING
                    pinged = True
                yield {"type": "message_delta", "delta": self._stop(output, builder), "usage": usage(output)}
                yield {"type": "message_stop"}

    def _message(self, blocks: list[dict[str, Any]], output: RequestOutput) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.job.model,
                "content": blocks, "usage": usage(output)}

    def _stop(self, output: RequestOutput, builder: MessageBuilder) -> dict[str, Any]:
        """stop_reason and stop_sequence."""
        if output.finish_reason == "length":
            return {"stop_reason": "max_tokens", "stop_sequence": None}
        if builder.num_calls:
            return {"stop_reason": "tool_use", "stop_sequence": None}
        if isinstance(output.stop_reason, str) and output.stop_reason in self.stop_sequences:
            return {"stop_reason": "stop_sequence", "stop_sequence": output.stop_reason}
        return {"stop_reason": "end_turn", "stop_sequence": None}


def usage(output: RequestOutput) -> dict[str, Any]:
    return {
        "input_tokens": output.prompt_tokens - output.cached_tokens,
        "output_tokens": output.completion_tokens,
        "cache_read_input_tokens": output.cached_tokens,
        "cache_creation_input_tokens": 0,
    }


def tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


def _arguments_object(text: str) -> dict[str, Any]:
    """A call's input. Only a call cut short by max_tokens has arguments that do not parse:
    its input is then {} (its streamed input_json_delta fragments still hold what was generated)."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return {}
    return value if isinstance(value, dict) else {}
