"""mistral: Mistral 7B v0.3, Nemo, Small, Large, Devstral, Magistral. `[TOOL_CALLS]` opens the
calls, in one of two forms (the parser reads both; the template in force picks the one the
grammar forces and the rendering writes):

    list (v0.3, Nemo):      [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]
    name (tokenizer v11+):  [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}

In the list form a call may carry the "id" the templates write after its arguments.
"""

from __future__ import annotations

import json

import regex

from radixserve.tools.call_format import ToolCallFormat
from radixserve.tools.formats.block_scan import BlockScanner, BlockSyntax, JsonArguments
from radixserve.tools.formats.scan_parser import Piece, ScanParser
from radixserve.tools.parser import Schemas

MARK = "[TOOL_CALLS]"

LIST_SYNTAX = BlockSyntax(
    open=MARK,
    header=regex.compile(r'\s*\[?\s*\{\s*"name"\s*:\s*"(?P<name>[A-Za-z0-9_.\-]+)"\s*,\s*"arguments"\s*:\s*'),
    arguments=JsonArguments,
    tail=regex.compile(r'\s*(?:,\s*"id"\s*:\s*"[A-Za-z0-9]*"\s*)?\}'),
    between=regex.compile(r"\s*,\s*"),
    close=regex.compile(r"\s*\]"),
)
NAME_SYNTAX = BlockSyntax(
    open=MARK,
    header=regex.compile(r"(?P<name>[A-Za-z0-9_.\-]+)(?:\[CALL_ID\][A-Za-z0-9]*)?\[ARGS\]"),
    arguments=JsonArguments,
    tail=regex.compile(r""),
    between=regex.compile(r"\s*\[TOOL_CALLS\]"),
)


class MistralFormat(ToolCallFormat):
    """`named`: the name-then-arguments form; else the JSON list (`space`: `[TOOL_CALLS] [`)."""

    name = "mistral"
    trigger = MARK
    markers = (MARK, "[ARGS]", "[CALL_ID]")

    def __init__(self, named: bool, space: bool = False):
        self.named = named
        if not named:
            self.block_open = MARK + (" [" if space else "[")
            self.block_close = "]"
            self.separator = ", "
            self.call_end = "}"

    def call_begin(self, tool_name: str) -> str:
        if self.named:
            return f"{MARK}{tool_name}[ARGS]"
        return f'{{"name": {json.dumps(tool_name)}, "arguments": '

    def parser(self, allowed: set[str] | None, schemas: Schemas) -> ScanParser:
        return ScanParser(_Scanner(allowed))

    def example(self) -> str:
        if self.named:
            return f"{MARK}<function-name>[ARGS]<arguments-json-object>"
        return f'{self.block_open}{{"name": "<function-name>", "arguments": <arguments-json-object>}}, ...]'


class _Scanner:
    """The list form where `[` or `{` (or nothing yet) follows the first marker, else the name form."""

    def __init__(self, allowed: set[str] | None):
        self.list = BlockScanner(LIST_SYNTAX, allowed)
        self.named = BlockScanner(NAME_SYNTAX, allowed)

    def __call__(self, text: str, final: bool) -> list[Piece]:
        at = text.find(MARK)
        after = text[at + len(MARK):].lstrip() if at >= 0 else ""
        return self.list(text, final) if after[:1] in ("[", "{", "") else self.named(text, final)


def mistral_for(template: str | None) -> MistralFormat:
    """The form the template writes: `[ARGS]` in it means the name form."""
    template = template or ""
    return MistralFormat(named="[ARGS]" in template, space="[TOOL_CALLS] [" in template)
