"""ToolCallParser: generated text -> content and tool calls, incrementally or all at once.

One left-to-right state machine serves both the streamed and the complete answer, so the
deltas of a stream always assemble to exactly what `parse_tool_calls` returns for the
same text. A call is recognised once its header (`{"name": "<declared tool>",
"arguments": `) is complete; its arguments are the raw JSON text that follows, up to the
end of that JSON value (or the end of the text, when max_tokens cut the call short).
Anything that does not fit, a header that goes wrong, a call to an undeclared tool, stays
content; the parser never raises.

    content  <tool_call>\\n{"name": "f", "arguments": {"x": 1}}\\n</tool_call>  content
    TEXT     OPEN       HEADER                       ARGS    TAIL            TEXT
"""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass, field

import regex

from radixserve.server.tools.call_format import ToolCallFormat

_HEADER = regex.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')
_SEPARATOR = regex.compile(r"\s*(?:;\s*)?")


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


def parse_tool_calls(text: str, fmt: ToolCallFormat, allowed: Collection[str] | None = None) -> ParsedOutput:
    """The complete output's content and calls (what a stream of the same text assembles to)."""
    parser = ToolCallParser(fmt, allowed)
    parser.feed(text)
    parser.finish()
    return parser.result()


class ToolCallParser:
    """Feed text as it is generated; each call returns the events that became certain.

    `allowed`: the declared tool names (a call to any other name stays content); None
    accepts every name."""

    def __init__(self, fmt: ToolCallFormat, allowed: Collection[str] | None = None):
        self.fmt = fmt
        self.allowed = set(allowed) if allowed is not None else None
        self._buf = ""
        self._state = "text" if fmt.anywhere else "start"
        self._opened = ""  # text consumed into a call not yet recognised (content if it fails)
        self._args = _JsonValueScanner()
        self._held_ws = ""  # leading whitespace content, sent once real content follows
        self._content_started = False
        self._content: list[str] = []
        self._calls: list[tuple[str, list[str]]] = []
        self._events: list[Event] = []
        self._finished = False

    def feed(self, text: str) -> list[Event]:
        if self._finished:
            return []
        self._buf += text
        self._run(final=False)
        return self._take()

    def finish(self) -> list[Event]:
        """The end of the output: whatever was held back settles."""
        if self._finished:
            return []
        self._run(final=True)
        self._finished = True
        if not self._content_started and not self._calls and self._held_ws:
            self._send_content(self._held_ws, force=True)
        return self._take()

    def result(self) -> ParsedOutput:
        calls = [ParsedCall(name, "".join(parts)) for name, parts in self._calls]
        content = "".join(self._content)
        return ParsedOutput(content if content or not calls else None, calls)

    @property
    def num_calls(self) -> int:
        return len(self._calls)

    # ---- the state machine ----------------------------------------------------------------

    def _run(self, final: bool) -> None:
        step = {
            "start": self._start, "text": self._text, "text_only": self._text_only, "header": self._header,
            "args": self._arguments, "tail": self._tail, "between": self._between,
        }
        for _ in range(3 * len(self._buf) + 16):  # every few steps consume text
            if not step[self._state](final):
                return

    def _start(self, final: bool) -> bool:
        """Llama 3: a call only opens the output (after whitespace and a python tag)."""
        rest = self._buf.lstrip()
        for prefix in self.fmt.strip_prefixes:
            if rest.startswith(prefix):
                rest = rest[len(prefix):].lstrip()
            elif prefix.startswith(rest) and rest and not final:
                return False
        if not rest:
            if final:
                self._state = "text_only"
                return True
            return False
        self._opened = self._buf[: len(self._buf) - len(rest)]
        self._buf = rest
        self._state = "header" if rest.startswith("{") else "text_only"
        if self._state == "text_only":
            self._buf = self._opened + rest
            self._opened = ""
        return True

    def _text(self, final: bool) -> bool:
        if not self.fmt.anywhere:
            return self._text_only(final)
        at = self._buf.find(self.fmt.open)
        if at >= 0:
            self._send_content(self._buf[:at])
            self._opened = self.fmt.open
            self._buf = self._buf[at + len(self.fmt.open):]
            self._state = "header"
            return True
        keep = 0 if final else _partial_suffix(self._buf, self.fmt.open)
        self._send_content(self._buf[: len(self._buf) - keep])
        self._buf = self._buf[len(self._buf) - keep:]
        return False

    def _text_only(self, final: bool) -> bool:
        self._send_content(self._buf)
        self._buf = ""
        return False

    def _header(self, final: bool) -> bool:
        match = _HEADER.match(self._buf, partial=True)
        if match is not None and match.partial and not final:
            return False
        name = _decode_name(match.group(1)) if match is not None and not match.partial else None
        if name is None or (self.allowed is not None and name not in self.allowed):
            self._fail_header()
            return True
        self._calls.append((name, []))
        self._events.append(CallStarted(len(self._calls) - 1, name))
        self._buf = self._buf[match.end():]
        self._opened = ""
        self._args = _JsonValueScanner()
        self._state = "args"
        return True

    def _fail_header(self) -> None:
        self._send_content(self._opened)
        self._opened = ""
        self._state = "text" if self.fmt.anywhere else "text_only"

    def _arguments(self, final: bool) -> bool:
        if not self._args.started:
            self._buf = self._buf.lstrip()
        used, done = self._args.feed(self._buf)
        if used:
            index = len(self._calls) - 1
            self._calls[index][1].append(self._buf[:used])
            self._events.append(ArgumentsDelta(index, self._buf[:used]))
        self._buf = self._buf[used:]
        if done:
            self._state = "tail"
        return done

    def _tail(self, final: bool) -> bool:
        match = self._tail_pattern().match(self._buf, partial=True)
        if match is not None and match.partial and not final:
            return False
        if match is not None and match.partial:  # cut short inside the closing syntax
            self._buf = ""
        elif match is not None:
            self._buf = self._buf[match.end():]
        self._state = "text" if self.fmt.anywhere else "between"
        return True

    def _between(self, final: bool) -> bool:
        """Llama 3: after a call, `;` and another call, or content to the end."""
        match = _SEPARATOR.match(self._buf)
        rest = self._buf[match.end():]
        if not rest:
            if final:
                self._buf = ""
            return False
        if rest.startswith("{"):
            self._opened, self._buf = self._buf[: match.end()], rest
            self._state = "header"
        else:
            self._state = "text_only"
        return True

    def _tail_pattern(self) -> regex.Pattern:
        close = regex.escape(self.fmt.close)
        return regex.compile(r"\s*\}" + (r"\s*" + close if close else ""))

    # ---- output ---------------------------------------------------------------------------

    def _send_content(self, text: str, force: bool = False) -> None:
        if not text:
            return
        if not self._content_started and not force:
            self._held_ws += text
            if not self._held_ws.strip():
                return
            text, self._held_ws = self._held_ws, ""
        self._content_started = True
        self._content.append(text)
        self._events.append(ContentDelta(text))

    def _take(self) -> list[Event]:
        events, self._events = self._events, []
        return events


def text_events(parser: ToolCallParser | None, text: str, final: bool) -> list[Event]:
    """The events of the next piece of generated text (`parser` None: all of it is content);
    with `final`, the parser's last events too."""
    if parser is None:
        return [ContentDelta(text)] if text else []
    parsed = parser.feed(text) if text else []
    return parsed + parser.finish() if final else parsed


class _JsonValueScanner:
    """Finds where one JSON value ends, fed piece by piece (strings and nesting aware)."""

    def __init__(self) -> None:
        self.started = False
        self.kind = ""
        self.depth = 0
        self.in_string = False
        self.escape = False

    def feed(self, text: str) -> tuple[int, bool]:
        """(characters that belong to the value, whether the value is complete)."""
        for i, ch in enumerate(text):
            if not self.started:
                self._open(ch)
                if self.kind == "scalar" and ch in ",}]":
                    return i, True
                continue
            if self.kind == "scalar":
                if ch in ",}]" or ch.isspace():
                    return i, True
            elif self.in_string:
                if self.escape:
                    self.escape = False
                elif ch == "\\":
                    self.escape = True
                elif ch == '"':
                    self.in_string = False
                    if self.kind == "string":
                        return i + 1, True
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1, True
        return len(text), False

    def _open(self, ch: str) -> None:
        self.started = True
        if ch in "{[":
            self.kind, self.depth = "nested", 1
        elif ch == '"':
            self.kind, self.in_string = "string", True
        else:
            self.kind = "scalar"


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that begins `marker` (held back: it may open a call)."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def _decode_name(raw: str) -> str | None:
    try:
        name = json.loads(f'"{raw}"')
    except ValueError:
        return None
    return name if name else None
