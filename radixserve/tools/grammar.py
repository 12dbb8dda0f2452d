"""The constraint that makes tool calls parse: an xgrammar structural tag over the calls,
built from the format's pieces (ToolCallFormat: block_open, call_begin, arguments, call_end,
separator, block_close) for every format alike.

- `required`: the whole output is one block of one or more calls (exactly one when parallel
  calls are off, at most MAX_PARALLEL_CALLS otherwise), each naming a declared tool with
  arguments valid under that tool's `parameters` schema.
- a named tool: the whole output is exactly one call of that tool (as OpenAI, vLLM and
  SGLang answer a named tool_choice), whatever parallel_tool_calls says.
- `auto`: free text, but once the model opens calls (the format's trigger: `<tool_call>`,
  `[TOOL_CALLS]`, `{"name": ` ...), the block is constrained as above until it closes.
- `none`: no constraint.

Calls come out in the format's canonical shape, which is also what the fallback rendering
writes back into the next turn's prompt. JSON arguments are compact (the schema's grammar
without free whitespace) with ", " and ": " separators, as `json.dumps` writes them.
"""

from __future__ import annotations

from typing import Any

from radixserve.tools.call_format import ToolCallFormat
from radixserve.tools.definitions import ToolDefinition, ToolSpec

MAX_PARALLEL_CALLS = 8  # bounds `required` with parallel calls: a small model may not stop on its own


def tool_call_structural_tag(spec: ToolSpec, fmt: ToolCallFormat) -> dict[str, Any] | None:
    """The structural tag (as JSON-ready dict) for this request, or None when unconstrained."""
    if not spec.parses_calls:
        return None
    tools = spec.callable_tools()
    calls = [_call(tool, grammar, fmt) for tool, grammar in tools]
    parallel = spec.parallel and spec.mode != "named"
    body = _auto(tools, calls, fmt, parallel) if spec.mode == "auto" else _block(calls, fmt, parallel)
    return {"type": "structural_tag", "format": body}


def tool_constraint(spec: ToolSpec, fmt: ToolCallFormat, tokenizer: Any = None) -> dict[str, Any]:
    """SamplingParams fields that make the calls parse (none for tool_choice `none`): the
    structural tag, and, where the format's markers are special tokens of the model's
    `tokenizer` (Mistral's [TOOL_CALLS], harmony's channels...), skip_special_tokens off so
    that they stay in the text the parser reads."""
    tag = tool_call_structural_tag(spec, fmt)
    if tag is None:
        return {}
    return {"structural_tag": tag, **({"skip_special_tokens": False} if _special_markers(fmt, tokenizer) else {})}


def _special_markers(fmt: ToolCallFormat, tokenizer: Any) -> bool:
    special = set(getattr(tokenizer, "all_special_tokens", None) or ())
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    special |= {token.content for token in decoder.values() if getattr(token, "special", False)}
    return any(marker in special for marker in fmt.markers)


def _auto(tools: list[tuple[ToolDefinition, str]], calls: list[dict[str, Any]], fmt: ToolCallFormat,
          parallel: bool) -> dict[str, Any]:
    triggers = list(dict.fromkeys(fmt.triggers([tool.name for tool, _ in tools])))
    if not fmt.block_open:
        return {"type": "triggered_tags", "triggers": triggers, "tags": calls, "stop_after_first": not parallel}
    # the block's opening and the first call's header as one tag begin, so a trigger opens both
    tags = [
        {"type": "tag", "begin": fmt.block_open + fmt.call_begin(tool.name),
         "content": _sequence([fmt.arguments_format(tool, grammar), _const(fmt.call_end), *_more(calls, fmt, parallel)]),
         "end": fmt.block_close}
        for tool, grammar in tools
    ]
    return {"type": "triggered_tags", "triggers": triggers, "tags": tags, "stop_after_first": True}


def _block(calls: list[dict[str, Any]], fmt: ToolCallFormat, parallel: bool) -> dict[str, Any]:
    one = _one_of(calls)
    return _sequence([_const(fmt.block_open), one, *_more(calls, fmt, parallel), _const(fmt.block_close)])


def _more(calls: list[dict[str, Any]], fmt: ToolCallFormat, parallel: bool) -> list[dict[str, Any]]:
    """The calls after the first (none when parallel calls are off)."""
    if not parallel:
        return []
    another = _sequence([_const(fmt.separator), _one_of(calls)])
    return [{"type": "repeat", "min": 0, "max": MAX_PARALLEL_CALLS - 1, "content": another}]


def _call(tool: ToolDefinition, grammar: str, fmt: ToolCallFormat) -> dict[str, Any]:
    return {"type": "tag", "begin": fmt.call_begin(tool.name), "content": fmt.arguments_format(tool, grammar),
            "end": fmt.call_end}


def _one_of(calls: list[dict[str, Any]]) -> dict[str, Any]:
    return calls[0] if len(calls) == 1 else {"type": "or", "elements": calls}


def _sequence(elements: list[dict[str, Any] | None]) -> dict[str, Any]:
    kept = [e for e in elements if e is not None]
    return kept[0] if len(kept) == 1 else {"type": "sequence", "elements": kept}


def _const(text: str) -> dict[str, Any] | None:
    return {"type": "const_string", "value": text} if text else None
