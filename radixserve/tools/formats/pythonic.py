"""pythonic: Llama 3.2 (lightweight models), Llama 4, and models given vLLM's pythonic
template. The output opens with a Python list of calls with keyword arguments:

    [get_weather(city="Paris", unit="c"), add(a=1, b=2)]

Values are read with Python's `ast` (never evaluated) into JSON arguments; a value already
written as JSON (the canonical shape, and what the grammar forces) is kept as written, so
the call renders back byte for byte.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

import regex

from radixserve.tools.call_format import ToolCallFormat
from radixserve.tools.definitions import ToolDefinition
from radixserve.tools.formats.block_scan import BlockScanner, BlockSyntax
from radixserve.tools.formats.literals import json_value
from radixserve.tools.formats.scan_parser import ScanParser
from radixserve.tools.json_scan import skip_ws, written_object
from radixserve.tools.parser import Schemas

_KWARG = re.compile(r"\s*([A-Za-z_]\w*)\s*=(.*)", re.S)
_PARTIAL_KWARG = re.compile(r"\s*([A-Za-z_]\w*)(?:\s*=(.*))?\s*\Z", re.S)


class PythonicArguments:
    """Keyword arguments up to the call's `)`: each one joins the JSON arguments once whole;
    at the end of a cut output (`final`) the argument it cut joins as written so far (as the
    JSON formats return a cut call's text). Read on from where the last scan stopped (the
    text only grows)."""

    def __init__(self) -> None:
        self._calls: dict[int, _CallArguments] = {}  # header end -> its arguments so far

    def __call__(self, text: str, pos: int, final: bool, name: str) -> tuple[str, int | None]:
        return self._calls.setdefault(pos, _CallArguments(pos)).read(text, final)


class _CallArguments:
    def __init__(self, pos: int):
        self.parts: list[str] = []  # `"key": value` of each whole argument
        self.start = pos  # where the argument being read begins
        self.at = pos  # how far it has been scanned
        self.depth, self.quote, self.escape, self.broken = 0, "", False, False
        self.end: int | None = None

    def read(self, text: str, final: bool) -> tuple[str, int | None]:
        while self.end is None:
            if self.at == self.start:
                self.start = self.at = skip_ws(text, self.start)
                if self.start < len(text) and text[self.start] == ")":
                    self.end = self.start
                    break
            stop = self._scan(text)
            if stop is None:
                cut = _partial_pair(text[self.start:], len(self.parts)) if final and not self.broken else ""
                parts = self.parts + [cut] if cut else self.parts
                return ("{" + ", ".join(parts)) if parts else "", None
            self.parts.append(_pair(text[self.start:stop], len(self.parts)))
            if text[stop] == ")":
                self.end = stop
            else:
                self.start = self.at = stop + 1
        return "{" + ", ".join(self.parts) + "}", self.end

    def _scan(self, text: str) -> int | None:
        """Where the argument ends: its `,` or the call's `)` (brackets and strings aware)."""
        while not self.broken and self.at < len(text):
            ch, at = text[self.at], self.at
            self.at += 1
            if self.quote:
                if self.escape:
                    self.escape = False
                elif ch == "\\":
                    self.escape = True
                elif ch == self.quote:
                    self.quote = ""
            elif ch in "\"'":
                self.quote = ch
            elif ch in "([{":
                self.depth += 1
            elif ch in ")]}" and self.depth == 0:
                self.broken = ch != ")"
                return at if ch == ")" else None
            elif ch in ")]}":
                self.depth -= 1
            elif ch == "," and self.depth == 0:
                return at
        return None


SYNTAX = BlockSyntax(
    open="[",
    header=regex.compile(r"\s*(?P<name>[A-Za-z_][\w.\-]*)\("),
    arguments=PythonicArguments,
    tail=regex.compile(r"\)"),
    between=regex.compile(r"\s*,\s*"),
    close=regex.compile(r"\s*\](?:\s*<\|python_end\|>)?"),
    anywhere=False,
    lead=r"\s*(?:<\|python_start\|>|<\|python_tag\|>)?\s*",
)


class PythonicFormat(ToolCallFormat):
    name = "pythonic"
    block_open = "["
    block_close = "]"
    separator = ", "
    call_end = ")"
    markers = ("<|python_start|>", "<|python_end|>", "<|python_tag|>")

    def call_begin(self, tool_name: str) -> str:
        return f"{tool_name}("

    def triggers(self, names: list[str]) -> list[str]:
        return [f"[{name}(" for name in names]

    def parser(self, allowed: set[str] | None, schemas: Schemas) -> ScanParser:
        return ScanParser(BlockScanner(SYNTAX, allowed))

    def arguments_format(self, tool: ToolDefinition, grammar: str) -> dict[str, Any]:
        """The required keyword arguments in the schema's order, each value JSON under its schema."""
        schema = tool.parameters
        properties = schema.get("properties") or {}
        elements: list[dict[str, Any]] = []
        for key in [k for k in properties if k in set(schema.get("required") or [])]:
            prefix = f", {key}=" if elements else f"{key}="
            elements += [{"type": "const_string", "value": prefix},
                         {"type": "json_schema", "json_schema": properties[key]}]
        return {"type": "sequence", "elements": elements} if elements else {"type": "const_string", "value": ""}  # no arguments: f()

    def render_arguments(self, arguments: str) -> str:
        """As the call writes them; arguments cut by max_tokens end where they were cut."""
        written = written_object(arguments)
        if written is None:
            return arguments
        pairs = [f"{key}={value}" for key, value in written.items]
        return ", ".join(pairs + ([written.open_key] if written.open_key is not None else []))

    def example(self) -> str:
        return "[<function-name>(<parameter>=<JSON value>, ...), ...]"


PYTHONIC = PythonicFormat()


def _partial_pair(text: str, index: int) -> str:
    """An argument cut short, as the JSON text of its pair so far: `"key": value as written`,
    or the key's start while no `=` follows it yet (a positional value is `_index`'s, as in `_pair`)."""
    if not text.strip():
        return ""
    match = _PARTIAL_KWARG.match(text)
    key, value = (match.group(1), match.group(2)) if match else (f"_{index}", text)
    if value is None:
        return json.dumps(key, ensure_ascii=False)[:-1]
    return f"{json.dumps(key, ensure_ascii=False)}: {_partial_value(value.lstrip())}"


def _partial_value(text: str) -> str:
    """A value cut short: as written, but for a Python string in single quotes, which becomes
    the start of the JSON string it was writing."""
    if not text.startswith("'"):
        return text
    for written in (text, text[:-1]):  # a cut right after a backslash ends inside an escape
        try:
            return json.dumps(ast.literal_eval(written + "'"), ensure_ascii=False)[:-1]
        except (SyntaxError, ValueError):
            continue
    return text


def _pair(text: str, index: int) -> str:
    match = _KWARG.match(text)
    key, value = (match.group(1), match.group(2)) if match else (f"_{index}", text)
    return f"{json.dumps(key)}: {json_value(value.strip())}"
