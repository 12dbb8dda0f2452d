"""qwen3_coder: Qwen3-Coder, Qwen 3.5 (XML calls). Each call stands alone, anywhere after content,
its parameters one element each:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A value is typed by the tool's schema: a string parameter is the text as written; any other
is JSON where the text is JSON (kept as written), else a Python literal, else a string.
"""

from __future__ import annotations

import json
from typing import Any

import regex

from radixserve.tools.call_format import ToolCallFormat
from radixserve.tools.definitions import ToolDefinition
from radixserve.tools.formats.block_scan import BlockScanner, BlockSyntax
from radixserve.tools.formats.literals import json_value
from radixserve.tools.formats.scan_parser import ScanParser
from radixserve.tools.json_scan import json_value_end, partial_suffix, written_object
from radixserve.tools.parser import Schemas

_PARAMETER = regex.compile(r"\s*<parameter=(?P<key>[^>\n]+)>")
_PARAMETER_END = "</parameter>"


class Qwen3CoderFormat(ToolCallFormat):
    name = "qwen3_coder"
    separator = "\n"
    call_end = "\n</function>\n</tool_call>"
    trigger = "<tool_call>"
    markers = ("<tool_call>", "</tool_call>")

    def call_begin(self, tool_name: str) -> str:
        return f"<tool_call>\n<function={tool_name}>\n"

    def parser(self, allowed: set[str] | None, schemas: Schemas) -> ScanParser:
        return ScanParser(BlockScanner(_syntax(schemas), allowed))

    def arguments_format(self, tool: ToolDefinition, grammar: str) -> dict[str, Any]:
        """The required parameters in the schema's order, each written as the template writes it
        (a newline on each side of the value): a string as text without `<`, anything else JSON."""
        schema = tool.parameters
        properties = schema.get("properties") or {}
        elements: list[dict[str, Any]] = []
        for key in [k for k in properties if k in set(schema.get("required") or [])]:
            opening = f"\n<parameter={key}>\n" if elements else f"<parameter={key}>\n"
            elements += [{"type": "const_string", "value": opening}, _value_format(properties[key]),
                         {"type": "const_string", "value": f"\n{_PARAMETER_END}"}]
        return {"type": "sequence", "elements": elements} if elements else {"type": "const_string", "value": ""}

    def render_arguments(self, arguments: str) -> str:
        """As the call writes them; arguments cut by max_tokens end where they were cut (a
        last value still open, a string's or a bracket's, without its close)."""
        written = written_object(arguments)
        if written is None:
            return arguments
        items, cut = written.items, ""
        if written.open_key is not None:
            cut = f"<parameter={written.open_key}"
        elif not written.closed and items and _open_value(items[-1][1]):
            key, value = items.pop()
            cut = f"<parameter={key}>\n{_written_start(value)}"
        whole = [f"<parameter={key}>\n{_written(value)}\n{_PARAMETER_END}" for key, value in items]
        return "\n".join(whole + ([cut] if cut else []))

    def example(self) -> str:
        return ("<tool_call>\n<function=<function-name>>\n<parameter=<parameter-name>>\n<value>\n</parameter>\n"
                "</function>\n</tool_call>")


QWEN3_CODER = Qwen3CoderFormat()


def _value_format(schema: Any) -> dict[str, Any]:
    if not _is_string(schema):
        return {"type": "json_schema", "json_schema": schema}
    if "enum" in schema or "const" in schema:
        options = schema["enum"] if "enum" in schema else [schema["const"]]
        return {"type": "regex", "pattern": "|".join(_escaped(o) for o in options)}
    if "pattern" in schema:
        return {"type": "regex", "pattern": schema["pattern"].removeprefix("^").removesuffix("$")}
    low, high = schema.get("minLength", 0), schema.get("maxLength")
    return {"type": "regex", "pattern": f"[^<]{{{low},{high if high is not None else ''}}}"}


def _escaped(text: str) -> str:
    return "".join("\\" + ch if ch in "\\^$.|?*+()[]{}/" else ch for ch in text)


def _syntax(schemas: Schemas) -> BlockSyntax:
    return BlockSyntax(
        open="<tool_call>",
        header=regex.compile(r"\s*<function=(?P<name>[^>\n]+)>"),
        arguments=lambda: _Parameters(schemas),
        tail=regex.compile(r"\s*</function>\s*</tool_call>"),
        between=regex.compile(r"\s*<tool_call>"),
    )


class _Parameters:
    """Parameters up to what is not one (the tail): each joins the JSON arguments once closed.
    Read on from where the last scan stopped (the text only grows)."""

    def __init__(self, schemas: Schemas):
        self.schemas = schemas
        # header end -> (parameters read, where the next begins, where to look on for its close)
        self._calls: dict[int, tuple[list[str], int, int]] = {}

    def __call__(self, text: str, pos: int, final: bool, name: str) -> tuple[str, int | None]:
        header_end = pos
        parts, pos, searched = self._calls.get(header_end, ([], pos, pos))
        properties = (self.schemas.get(name) or {}).get("properties") or {}
        while True:
            match = _PARAMETER.match(text, pos, partial=True)
            end = text.find(_PARAMETER_END, max(match.end(), searched)) if match and not match.partial else -1
            if match is None or end < 0:
                resume = max(match.end(), len(text) - len(_PARAMETER_END) + 1) if match and not match.partial else pos
                self._calls[header_end] = (parts, pos, resume)
                if match is None:
                    return "{" + ", ".join(parts) + "}", pos
                cut = _partial_parameter(text[pos:], properties) if final else ""
                parts = parts + [cut] if cut else parts
                return ("{" + ", ".join(parts)) if parts else "", None
            key = match.group("key")
            value = _typed(_unwrap(text[match.end():end]), properties.get(key))
            parts = parts + [f"{json.dumps(key, ensure_ascii=False)}: {value}"]
            pos = searched = end + len(_PARAMETER_END)


def _partial_parameter(text: str, properties: Any) -> str:
    """A parameter cut short (the output's end), as the JSON text of its pair so far: the key's
    start while its tag is open, else `"key": ` and the value written so far (a string's as the
    start of its JSON string), less what may be the start of its close."""
    match = _PARAMETER.match(text, partial=True)
    if match is None:
        return ""
    if match.partial:
        key = text[text.index("<parameter=") + len("<parameter="):] if "<parameter=" in text else ""
        return json.dumps(key, ensure_ascii=False)[:-1] if key else ""
    key = match.group("key")
    value = text[match.end():]
    value = value[: len(value) - partial_suffix(value, "\n" + _PARAMETER_END)]
    value = value[1:] if value.startswith("\n") else value
    schema = properties.get(key)
    as_json = not _is_string(schema) and (schema is not None or value.lstrip()[:1] in tuple('{["-0123456789'))
    written = value.strip() if as_json else json.dumps(value, ensure_ascii=False)[:-1] if value else ""
    return f"{json.dumps(key, ensure_ascii=False)}: {written}"


def _unwrap(value: str) -> str:
    """The value less the one newline the format puts on each side."""
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def _typed(value: str, schema: Any) -> str:
    if _is_string(schema):
        return json.dumps(value, ensure_ascii=False)
    typed = json_value(value.strip())
    if typed == json.dumps(value.strip(), ensure_ascii=False) and schema is None:
        return json.dumps(value, ensure_ascii=False)
    return typed


def _is_string(schema: Any) -> bool:
    if not isinstance(schema, dict):
        return False
    kind = schema.get("type")
    if kind == "string" or (isinstance(kind, list) and "string" in kind and len(kind) == 1):
        return True
    enum = schema.get("enum")
    return kind is None and isinstance(enum, list) and bool(enum) and all(isinstance(e, str) for e in enum)


def _open_value(value: str) -> bool:
    """A value cut short: nothing yet, or a string, object or array not closed (a number or a
    literal reads as whole: its text is the same either way)."""
    if not value:
        return True
    if value[0] not in '"[{':
        return False
    return json_value_end(value, 0) is None


def _written_start(value: str) -> str:
    """The start of a value as the format writes it: a string's text so far, anything else as written."""
    if not value.startswith('"'):
        return value
    for head in (value, value[:-1]):  # a cut right after a backslash ends inside an escape
        try:
            return json.loads(head + '"')
        except ValueError:
            continue
    return value[1:]


def _written(value: str) -> str:
    """A JSON value as the format writes it: a string's text itself, anything else as JSON."""
    if value.startswith('"'):
        try:
            decoded = json.loads(value)
        except ValueError:
            return value
        if isinstance(decoded, str):
            return decoded
    return value


