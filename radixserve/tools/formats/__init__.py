"""The tool-call formats, one module each, registered here (a new format is one module and
one line below). `format_named` answers --tool-call-parser; `detect_format` is `auto`: under
a family's built-in template the format its registry entry names, else the format the chat
template in force speaks of (the first row whose markers it contains)."""

from __future__ import annotations

from collections.abc import Callable

from radixserve.tools.call_format import ToolCallFormat
from radixserve.tools.formats.deepseek_v3 import DEEPSEEK_V3
from radixserve.tools.formats.harmony import HARMONY
from radixserve.tools.formats.hermes import HERMES
from radixserve.tools.formats.lfm2 import LFM2
from radixserve.tools.formats.llama3_json import LLAMA3_JSON
from radixserve.tools.formats.mistral import mistral_for
from radixserve.tools.formats.pythonic import PYTHONIC
from radixserve.tools.formats.qwen3_coder import QWEN3_CODER

Factory = Callable[[str | None], ToolCallFormat]  # the chat template in force -> the format

FORMATS: dict[str, Factory] = {
    "hermes": lambda template: HERMES,
    "llama3_json": lambda template: LLAMA3_JSON,
    "pythonic": lambda template: PYTHONIC,
    "mistral": mistral_for,
    "qwen3_coder": lambda template: QWEN3_CODER,
    "deepseek_v3": lambda template: DEEPSEEK_V3,
    "harmony": lambda template: HARMONY,
    "lfm2": lambda template: LFM2,
}
ALIASES = {"qwen": "hermes", "llama3": "llama3_json", "llama4_pythonic": "pythonic", "openai": "harmony",
           "gpt_oss": "harmony"}
PARSER_CHOICES = ("auto", *FORMATS, *ALIASES)

# auto: (format, markers any of which the template holds), first match wins
DETECTION: list[tuple[str, tuple[str, ...]]] = [
    ("harmony", ("<|channel|>",)),
    ("deepseek_v3", ("tool▁calls▁begin",)),
    ("mistral", ("[TOOL_CALLS]",)),
    ("lfm2", ("<|tool_call_start|>",)),
    ("qwen3_coder", ("<function=",)),
    ("hermes", ("<tool_call>",)),
    ("pythonic", ("<|python_start|>", "[func_name1(", "<|header_start|>")),
    ("llama3_json", ("<|python_tag|>",)),
]
DEFAULT = "hermes"  # templates that know no tools (the default model's ChatML) get the fallback in hermes


def format_named(name: str, template: str | None = None) -> ToolCallFormat:
    """The format for a --tool-call-parser value (`auto`: from `template`); ValueError for an unknown one."""
    if name == "auto":
        return detect_format(template)
    key = ALIASES.get(name, name)
    if key not in FORMATS:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of {', '.join(PARSER_CHOICES)}")
    return FORMATS[key](template)


def detect_format(template: str | None) -> ToolCallFormat:
    return FORMATS[detected_name(template)](template)


def detected_name(template: str | None) -> str:
    named = _builtin_default(template)
    if named is not None:
        return named
    text = template or ""
    for name, markers in DETECTION:
        if any(marker in text for marker in markers):
            return name
    if "<|eom_id|>" in text and "parameters" in text:  # Llama 3.1 templates that spell no python tag
        return "llama3_json"
    return DEFAULT


def _builtin_default(template: str | None) -> str | None:
    """The format the family of a built-in template (model/chat_templates/) names for `auto`
    (None: not a built-in, or its family names none)."""
    if not template or "radixserve's built-in" not in template[:200]:
        return None
    from radixserve.model.builtin_template import builtin_defaults  # a built-in's model is loaded already

    return builtin_defaults(template)[0]
