"""Tool definitions (OpenAI's `tools`, `tool_choice`, `parallel_tool_calls`) and ToolSpec,
the checked form the server, the engine's `chat` and the DSL use.

Checks, each an InvalidRequest naming the field (a 400 over HTTP): at most MAX_TOOLS tools;
unique names of the form OpenAI allows; `parameters` a JSON schema that xgrammar compiles (a
schema that does not compile could never constrain a call); `tool_choice` naming a declared
tool, and `required` or a named tool only when tools are given. The names and the choice are
checked at once; the schemas compile where the prompt is built (`ToolSpec.compiled`, on a
prepare worker), since that is the slow part.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, replace
from typing import Annotated, Any, Literal

from pydantic import Field, TypeAdapter, ValidationError

from radixserve.request_error import InvalidRequest
from radixserve.body_models import OpenAIModel, expects

MAX_TOOLS = 128  # OpenAI's own bound on functions per request
NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


class FunctionDefinition(OpenAIModel):
    name: Annotated[str, Field(pattern=NAME_PATTERN)]
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema; absent means no parameters")
    strict: bool | None = Field(None, description="accepted; calls constrained by a grammar always follow the schema")


class ToolDefinition(OpenAIModel):
    type: Literal["function"]
    function: FunctionDefinition

    def template_entry(self) -> dict[str, Any]:
        """The tool as chat templates (and the fallback system turn) see it."""
        function: dict[str, Any] = {"name": self.function.name}
        if self.function.description is not None:
            function["description"] = self.function.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}

    @property
    def name(self) -> str:
        return self.function.name

    @property
    def parameters(self) -> dict[str, Any]:
        return self.function.parameters if self.function.parameters is not None else EMPTY_PARAMETERS


class NamedFunction(OpenAIModel):
    name: str


class NamedToolChoice(OpenAIModel):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Annotated[
    Literal["none", "auto", "required"] | NamedToolChoice,
    expects("'none', 'auto', 'required' or {\"type\": \"function\", \"function\": {\"name\": ...}}"),
]
ToolList = Annotated[list[ToolDefinition], Field(max_length=MAX_TOOLS)]
_TOOL_LIST: TypeAdapter[list[ToolDefinition]] = TypeAdapter(ToolList)
_TOOL_CHOICE: TypeAdapter[Any] = TypeAdapter(ToolChoice)


@dataclass(frozen=True)
class ToolSpec:
    """Checked tools of one request. `mode`: none / auto / required / named (then `named`
    is the tool every call must name). `parallel`: more than one call allowed."""

    tools: tuple[ToolDefinition, ...]
    mode: str
    named: str | None = None
    parallel: bool = True
    grammars: tuple[str, ...] = ()  # per tool: its arguments as an EBNF grammar (compact JSON), once compiled
    schema_params: tuple[str, ...] = ()  # per tool: the request field its schema came from, for errors

    def compiled(self) -> ToolSpec:
        """This spec with every tool's arguments grammar (compiling takes a while for a large
        schema: call it where prompts are built). An InvalidRequest naming the field for a
        schema xgrammar cannot compile."""
        if len(self.grammars) == len(self.tools):
            return self
        params = self.schema_params or tuple(f"tools[{i}].function.parameters" for i in range(len(self.tools)))
        return replace(self, grammars=tuple(arguments_grammar(t.parameters, p) for t, p in zip(self.tools, params)))

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.tools]

    @property
    def schemas(self) -> dict[str, dict[str, Any]]:
        """Each tool's parameters schema by name (formats that type values by it: qwen3_coder)."""
        return {t.name: t.parameters for t in self.tools}

    @property
    def parses_calls(self) -> bool:
        """Whether the output is read for calls (tool_choice `none` leaves it all content)."""
        return bool(self.tools) and self.mode != "none"

    def callable_tools(self) -> list[tuple[ToolDefinition, str]]:
        """(tool, arguments grammar) of every tool a call may name."""
        pairs = list(zip(self.tools, self.compiled().grammars))
        return [p for p in pairs if p[0].name == self.named] if self.mode == "named" else pairs


NO_TOOLS = ToolSpec((), "none")


def tool_spec(
    tools: list[ToolDefinition] | None,
    tool_choice: str | NamedToolChoice | None,
    parallel_tool_calls: bool | None,
    tools_param: str = "tools",
    choice_param: str = "tool_choice",
    flat: bool = False,
    compile: bool = True,
) -> ToolSpec:
    """Check tools and tool_choice together; raises an InvalidRequest naming the field. `flat`:
    the request spells a tool without its "function" wrapper (the Responses API). `compile`:
    compile the schemas now (else where the prompt is built: `ToolSpec.compiled`)."""
    inner = "" if flat else ".function"
    tools = list(tools or [])
    if len(tools) > MAX_TOOLS:
        raise InvalidRequest(f"'{tools_param}' takes at most {MAX_TOOLS} tools, got {len(tools)}", param=tools_param)
    _check_unique(tools, tools_param, inner)
    params = tuple(f"{tools_param}[{index}]{inner}.parameters" for index in range(len(tools)))
    parallel = True if parallel_tool_calls is None else parallel_tool_calls
    spec = _choose(tools, tool_choice, parallel, tools_param, choice_param)
    spec = replace(spec, schema_params=params)
    return spec.compiled() if compile else spec


def checked_tools(
    tools: list[Any] | None, tool_choice: Any = None, parallel_tool_calls: bool | None = None, compile: bool = True,
) -> ToolSpec:
    """The ToolSpec of tools given as Python values (the engine's `chat`, the DSL): OpenAI's
    `{"type": "function", "function": {"name", "description", "parameters"}}` dicts (or
    ToolDefinitions), and tool_choice "none" / "auto" / "required" / {"type": "function",
    "function": {"name": ...}}. An InvalidRequest naming the field for anything else."""
    try:
        definitions = _TOOL_LIST.validate_python(list(tools or []))
    except ValidationError as exc:
        raise InvalidRequest(_validation_message("tools", exc), param="tools") from None
    choice: str | NamedToolChoice | None = None
    if tool_choice is not None:
        try:
            choice = _TOOL_CHOICE.validate_python(tool_choice)
        except ValidationError:
            raise InvalidRequest("'tool_choice' must be 'none', 'auto', 'required' or "
                                 "{\"type\": \"function\", \"function\": {\"name\": ...}}", param="tool_choice") from None
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise InvalidRequest("'parallel_tool_calls' must be a bool", param="parallel_tool_calls")
    return tool_spec(definitions, choice, parallel_tool_calls, compile=compile)


def _choose(
    tools: list[ToolDefinition], tool_choice: str | NamedToolChoice | None, parallel: bool, tools_param: str,
    choice_param: str,
) -> ToolSpec:
    if tool_choice is None:
        return ToolSpec(tuple(tools), "auto" if tools else "none", None, parallel)
    if isinstance(tool_choice, NamedToolChoice):
        name = tool_choice.function.name
        if name not in {t.name for t in tools}:
            declared = ", ".join(t.name for t in tools) or "none"
            raise InvalidRequest(
                f"'{choice_param}' names the function '{name}', which is not among the tools (declared: {declared})",
                param=choice_param,
            )
        return ToolSpec(tuple(tools), "named", name, parallel)
    if tool_choice == "required" and not tools:
        raise InvalidRequest(f"'{choice_param}' 'required' needs at least one tool in '{tools_param}'", param=choice_param)
    return ToolSpec(tuple(tools), tool_choice, None, parallel)


def arguments_grammar(schema: dict[str, Any], param: str) -> str:
    """The schema as an EBNF grammar of compact JSON (no tokenizer needed); a 400 naming
    `param` when xgrammar cannot compile it."""
    try:
        return _schema_grammar(json.dumps(schema))
    except (RuntimeError, ValueError, TypeError) as exc:
        raise InvalidRequest(f"'{param}' is not a JSON schema this server can enforce: {_first_line(exc)}", param=param)
    except RecursionError:
        raise InvalidRequest(f"'{param}' nests too deeply", param=param) from None


@functools.lru_cache(maxsize=256)
def _schema_grammar(schema: str) -> str:
    """An agent sends the same tools every turn: each schema compiles once."""
    import xgrammar as xgr

    return str(xgr.Grammar.from_json_schema(schema, any_whitespace=False))


def _check_unique(tools: list[ToolDefinition], param: str, inner: str) -> None:
    seen: dict[str, int] = {}
    for index, tool in enumerate(tools):
        if tool.name in seen:
            where = f"{param}[{index}]{inner}.name"
            raise InvalidRequest(
                f"'{where}': the name '{tool.name}' is already used by {param}[{seen[tool.name]}]", param=where
            )
        seen[tool.name] = index


def _validation_message(field: str, exc: ValidationError) -> str:
    error = exc.errors()[0]
    where = field + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error["loc"])
    return f"'{where}': {error['msg']}"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
