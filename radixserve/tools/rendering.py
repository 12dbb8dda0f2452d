"""ChatRenderer: a conversation with tools -> the prompt text, through the model's chat template.

A template that knows tools (its source speaks of `tools` or `tool_calls`) gets them as
they are: `tools=` and messages with `tool_calls` (arguments as objects) and `tool` turns.
A template that does not (the default SmolLM2's ChatML) gets the fallback rendering, plain
role/content messages that hold everything:

- the tools, one JSON object a line, and how to call them, in the system turn (appended to
  the first system message, or a new one);
- an assistant's calls as text in exactly the format the parser reads back and the grammar
  writes (`<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`, arguments verbatim; a call
  cut by max_tokens ends where it was cut);
- tool results as a user turn: `<tool_response id="call_..." name="...">\\n...\\n</tool_response>`,
  consecutive results in one turn (templates that insist on alternating roles accept it).

Rendering depends only on the messages and tools, so turn k+1 (turn k's history, the
reply, the results) renders to turn k's prompt plus more: the radix cache hits it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from radixserve.tools.call_format import ToolCallFormat
from radixserve.tools.definitions import ToolDefinition
from radixserve.tools.history import HistoryCall, HistoryMessage, parsed_arguments

TOOLS_HEADER = (
    "# Tools\n\nYou may call one or more functions to help with the user's request. "
    "The functions, one JSON object a line:\n"
)


@dataclass(frozen=True)
class TemplateInput:
    """What goes into `tokenizer.apply_chat_template`."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None


def template_supports_tools(template: str | None) -> bool:
    return bool(template) and ("tool_calls" in template or "tools" in template)


def own_template(tokenizer: Any) -> str | None:
    """The tokenizer's own chat template (None when it has none, or not one text)."""
    template = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
    return template if isinstance(template, str) and template else None


class ChatRenderer:
    """Renders histories for one tokenizer and one call format, through `template` (the chat
    template in force: --chat-template or a request's) or else the tokenizer's own."""

    def __init__(self, tokenizer: Any, fmt: ToolCallFormat, template: str | None = None):
        self.tokenizer = tokenizer
        self.fmt = fmt
        self.template = template
        self.native = template_supports_tools(template if template is not None else own_template(tokenizer))

    def template_input(self, messages: list[HistoryMessage], tools: list[ToolDefinition]) -> TemplateInput:
        if self.native:
            names = {c.id: c.name for m in messages for c in m.tool_calls}
            return TemplateInput([_native(m, names) for m in messages], [t.template_entry() for t in tools] or None)
        return TemplateInput(fallback_messages(messages, tools, self.fmt), None)

    def render(self, messages: list[HistoryMessage], tools: list[ToolDefinition],
               template_kwargs: dict[str, Any] | None = None) -> str:
        """The prompt text, generation prompt included; `template_kwargs`: the request's own
        arguments for the template (chat_template_kwargs)."""
        if self.tokenizer is None or not (self.template or own_template(self.tokenizer)):
            raise ValueError("this model has no chat template")
        entry = self.template_input(messages, tools)
        kwargs = {**(template_kwargs or {}), **({"tools": entry.tools} if entry.tools is not None else {})}
        if self.template is not None:
            kwargs["chat_template"] = self.template
        return self.tokenizer.apply_chat_template(
            entry.messages, tokenize=False, add_generation_prompt=True, **kwargs
        )


def fallback_messages(messages: list[HistoryMessage], tools: list[ToolDefinition], fmt: ToolCallFormat) -> list[dict]:
    """Plain role/content messages carrying tools, calls and results as text."""
    out: list[dict[str, str]] = []
    names = {c.id: c.name for m in messages for c in m.tool_calls}
    for message in messages:
        if message.role == "tool":
            text = _tool_result(message, names.get(message.tool_call_id or "", message.name))
            if out and out[-1].get("_results"):
                out[-1]["content"] += "\n" + text
            else:
                out.append({"role": "user", "content": text, "_results": "1"})
        elif message.role == "assistant" and message.tool_calls:
            calls = _calls_as_written(message.tool_calls, fmt)
            out.append(_with_reasoning({"role": "assistant", "content": fmt.join_content(message.content, calls)}, message))
        else:
            out.append(_with_reasoning({"role": message.role, "content": message.content or ""}, message))
    for entry in out:
        entry.pop("_results", None)
    if tools:
        _add_tools_to_system(out, tools, fmt)
    return out


def tools_system_text(tools: list[ToolDefinition], fmt: ToolCallFormat) -> str:
    lines = "\n".join(json.dumps(t.template_entry()["function"], ensure_ascii=False) for t in tools)
    return f"{TOOLS_HEADER}{lines}\n\nTo call a function, answer with:\n{fmt.example()}"


def _add_tools_to_system(out: list[dict[str, str]], tools: list[ToolDefinition], fmt: ToolCallFormat) -> None:
    text = tools_system_text(tools, fmt)
    if out and out[0]["role"] == "system":
        out[0]["content"] = f"{out[0]['content']}\n\n{text}" if out[0]["content"] else text
    else:
        out.insert(0, {"role": "system", "content": text})


def _calls_as_written(calls: tuple[HistoryCall, ...], fmt: ToolCallFormat) -> str:
    """The calls as the model wrote them: a last call cut by max_tokens (its arguments not
    whole JSON) ends where the model stopped, without the close it never wrote."""
    text = fmt.render_calls([(c.name, c.arguments) for c in calls])
    if fmt.end and not _whole_json(calls[-1].arguments) and text.endswith(fmt.end):  # (text[:-0] is empty)
        text = text[: -len(fmt.end)]
    return text


def _whole_json(text: str) -> bool:
    try:
        json.loads(text)
    except (ValueError, RecursionError):
        return False
    return True


def _tool_result(message: HistoryMessage, name: str | None) -> str:
    attrs = f' id="{message.tool_call_id}"' + (f' name="{name}"' if name else "")
    return f"<tool_response{attrs}>\n{message.content or ''}\n</tool_response>"


def _with_reasoning(entry: dict[str, Any], message: HistoryMessage) -> dict[str, Any]:
    """An assistant turn's reasoning goes to the template as `reasoning_content` (templates
    that render earlier reasoning read it; others ignore it)."""
    if message.reasoning is not None:
        entry["reasoning_content"] = message.reasoning
    return entry


def _native(message: HistoryMessage, names: dict[str, str]) -> dict[str, Any]:
    entry: dict[str, Any] = _with_reasoning({"role": message.role, "content": message.content or ""}, message)
    if message.tool_calls:
        entry["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": parsed_arguments(c)}}
            for c in message.tool_calls
        ]
    if message.role == "tool":
        entry["tool_call_id"] = message.tool_call_id
        name = message.name or names.get(message.tool_call_id or "")
        if name:
            entry["name"] = name
    return entry
