"""OutputEvents: one engine request's answer as typed events, built once from the engine
loop's per-step deltas (RequestOutput.delta): text, reasoning (read by a reasoning parser,
reasoning/, ahead of the tool-call parser, which sees only the content), tool calls
(start with their id, argument pieces, end with the whole arguments) and the finish with usage. The streamed and
the whole answer come from the same events, so a stream always assembles to the body."""

from __future__ import annotations

from dataclasses import dataclass

from radixserve.outputs import RequestOutput
from radixserve.server.output.ids import call_hex
from radixserve.server.output.usage import Usage
from radixserve.reasoning.base import Piece
from radixserve.reasoning.mode import ReasoningMode
from radixserve.tools.parser import ArgumentsDelta, CallStarted, ContentDelta, ToolCallParser, text_events


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class ReasoningDelta:
    text: str  # the next piece of the reasoning block's text (its markers left out)


@dataclass(frozen=True)
class CallStart:
    index: int  # calls count from 0 in each answer
    id_hex: str  # the call's id, less the API's prefix (call_, toolu_)
    name: str


@dataclass(frozen=True)
class CallArguments:
    index: int
    text: str  # the next piece of the arguments' JSON text


@dataclass(frozen=True)
class CallEnd:
    index: int
    arguments: str  # all of them (partial JSON when max_tokens cut the call short)


@dataclass(frozen=True)
class Finish:
    reason: str | None  # the engine's: stop, length or abort
    stop_reason: str | int | None  # the stop string or token id that ended it
    num_calls: int
    usage: Usage


Event = TextDelta | ReasoningDelta | CallStart | CallArguments | CallEnd | Finish


class OutputEvents:
    """Feed one engine request's outputs in order (`parser` None: all text is content;
    `reasoning` None: no reasoning block is read)."""

    def __init__(self, parser: ToolCallParser | None, reasoning: ReasoningMode | None = None):
        self.parser = parser
        self.reasoning = reasoning
        self._splitter = reasoning.splitter() if reasoning is not None else None
        self.num_calls = 0
        self._open: int | None = None  # the call whose arguments may still grow
        self._arguments: list[str] = []

    def step(self, output: RequestOutput) -> list[Event]:
        """The events of what this output adds (its delta)."""
        assert output.delta is not None, "the engine builds every output with its delta (Engine.step)"
        return self._events(output.delta.text, output)

    def whole(self, output: RequestOutput) -> list[Event]:
        """The events of a whole (final) output at once."""
        return self._events(output.text, output)

    def _events(self, text: str, output: RequestOutput) -> list[Event]:
        events: list[Event] = []
        for piece in self._pieces(text, output.finished):
            if piece.reasoning:
                events.append(ReasoningDelta(piece.text))
            else:
                events += self._content(piece.text, False)
        if output.finished:
            events += self._content("", True)
            events.append(Finish(output.finish_reason, output.stop_reason, self.num_calls, self._usage(output)))
        return events

    def _pieces(self, text: str, final: bool) -> list[Piece]:
        if self._splitter is None:
            return [Piece(False, text)] if text else []
        pieces = self._splitter.feed(text) if text else []
        return pieces + self._splitter.finish() if final else pieces

    def _usage(self, output: RequestOutput) -> Usage:
        usage = Usage.of(output)
        if self._splitter is None:
            return usage
        return usage.with_reasoning(self.reasoning.count_tokens(self._splitter.spans, output.token_ids))

    def _content(self, text: str, final: bool) -> list[Event]:
        """The events of content text: the tool-call parser reads it (and only it)."""
        events: list[Event] = []
        for event in text_events(self.parser, text, final):
            if isinstance(event, ArgumentsDelta):
                self._arguments.append(event.text)
                events.append(CallArguments(event.index, event.text))
                continue
            events += self._end_call()  # a call ends where content or the next call begins
            if isinstance(event, ContentDelta):
                events.append(TextDelta(event.text))
            else:
                assert isinstance(event, CallStarted)
                self._open, self._arguments = event.index, []
                self.num_calls += 1
                events.append(CallStart(event.index, call_hex(), event.name))
        if final:
            events += self._end_call()
        return events

    def _end_call(self) -> list[Event]:
        if self._open is None:
            return []
        index, self._open = self._open, None
        return [CallEnd(index, "".join(self._arguments))]
