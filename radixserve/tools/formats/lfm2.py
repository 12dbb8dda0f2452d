"""lfm2: Liquid's LFM2 and LFM2.5 (SGLang's parser of that name). Pythonic calls, the list
between two special tokens of the model's vocabulary, anywhere after content:

    <|tool_call_start|>[get_weather(city="Paris", unit="c"), add(a=1, b=2)]<|tool_call_end|>

The calls inside read as pythonic's do (Python literals, or JSON, as written: the canonical
shape and what the grammar forces).
"""

from __future__ import annotations

import dataclasses

import regex

from radixserve.tools.formats.block_scan import BlockScanner
from radixserve.tools.formats.pythonic import SYNTAX as PYTHONIC_SYNTAX
from radixserve.tools.formats.pythonic import PythonicFormat
from radixserve.tools.formats.scan_parser import ScanParser
from radixserve.tools.parser import Schemas

CALL_START, CALL_END = "<|tool_call_start|>", "<|tool_call_end|>"

SYNTAX = dataclasses.replace(PYTHONIC_SYNTAX, open=CALL_START + "[", anywhere=True,
                             close=regex.compile(r"\s*\]\s*" + regex.escape(CALL_END)))


class Lfm2Format(PythonicFormat):
    name = "lfm2"
    block_open = CALL_START + "["
    block_close = "]" + CALL_END
    trigger = CALL_START
    markers = (CALL_START, CALL_END)

    def triggers(self, names: list[str]) -> list[str]:
        return [self.trigger]

    def parser(self, allowed: set[str] | None, schemas: Schemas) -> ScanParser:
        return ScanParser(BlockScanner(SYNTAX, allowed))

    def example(self) -> str:
        return f"{CALL_START}[<function-name>(<parameter>=<JSON value>, ...), ...]{CALL_END}"


LFM2 = Lfm2Format()
