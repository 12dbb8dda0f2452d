"""harmony: gpt-oss (OpenAI's harmony response format). The output is messages on channels:

    <|channel|>analysis<|message|>Need the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>

A message to `functions.NAME` (in the channel header, or after the role) is a call, its body
the arguments (a call to an undeclared tool stays content, as written); every other
message's body is content (`final`; `commentary` preambles; and
`analysis`, unless a reasoning parser has taken it first). Text outside any message is content.
"""

from __future__ import annotations

import regex

from radixserve.tools.call_format import ToolCallFormat
from radixserve.tools.formats.scan_parser import Call, Piece, ScanParser, Text, merged
from radixserve.tools.json_scan import partial_suffix
from radixserve.tools.parser import Schemas

START = "<|start|>assistant"
_HEADER = regex.compile(
    r"(?:<\|start\|>assistant)?(?: to=(?P<r1>[^\s<]+))?<\|channel\|>(?P<channel>[A-Za-z_]+)"
    r"(?: to=(?P<r2>[^\s<]+))?\s*(?:<\|constrain\|>)?(?:[A-Za-z_]+)?<\|message\|>"
)
_OPENERS = ("<|start|>", "<|channel|>")
_ENDS = ("<|end|>", "<|call|>", "<|return|>")
_FUNCTIONS = "functions."


class HarmonyFormat(ToolCallFormat):
    name = "harmony"
    separator = START
    call_end = "<|call|>"
    trigger = "<|channel|>commentary to=functions."
    markers = ("<|start|>", "<|channel|>", "<|constrain|>", "<|message|>", "<|call|>", "<|end|>", "<|return|>")

    def call_begin(self, tool_name: str) -> str:
        return f"<|channel|>commentary to={_FUNCTIONS}{tool_name} <|constrain|>json<|message|>"

    def parser(self, allowed: set[str] | None, schemas: Schemas) -> ScanParser:
        return ScanParser(lambda text, final: _scan(text, final, allowed))

    def join_content(self, content: str | None, calls: str) -> str:
        """Content before calls is a commentary preamble, as gpt-oss writes one."""
        return f"<|channel|>commentary<|message|>{content}<|end|>{START}{calls}" if content else calls


HARMONY = HarmonyFormat()


def _scan(text: str, final: bool, allowed: set[str] | None) -> list[Piece]:
    pieces: list[Piece] = []
    pos: int | None = 0
    while pos is not None and pos < len(text):
        pos = _message(text, pos, final, allowed, pieces)
    return merged(pieces)


def _message(text: str, pos: int, final: bool, allowed: set[str] | None, pieces: list[Piece]) -> int | None:
    """One message (or the text up to the next one) at `pos`; where the next begins (None: the end)."""
    header = _HEADER.match(text, pos, partial=True)
    if header is not None and header.partial and not final:
        return None
    if header is None or header.partial:
        return _outside(text, pos, final, pieces)
    end, size = _body_end(text, header.end())
    body = text[header.end(): end if end >= 0 else len(text) - (0 if final else _held(text))]
    recipient = header.group("r1") or header.group("r2") or ""
    name = recipient[len(_FUNCTIONS):] if recipient.startswith(_FUNCTIONS) else ""
    if name and (allowed is None or name in allowed):
        pieces.append(Call(name, body))
    elif name:  # a call to an undeclared tool stays content, as written
        pieces.append(Text(text[pos: header.end() + len(body) + size]))
    else:
        pieces.append(Text(body))
    return end + size if end >= 0 else None


def _outside(text: str, pos: int, final: bool, pieces: list[Piece]) -> int | None:
    """Text that is not a message: content up to the next message's start."""
    starts = [at for at in (text.find(m, pos + 1) for m in _OPENERS) if at >= 0]
    if starts:
        pieces.append(Text(text[pos:min(starts)]))
        return min(starts)
    pieces.append(Text(text[pos: len(text) - (0 if final else max(partial_suffix(text, m) for m in _OPENERS))]))
    return None


def _body_end(text: str, pos: int) -> tuple[int, int]:
    found = [(at, len(m)) for at, m in ((text.find(m, pos), m) for m in _ENDS) if at >= 0]
    return min(found) if found else (-1, 0)


def _held(text: str) -> int:
    return max(partial_suffix(text, m) for m in _ENDS)
