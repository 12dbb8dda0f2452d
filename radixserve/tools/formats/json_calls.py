"""JsonCallFormat: calls written as JSON objects `{"name": ..., "<args_key>": {...}}`, optionally
wrapped in tags (Hermes / Qwen 2.5: `<tool_call>`; Llama 3.1: bare, `; ` between calls), and
their parser.

    content  <tool_call>\\n{"name": "f", "arguments": {"x": 1}}\\n</tool_call>  content
    TEXT     OPEN       HEADER                       ARGS    TAIL            TEXT
"""

from __future__ import annotations

import json

import regex

from radixserve.tools.call_format import ToolCallFormat
from radixserve.tools.json_scan import JsonValueScanner, decode_name, partial_suffix
from radixserve.tools.parser import (
    ArgumentsDelta, CallStarted, ContentDelta, Event, ParsedCall, ParsedOutput, Schemas,
)

_HEADER = regex.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')
_SEPARATOR = regex.compile(r"\s*(?:;\s*)?")


class JsonCallFormat(ToolCallFormat):
    """`open` + `{"name": <name>, "<args_key>": <arguments>}` + `close`, calls joined by `separator`.

    `anywhere`: a call may start anywhere in the text (after content); otherwise only at the
    start of the output or right after another call (Llama 3's convention)."""

    def __init__(self, name: str, open: str, close: str, args_key: str, separator: str, anywhere: bool,
                 strip_prefixes: tuple[str, ...] = ()):
        self.name = name
        self.open = open
        self.close = close
        self.args_key = args_key
        self.separator = separator
        self.anywhere = anywhere
        self.strip_prefixes = strip_prefixes  # markers a model may put before its first call
        self.markers = tuple(m for m in (open, close) if m) + strip_prefixes
        self.call_end = f"}}\n{close}" if close else "}"
        self.trigger = open if open else '{"name": '

    def call_begin(self, tool_name: str) -> str:
        prefix = f"{self.open}\n" if self.open else ""
        return f'{prefix}{{"name": {json.dumps(tool_name, ensure_ascii=False)}, "{self.args_key}": '

    def parser(self, allowed: set[str] | None, schemas: Schemas) -> JsonCallParser:
        return JsonCallParser(self, allowed)


class JsonCallParser:
    """The machine of the JSON formats (`allowed`: the declared names; None accepts any)."""

    def __init__(self, fmt: JsonCallFormat, allowed: set[str] | None):
        self.fmt = fmt
        self.allowed = allowed
        self._buf = ""
        self._state = "text" if fmt.anywhere else "start"
        self._opened = ""  # text consumed into a call not yet recognised (content if it fails)
        self._args = JsonValueScanner()
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
            "args": self._arguments, "tail": self._tail, "between": self._between, "gap": self._gap,
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
        keep = 0 if final else partial_suffix(self._buf, self.fmt.open)
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
        name = decode_name(match.group(1)) if match is not None and not match.partial else None
        if name is None or (self.allowed is not None and name not in self.allowed):
            self._fail_header()
            return True
        self._calls.append((name, []))
        self._events.append(CallStarted(len(self._calls) - 1, name))
        self._buf = self._buf[match.end():]
        self._opened = ""
        self._args = JsonValueScanner()
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
        self._state = "gap" if self.fmt.anywhere else "between"
        return True

    def _gap(self, final: bool) -> bool:
        """Hermes: whitespace between two calls separates them; before anything else it is content."""
        rest, marker = self._buf.lstrip(), self.fmt.open
        if not final and (not rest or (len(rest) < len(marker) and marker.startswith(rest))):
            return False
        if rest.startswith(marker):
            self._buf = rest
        self._state = "text"
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
