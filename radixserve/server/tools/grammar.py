"""The constraint that makes tool calls parse: an xgrammar structural tag over the calls.

- `required` / a named tool: the whole output is one or more calls (exactly one when
  parallel calls are off, at most MAX_PARALLEL_CALLS otherwise), each naming a declared
  tool (the named one) with arguments valid under that tool's `parameters` schema.
- `auto`: free text, but once the model opens a call (`<tool_call>` for Hermes, `{"name": `
  for Llama 3), the name and arguments are constrained as above until the call closes.
- `none`: no constraint.

Calls come out in the format's canonical shape (`ToolCallFormat.begin` / `.end`), with
compact JSON arguments (the schema's grammar without free whitespace) separated as `json.dumps` writes them (", " and ": "), which is
also what the fallback rendering writes back into the next turn's prompt.
"""

from __future__ import annotations

from typing import Any

from radixserve.server.tools.call_format import ToolCallFormat
from radixserve.server.tools.definitions import ToolDefinition, ToolSpec

MAX_PARALLEL_CALLS = 8  # bounds `required` with parallel calls: a small model may not stop on its own


def tool_call_structural_tag(spec: ToolSpec, fmt: ToolCallFormat) -> dict[str, Any] | None:
    """The structural tag (as JSON-ready dict) for this request, or None when unconstrained."""
    if not spec.parses_calls:
        return None
    tags = [_tag(tool, grammar, fmt) for tool, grammar in spec.callable_tools()]
    if spec.mode == "auto":
        trigger = fmt.open if fmt.open else fmt.begin("")[: len('{"name": ')]
        body = {"type": "triggered_tags", "triggers": [trigger], "tags": tags, "stop_after_first": not spec.parallel}
    else:
        body = _forced_calls(tags, fmt, spec.parallel)
    return {"type": "structural_tag", "format": body}


def _forced_calls(tags: list[dict[str, Any]], fmt: ToolCallFormat, parallel: bool) -> dict[str, Any]:
    one = tags[0] if len(tags) == 1 else {"type": "or", "elements": tags}
    if not parallel:
        return one
    more = {"type": "sequence", "elements": [{"type": "const_string", "value": fmt.separator}, one]}
    return {
        "type": "sequence",
        "elements": [one, {"type": "repeat", "min": 0, "max": MAX_PARALLEL_CALLS - 1, "content": more}],
    }


def _tag(tool: ToolDefinition, grammar: str, fmt: ToolCallFormat) -> dict[str, Any]:
    return {"type": "tag", "begin": fmt.begin(tool.name), "content": {"type": "grammar", "grammar": grammar}, "end": fmt.end}
