"""The answer of POST /v1/messages: a "message" object, or its stream of events.

One MessageBuilder turns the answer's output events (server/output/events.py) into content
blocks (text, tool_use) for both, so a stream always assembles to the body. The stream follows Anthropic's sequence:

    message_start, content_block_start, ping, content_block_delta..., content_block_stop,
    (more blocks), message_delta (stop_reason, usage), message_stop

Usage counts as Anthropic's does: `input_tokens` are the prompt tokens computed for this
request, `cache_read_input_tokens` those served from the prefix cache (their sum is the
prompt, what count_tokens reports); the cache is written as a side effect, so
`cache_creation_input_tokens` is 0.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from radixserve.outputs import RequestOutput
from radixserve.server.output.events import CallArguments, CallEnd, CallStart, Event, Finish, OutputEvents, TextDelta
from radixserve.server.output.ids import new_id
from radixserve.server.output.usage import Usage
from radixserve.server.protocol.jobs import GenerationJob
from radixserve.server.request_group import RequestGroup
from radixserve.server.tools.parser import ToolCallParser

PING = {"type": "ping"}


class MessageBuilder:
    """Content blocks (text, tool_use) from one answer's events, and the content_block_*
    events that announce them."""

    def __init__(self) -> None:
        self.blocks: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None
        self.finish: Finish | None = None

    def apply(self, events: list[Event]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for event in events:
            out += self._apply(event)
        return out

    def _apply(self, event: Event) -> list[dict[str, Any]]:
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
        self.finish = event
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

    def __init__(self, job: GenerationJob, parser: ToolCallParser | None, stop_sequences: list[str]):
        self.job = job
        self.parser = parser
        self.stop_sequences = stop_sequences
        self.id = new_id("msg_", 24)

    def body(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        output = outputs[0]
        builder = MessageBuilder()
        builder.apply(OutputEvents(self.parser).whole(output))
        return {**self._message(builder.blocks, output), **self._stop(builder.finish)}

    async def chunks(self, group: RequestGroup) -> AsyncIterator[dict[str, Any]]:
        builder, events = MessageBuilder(), OutputEvents(self.parser)
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
                       "usage": builder.finish.usage.anthropic()}
                yield {"type": "message_stop"}

    def _message(self, blocks: list[dict[str, Any]], output: RequestOutput) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.job.model,
                "content": blocks, "usage": Usage.of(output).anthropic()}

    def _stop(self, finish: Finish | None) -> dict[str, Any]:
        """stop_reason and stop_sequence."""
        if finish is not None and finish.reason == "length":
            return {"stop_reason": "max_tokens", "stop_sequence": None}
        if finish is not None and finish.num_calls:
            return {"stop_reason": "tool_use", "stop_sequence": None}
        if finish is not None and isinstance(finish.stop_reason, str) and finish.stop_reason in self.stop_sequences:
            return {"stop_reason": "stop_sequence", "stop_sequence": finish.stop_reason}
        return {"stop_reason": "end_turn", "stop_sequence": None}


def _arguments_object(text: str) -> dict[str, Any]:
    """A call's input. Only a call cut short by max_tokens has arguments that do not parse:
    its input is then {} (its streamed input_json_delta fragments still hold what was generated)."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return {}
    return value if isinstance(value, dict) else {}
