"""ScanParser: a format's machine built from a pure scan of the text so far.

A scanner reads the whole text generated so far and returns its pieces (content, and calls
with their arguments as JSON text) as far as they are certain; with `final` it reads all
of it. On every feed the parser scans again and sends what grew. This holds as long as each
scanner keeps its invariant:

    the pieces of a text are the pieces of any longer text, but for the last piece,
    whose text (content, or a call's arguments) may still grow

(ambiguous text, such as the start of a marker, is held back until it is decided). Outputs
are short, so scanning again costs little next to generating them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from radixserve.tools.parser import ArgumentsDelta, CallStarted, ContentDelta, Event, ParsedCall, ParsedOutput


@dataclass(frozen=True)
class Text:
    text: str


@dataclass(frozen=True)
class Call:
    name: str
    arguments: str = ""


Piece = Text | Call
Scanner = Callable[[str, bool], list[Piece]]


def merged(pieces: list[Piece]) -> list[Piece]:
    """Adjacent content pieces as one, empty ones dropped (the one shape a scan returns)."""
    out: list[Piece] = []
    for piece in pieces:
        if isinstance(piece, Text):
            if not piece.text:
                continue
            if out and isinstance(out[-1], Text):
                out[-1] = Text(out[-1].text + piece.text)
                continue
        out.append(piece)
    return out


class ScanParser:
    """Content that is only whitespace before the first real content is held; an output
    that made calls and said nothing else has no content."""

    def __init__(self, scan: Scanner):
        self._scan = scan
        self._text = ""
        self._pieces: list[Piece] = []
        self._held_ws = ""
        self._content: list[str] = []
        self._finished = False

    def feed(self, text: str) -> list[Event]:
        if self._finished or not text:
            return []
        self._text += text
        return self._update(self._scan(self._text, False))

    def finish(self) -> list[Event]:
        if self._finished:
            return []
        events = self._update(self._scan(self._text, True))
        self._finished = True
        if not self._content and not self.num_calls and self._held_ws:
            events += self._send(self._held_ws, force=True)
        return events

    def result(self) -> ParsedOutput:
        calls = [ParsedCall(p.name, p.arguments) for p in self._pieces if isinstance(p, Call)]
        content = "".join(self._content)
        return ParsedOutput(content if content or not calls else None, calls)

    @property
    def num_calls(self) -> int:
        return sum(isinstance(p, Call) for p in self._pieces)

    def _update(self, pieces: list[Piece]) -> list[Event]:
        events: list[Event] = []
        calls = 0
        for i, piece in enumerate(pieces):
            old = self._pieces[i] if i < len(self._pieces) else None
            if isinstance(piece, Call):
                if old is None:
                    events.append(CallStarted(calls, piece.name))
                grown = piece.arguments[len(old.arguments):] if isinstance(old, Call) else piece.arguments
                if grown:
                    events.append(ArgumentsDelta(calls, grown))
                calls += 1
            else:
                events += self._send(piece.text[len(old.text):] if isinstance(old, Text) else piece.text)
        self._pieces = pieces
        return events

    def _send(self, text: str, force: bool = False) -> list[Event]:
        if not text:
            return []
        if not self._content and not force:
            self._held_ws += text
            if not self._held_ws.strip():
                return []
            text, self._held_ws = self._held_ws, ""
        self._content.append(text)
        return [ContentDelta(text)]
