"""BlockScanner: the scanner (see scan_parser.py) of formats whose calls sit in a block that a
marker opens, each call a header naming the tool, its arguments, and a tail:

    content  OPEN HEADER ARGUMENTS TAIL  BETWEEN HEADER ARGUMENTS TAIL  CLOSE  content

A header that does not name a declared tool leaves the text content. Once a header is
complete the call is certain: the arguments grow from there, and text after them that is
not the expected tail is content again.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import regex

from radixserve.tools.formats.scan_parser import Call, Piece, Text, merged
from radixserve.tools.json_scan import JsonValueScanner, partial_suffix, skip_ws

# (text, position after the header, final, tool name) -> (arguments as JSON text so far,
# where they end in the text, None while they may still grow). A reader belongs to one
# parser: the text it is given only grows, so it may go on from where it stopped.
ArgumentsReader = Callable[[str, int, bool, str], tuple[str, int | None]]


class JsonArguments:
    """A JSON value, whitespace before it skipped, read on from where the last scan stopped
    (long arguments cost their length once, not once per piece of the stream)."""

    def __init__(self) -> None:
        self._values: dict[int, tuple[JsonValueScanner, int, int | None]] = {}  # start -> scanner, read to, end

    def __call__(self, text: str, pos: int, final: bool, name: str) -> tuple[str, int | None]:
        start = skip_ws(text, pos)
        if start >= len(text):
            return "", None
        scanner, read, end = self._values.get(start) or (JsonValueScanner(), start, None)
        if end is None:
            used, done = scanner.feed(text[read:])
            read += used
            end = read if done else None
            self._values[start] = (scanner, read, end)
        return (text[start:end] if end is not None else text[start:]), end


@dataclass(frozen=True)
class BlockSyntax:
    open: str  # the marker that opens the calls
    header: regex.Pattern  # a call up to its arguments; group "name"
    arguments: Callable[[], ArgumentsReader]  # a fresh reader for one parser
    tail: regex.Pattern  # after the arguments
    between: regex.Pattern  # before the next call's header
    close: regex.Pattern | None = None  # after the last call
    anywhere: bool = True  # calls may follow content; else only at the start of the output
    lead: str = r"\s*"  # (start-only formats) a regex of what may come before `open`


class BlockScanner:
    def __init__(self, syntax: BlockSyntax, allowed: set[str] | None):
        self.syntax = syntax
        self.allowed = allowed
        self._read_arguments = syntax.arguments()
        self._start = regex.compile(syntax.lead + regex.escape(syntax.open))

    def __call__(self, text: str, final: bool) -> list[Piece]:
        pieces: list[Piece] = []
        pos: int | None = 0
        while pos is not None:
            pos = self._content(text, pos, final, pieces)
        return merged(pieces)

    def _content(self, text: str, pos: int, final: bool, pieces: list[Piece]) -> int | None:
        """Content up to the next block; the block; where content goes on (None: scanned to the end)."""
        found = self._find_open(text, pos, final)
        if isinstance(found, int):  # no block ahead: content up to what may still open one
            pieces.append(Text(text[pos:found]))
            return None
        start, after = found
        pieces.append(Text(text[pos:start]))
        return self._block(text, start, after, final, pieces)

    def _find_open(self, text: str, pos: int, final: bool) -> tuple[int, int] | int:
        if self.syntax.anywhere:
            at = text.find(self.syntax.open, pos)
            if at >= 0:
                return at, at + len(self.syntax.open)
            return len(text) - (0 if final else partial_suffix(text[pos:], self.syntax.open))
        match = self._start.match(text, pos, partial=True) if pos == 0 else None
        if match is not None and not match.partial:
            return pos, match.end()
        return pos if match is not None and not final else len(text)

    def _block(self, text: str, start: int, after: int, final: bool, pieces: list[Piece]) -> int | None:
        pos, fail_from, first = after, start, True
        while True:
            header = self.syntax.header.match(text, pos, partial=True)
            if header is not None and header.partial and not final:
                return None
            name = header.group("name") if header is not None and not header.partial else None
            if not name or (self.allowed is not None and name not in self.allowed):
                if first:  # the marker alone: content, and content goes on after it
                    pieces.append(Text(text[start:after]))
                    return self._rest(text, after, pieces)
                return self._rest(text, fail_from, pieces)
            arguments, end = self._read_arguments(text, header.end(), final, name)
            pieces.append(Call(name, arguments))
            if end is None:
                return None
            tail = self.syntax.tail.match(text, end, partial=True)
            if tail is None:  # no tail: what follows the arguments is content
                return self._rest(text, end, pieces)
            if tail.partial:
                return self._rest(text, len(text), pieces) if final else None
            pos = tail.end()
            closed = self._closed(text, pos, final)
            if closed is not None:
                return None if closed < 0 else self._rest(text, closed, pieces)
            between = self.syntax.between.match(text, pos, partial=True)
            if between is None:
                return self._rest(text, pos, pieces)
            if between.partial and not final:
                return None
            fail_from, pos, first = pos, between.end(), False

    def _closed(self, text: str, pos: int, final: bool) -> int | None:
        """Where the block closes at `pos`; -1: it may (wait); None: it does not."""
        if self.syntax.close is None:
            return None
        close = self.syntax.close.match(text, pos, partial=True)
        if close is None:
            return None
        if not close.partial:
            return close.end()
        return len(text) if final else -1

    def _rest(self, text: str, pos: int, pieces: list[Piece]) -> int | None:
        """After a block: more content (and blocks) where calls may come anywhere; else all content."""
        if self.syntax.anywhere:
            return pos
        pieces.append(Text(text[pos:]))
        return None
