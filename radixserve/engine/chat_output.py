"""ChatOutput: a finished RequestOutput read as a chat answer: the text outside the tool calls,
and the calls, each with its name and its arguments as JSON (`Engine.chat`, and
`Engine.generate` with a conversation or tools)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from radixserve.outputs import RequestOutput
from radixserve.tools.call_format import ToolCallFormat
from radixserve.tools.definitions import ToolSpec
from radixserve.tools.parser import parse_tool_calls


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: `arguments` as the JSON text it wrote (as OpenAI's API gives
    it), `parsed` that text as a value (None where it is not whole JSON: max_tokens cut it)."""

    name: str
    arguments: str

    @property
    def parsed(self) -> Any:
        try:
            return json.loads(self.arguments)
        except (ValueError, RecursionError):
            return None


@dataclass
class ChatOutput:
    """A finished request's RequestOutput (`output`; its fields read through: `text` is
    everything generated, `finish_reason`, `token_ids`, `cached_tokens`...) with the answer's
    `content` (the text outside the calls; None when it only made calls) and `tool_calls`."""

    output: RequestOutput
    content: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)

    def __getattr__(self, name: str) -> Any:
        if name == "output":  # not set yet (copying, unpickling)
            raise AttributeError(name)
        return getattr(self.output, name)


def chat_output(output: RequestOutput, tools: ToolSpec, fmt: ToolCallFormat) -> ChatOutput:
    """`output` read for calls to `tools` in `fmt` (all content when tool_choice is `none`)."""
    content: str | None = output.text
    calls: list[ToolCall] = []
    if tools.parses_calls:
        parsed = parse_tool_calls(output.text, fmt, set(tools.names), tools.schemas)
        content = parsed.content
        calls = [ToolCall(call.name, call.arguments) for call in parsed.calls]
    return ChatOutput(output, content, calls)
