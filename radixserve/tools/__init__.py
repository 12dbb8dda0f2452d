"""Tool calling: definitions and their checks, the call formats (tools/formats/, one
module each), the parser of generated calls, the chat rendering of tools and earlier calls,
and the grammar that makes calls parse."""

from radixserve.tools.call_format import ToolCallFormat
from radixserve.tools.definitions import MAX_TOOLS, NO_TOOLS, NamedToolChoice, ToolChoice, ToolDefinition, ToolSpec, tool_spec
from radixserve.tools.formats import PARSER_CHOICES, detect_format, format_named
from radixserve.tools.formats.hermes import HERMES
from radixserve.tools.formats.llama3_json import LLAMA3_JSON
from radixserve.tools.grammar import MAX_PARALLEL_CALLS, tool_call_structural_tag
from radixserve.tools.history import HistoryCall, HistoryMessage, check_history
from radixserve.tools.parser import (
    ArgumentsDelta, CallStarted, ContentDelta, ParsedCall, ParsedOutput, ToolCallParser, parse_tool_calls,
)
from radixserve.tools.rendering import ChatRenderer, fallback_messages, template_supports_tools

LLAMA3 = LLAMA3_JSON  # the name earlier code and tests use

__all__ = [
    "HERMES", "LLAMA3", "LLAMA3_JSON", "MAX_PARALLEL_CALLS", "MAX_TOOLS", "NO_TOOLS", "PARSER_CHOICES",
    "ArgumentsDelta", "CallStarted", "ChatRenderer", "ContentDelta", "HistoryCall", "HistoryMessage",
    "NamedToolChoice", "ParsedCall", "ParsedOutput", "ToolCallFormat", "ToolCallParser", "ToolChoice",
    "ToolDefinition", "ToolSpec", "check_history", "detect_format", "fallback_messages", "format_named",
    "parse_tool_calls", "template_supports_tools", "tool_call_structural_tag", "tool_spec",
]
