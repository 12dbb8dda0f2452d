"""deepseek_v3: DeepSeek V3 / V3-0324 / R1 (their tool-call marker tokens). One block after any
content, calls a newline apart, arguments a fenced JSON object:

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>
"""

from __future__ import annotations

import regex

from radixserve.tools.call_format import ToolCallFormat
from radixserve.tools.formats.block_scan import BlockScanner, BlockSyntax, JsonArguments
from radixserve.tools.formats.scan_parser import ScanParser
from radixserve.tools.parser import Schemas

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"

SYNTAX = BlockSyntax(
    open=CALLS_BEGIN,
    header=regex.compile(rf"\s*{CALL_BEGIN}(?:function)?{SEP}(?P<name>[^\n<]+)\n```(?:json)?\n"),
    arguments=JsonArguments,
    tail=regex.compile(rf"\s*```\s*{CALL_END}"),
    between=regex.compile(r"\s*"),
    close=regex.compile(rf"\s*{CALLS_END}"),
)


class DeepSeekV3Format(ToolCallFormat):
    name = "deepseek_v3"
    block_open = CALLS_BEGIN
    block_close = CALLS_END
    separator = "\n"
    call_end = f"\n```{CALL_END}"
    trigger = CALLS_BEGIN
    markers = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP)

    def call_begin(self, tool_name: str) -> str:
        return f"{CALL_BEGIN}function{SEP}{tool_name}\n```json\n"

    def parser(self, allowed: set[str] | None, schemas: Schemas) -> ScanParser:
        return ScanParser(BlockScanner(SYNTAX, allowed))


DEEPSEEK_V3 = DeepSeekV3Format()
