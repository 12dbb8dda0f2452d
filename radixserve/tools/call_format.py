"""ToolCallFormat: how one model family writes tool calls in its output text.

A format is shared by the three places that must agree on it: the parser that reads calls
back out of generated text, the grammar that constrains generation (tools/grammar.py
builds it from the pieces below), and the fallback rendering of an assistant's earlier calls
into the prompt. Calls are written in one canonical shape, the one the grammar forces:

    block_open  call_begin(name) arguments call_end  separator  call_begin(...) ...  block_close

so a history re-sent by an agent renders to exactly the bytes the model generated. Each
format is one module in tools/formats/, registered in formats/__init__.py.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from radixserve.tools.definitions import ToolDefinition
    from radixserve.tools.parser import CallParser, Schemas


class ToolCallFormat(ABC):
    name: str = ""
    block_open: str = ""  # before the first call ("" when each call stands alone)
    block_close: str = ""  # after the last call
    separator: str = ""  # between two calls
    call_end: str = ""  # after a call's arguments
    trigger: str = ""  # the text that opens calls under tool_choice `auto`
    markers: tuple[str, ...] = ()  # what may be one token of a model's vocabulary (kept in the text if special)

    @abstractmethod
    def call_begin(self, tool_name: str) -> str:
        """The text of a call up to its arguments."""

    @abstractmethod
    def parser(self, allowed: set[str] | None, schemas: Schemas) -> CallParser:
        """A fresh machine reading one output."""

    def triggers(self, names: list[str]) -> list[str]:
        """What opens calls under `auto` (the grammar constrains from there on)."""
        return [self.trigger]

    def arguments_format(self, tool: ToolDefinition, grammar: str) -> dict[str, Any]:
        """The structural-tag format of a call's arguments; `grammar`: the schema as compact JSON."""
        return {"type": "grammar", "grammar": grammar}

    def render_arguments(self, arguments: str) -> str:
        """The arguments (JSON text) as the call writes them."""
        return arguments

    def render_call(self, tool_name: str, arguments: str) -> str:
        return self.call_begin(tool_name) + self.render_arguments(arguments) + self.call_end

    def render_calls(self, calls: list[tuple[str, str]]) -> str:
        """(name, arguments) pairs as generated, in the canonical shape."""
        return self.block_open + self.separator.join(self.render_call(n, a) for n, a in calls) + self.block_close

    def render_message(self, content: str | None, calls: list[tuple[str, str]]) -> str:
        """An assistant turn's content and calls as generated."""
        return self.join_content(content, self.render_calls(calls))

    def join_content(self, content: str | None, calls: str) -> str:
        """Content before the calls' text. Content that does not end in whitespace is set
        apart from the calls by a newline."""
        if not content:
            return calls
        return content + calls if content[-1].isspace() else f"{content}\n{calls}"

    @property
    def end(self) -> str:
        """What follows the last call's arguments."""
        return self.call_end + self.block_close

    def example(self) -> str:
        """How to call, as the fallback system turn shows it."""
        return self.render_call("<function-name>", "<arguments-json-object>")

