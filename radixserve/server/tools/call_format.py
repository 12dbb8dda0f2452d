"""ToolCallFormat: how a model writes a tool call in its output text.

One format is shared by the three places that must agree on it: the parser that reads
calls back out of generated text, the grammar that constrains generation, and the
fallback rendering of an assistant's earlier calls into the prompt. Calls are always
written in the same canonical shape (the one the grammar forces), so a history re-sent
by an agent renders to exactly the bytes the model generated.
"""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class ToolCallFormat:
    """`open` + `{"name": <name>, "<args_key>": <arguments>}` + `close`, calls joined by `separator`.

    `anywhere`: a call may start anywhere in the text (after content); otherwise only at the
    start of the output or right after another call (Llama 3's convention)."""

    name: str
    open: str
    close: str
    args_key: str
    separator: str
    anywhere: bool
    strip_prefixes: tuple[str, ...] = ()  # markers a model may put before its first call

    def begin(self, tool_name: str) -> str:
        """The text of a call up to its arguments."""
        prefix = f"{self.open}\n" if self.open else ""
        return f'{prefix}{{"name": {json.dumps(tool_name, ensure_ascii=False)}, "{self.args_key}": '

    @property
    def end(self) -> str:
        """The text of a call after its arguments."""
        return f"}}\n{self.close}" if self.close else "}"

    def render_call(self, tool_name: str, arguments: str) -> str:
        """One call; `arguments` is JSON text, inserted verbatim."""
        return self.begin(tool_name) + arguments + self.end

    def render_calls(self, calls: list[tuple[str, str]]) -> str:
        return self.separator.join(self.render_call(name, args) for name, args in calls)


HERMES = ToolCallFormat(
    name="hermes", open="<tool_call>", close="</tool_call>", args_key="arguments", separator="\n", anywhere=True
)
LLAMA3 = ToolCallFormat(
    name="llama3", open="", close="", args_key="parameters", separator="; ", anywhere=False,
    strip_prefixes=("<|python_tag|>",),
)

FORMATS = {"hermes": HERMES, "qwen": HERMES, "llama3": LLAMA3, "llama3_json": LLAMA3}
PARSER_CHOICES = ("auto", "hermes", "qwen", "llama3")


def format_named(name: str) -> ToolCallFormat:
    """The format for a --tool-call-parser value other than `auto`; ValueError for an unknown one."""
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of {', '.join(PARSER_CHOICES)}") from None


def detect_format(chat_template: str | None) -> ToolCallFormat:
    """`auto`: Llama 3's JSON format when the template speaks of `<|python_tag|>` or
    `"parameters"` calls without `<tool_call>` tags; otherwise (and for templates with no
    tool support at all, such as the default model's ChatML) the Hermes/Qwen tags."""
    template = chat_template or ""
    if "<tool_call>" in template:
        return HERMES
    if "<|python_tag|>" in template or ("<|eom_id|>" in template and "parameters" in template):
        return LLAMA3
    return HERMES
