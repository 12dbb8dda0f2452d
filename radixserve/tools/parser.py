"""ToolCallParser: generated text -> content and tool calls, incrementally or all at once.

Each call format (tools/formats/) brings its own machine; this is the seam the APIs
use. One left-to-right machine serves both the streamed and the complete answer, so the
deltas of a stream always assemble to exactly what `parse_tool_calls` returns for the same
text. A call is recognised once its header (its name, a declared tool) is complete; its
arguments are JSON text that grows as the call is generated (cut short when max_tokens cut
the call). Anything that does not fit stays content; a parser never raises.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class CallStarted:
    index: int
    name: str


@dataclass(frozen=True)
class ArgumentsDelta:
    index: int
    text: str


Event = ContentDelta | CallStarted | ArgumentsDelta


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text as generated (partial if the output was cut short)


@dataclass(frozen=True)
class ParsedOutput:
    """`content` is None when the output held calls and nothing else but whitespace."""

    content: str | None
    calls: list[ParsedCall] = field(default_factory=list)


class CallParser(Protocol):
    """What a format's machine offers: feed text, finish, the result so far."""

    def feed(self, text: str) -> list[Event]: ...

    def finish(self) -> list[Event]: ...

    def result(self) -> ParsedOutput: ...

    @property
    def num_calls(self) -> int: ...


Schemas = Mapping[str, Mapping[str, Any]]  # tool name -> its parameters' JSON schema


class MakesParsers(Protocol):
    """A call format (ToolCallFormat), as far as parsing goes."""

    def parser(self, allowed: set[str] | None, schemas: Schemas) -> CallParser: ...


class ToolCallParser:
    """Feed text as it is generated; each call returns the events that became certain.

    `allowed`: the declared tool names (a call to any other name stays content); None
    accepts every name. `schemas`: the tools' parameter schemas, for formats whose values
    are typed by them (qwen3_coder)."""

    def __init__(self, fmt: MakesParsers, allowed: Collection[str] | None = None, schemas: Schemas | None = None):
        self.fmt = fmt
        self._machine = fmt.parser(set(allowed) if allowed is not None else None, dict(schemas or {}))

    def feed(self, text: str) -> list[Event]:
        return self._machine.feed(text)

    def finish(self) -> list[Event]:
        """The end of the output: whatever was held back settles."""
        return self._machine.finish()

    def result(self) -> ParsedOutput:
        return self._machine.result()

    @property
    def num_calls(self) -> int:
        return self._machine.num_calls


def parse_tool_calls(
    text: str, fmt: MakesParsers, allowed: Collection[str] | None = None, schemas: Schemas | None = None
) -> ParsedOutput:
    """The complete output's content and calls (what a stream of the same text assembles to)."""
    parser = ToolCallParser(fmt, allowed, schemas)
    parser.feed(text)
    parser.finish()
    return parser.result()


def text_events(parser: ToolCallParser | None, text: str, final: bool) -> list[Event]:
    """The events of the next piece of generated text (`parser` None: all of it is content);
    with `final`, the parser's last events too."""
    if parser is None:
        return [ContentDelta(text)] if text else []
    parsed = parser.feed(text) if text else []
    return parsed + parser.finish() if final else parsed
