"""POST /v1/responses: the request body (input items, function tools, text format) and the
conversation it spells, in the chat path's terms (HistoryMessage, ToolSpec). What is
supported and refused: radixserve/server/api/responses.py."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, WrapValidator
from pydantic_core import PydanticCustomError

from radixserve.server.errors import APIError, bad_request
from radixserve.server.protocol.common import MAX_SEED, OpenAIBody, OpenAIModel, expects
from radixserve.server.protocol.sampling import NO_EFFECT_FIELDS
from radixserve.server.protocol.template_args import ReasoningEffort, template_kwargs
from radixserve.server.response_store import OwnedResponses
from radixserve.tools.definitions import (
    MAX_TOOLS, FunctionDefinition, NamedFunction, NamedToolChoice, ToolDefinition, ToolSpec, tool_spec,
)
from radixserve.tools.history import HistoryCall, HistoryMessage


class TextPart(OpenAIModel):
    type: Literal["input_text", "output_text", "text"]
    text: str


class MessageItem(OpenAIModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Annotated[str | list[TextPart], expects("a string or a list of text parts")]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(OpenAIModel):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(OpenAIModel):
    type: Literal["function_call_output"]
    call_id: str
    output: Annotated[str | list[TextPart], expects("a string or a list of text parts")]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


class ReasoningText(OpenAIModel):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(OpenAIModel):
    """A reasoning item sent back: its text is the reasoning of the assistant turn that follows."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ReasoningText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: None = Field(None, description="never made here: must be absent")
    status: str | None = None

    def text(self) -> str:
        parts = self.content if self.content else self.summary
        return "".join(p.text for p in parts)


InputItem = Annotated[
    MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem,
    expects("a message, function_call, function_call_output or reasoning item (text content only)"),
]


def _string_or_items(value: Any, handler: Any) -> Any:
    """`input`: a string as it is; a list item by item (so an error names the bad item)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise PydanticCustomError("wrong_type", "must be {expected}", {"expected": "a string or a list of input items"})
    return handler(value)


class FunctionTool(OpenAIModel):
    type: Literal["function"]
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def definition(self) -> ToolDefinition:
        function = FunctionDefinition(name=self.name, description=self.description, parameters=self.parameters,
                                      strict=self.strict)
        return ToolDefinition(type="function", function=function)


class FunctionChoice(OpenAIModel):
    type: Literal["function"]
    name: str


class TextFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"]
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    name: str | None = None
    strict: bool | None = None


class TextOptions(OpenAIModel):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = Field(None, description="the default only: a model setting this one lacks")


# `include` values that ask for what this server never produces (built-in tools' outputs,
# encrypted reasoning): nothing to add, so nothing changes. Output logprobs are refused.
NOTHING_TO_INCLUDE = frozenset({
    "web_search_call.action.sources", "web_search_call.results", "code_interpreter_call.outputs",
    "computer_call_output.output.image_url", "file_search_call.results", "message.input_image.image_url",
    "reasoning.encrypted_content",
})


class ReasoningOptions(OpenAIModel):
    """`reasoning`: the effort goes to the chat template (as chat's reasoning_effort); the
    reasoning comes back as reasoning items with its text, never summarized ("auto" allows that)."""

    effort: ReasoningEffort | None = None
    summary: Literal["auto"] | None = Field(None, description="'auto' only: no summaries are made")
    generate_summary: Literal["auto"] | None = Field(None, description="the older name of summary")


class ResponsesRequest(OpenAIBody):
    """The body of POST /v1/responses."""

    no_effect = NO_EFFECT_FIELDS | {"max_tool_calls", "stream_options"}  # built-in tools only; obfuscation only

    model: str
    input: Annotated[list[InputItem], WrapValidator(_string_or_items)]  # or a string (kept as it is)
    instructions: str | None = None
    tools: Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Annotated[
        Literal["none", "auto", "required"] | FunctionChoice,
        expects("'none', 'auto', 'required' or {\"type\": \"function\", \"name\": ...}"),
    ] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="an extension: reproducible sampling")
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    text: TextOptions | None = None
    background: bool = False
    metadata: dict[str, Any] | None = None
    user: str | None = None
    include: list[str] | None = None
    truncation: Literal["disabled"] | None = Field(None, description="'auto' (dropping input to fit) is refused")
    top_logprobs: int | None = Field(None, ge=0, le=20, description="0 only: output logprobs are not supported")
    reasoning: ReasoningOptions | None = Field(None, description="effort reaches the chat template")
    thinking_token_budget: int | None = Field(
        None, ge=1, description="an extension, as on chat (vLLM's): at most this many reasoning tokens, then the "
        "block is closed")

    def check_supported(self) -> None:
        """A 400 for the fields that would change the answer in ways this server does not do."""
        if self.background:
            raise bad_request("'background' responses are not supported", param="background")
        for index, value in enumerate(self.include or []):
            if value not in NOTHING_TO_INCLUDE:
                raise bad_request(f"'include[{index}]': {value!r} is not supported", param=f"include[{index}]")
        if self.top_logprobs:
            raise bad_request("'top_logprobs' is not supported by /v1/responses", param="top_logprobs")

    def template_kwargs(self) -> dict[str, Any]:
        """The arguments this request passes to the chat template (reasoning.effort)."""
        return template_kwargs(None, self.reasoning.effort if self.reasoning is not None else None)

    def tool_spec(self) -> ToolSpec:
        choice = self.tool_choice
        if isinstance(choice, FunctionChoice):
            choice = NamedToolChoice(type="function", function=NamedFunction(name=choice.name))
        definitions = [t.definition() for t in self.tools or []]
        return tool_spec(definitions, choice, self.parallel_tool_calls, flat=True, compile=False)

    def history(self, store: OwnedResponses) -> tuple[list[HistoryMessage], list[HistoryMessage]]:
        """(instructions as a system turn, the conversation: stored turns, then this input)."""
        head = [HistoryMessage("system", self.instructions)] if self.instructions else []
        earlier: list[HistoryMessage] = []
        if self.previous_response_id is not None:
            stored = store.get(self.previous_response_id)
            if stored is None:
                raise APIError(
                    404, f"previous response '{self.previous_response_id}' not found: unknown or expired (responses "
                    f"are kept in memory for {store.ttl_s:g} s, at most {store.max_entries} of them)",
                    type="not_found_error", param="previous_response_id", code="response_not_found",
                )
            earlier = stored
        return head, earlier + input_history(self.input)

    def constraint(self, spec: ToolSpec) -> dict[str, Any]:
        """The text format's constraint (the tools' grammar joins the params where the prompt
        is built)."""
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type == "text":
            return {}
        if spec.parses_calls:
            raise bad_request("'text.format' cannot be combined with tool calls; set tool_choice 'none'",
                              param="text.format")
        if fmt.type == "json_object":
            return {"json_object": True}
        return {"json_schema": fmt.schema_ or {}}


def input_history(value: str | list) -> list[HistoryMessage]:
    if isinstance(value, str):
        return [HistoryMessage("user", value)]
    out: list[HistoryMessage] = []
    reasoning: str | None = None  # a reasoning item's text, for the assistant turn that follows it
    for index, item in enumerate(value):
        where = f"input[{index}]"
        if isinstance(item, ReasoningItem):
            reasoning = (reasoning or "") + item.text()
            continue
        if isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            out.append(HistoryMessage(role, item.text(), reasoning=reasoning if role == "assistant" else None))
        elif isinstance(item, FunctionCallItem):
            call = HistoryCall(item.call_id, item.name, item.arguments, f"{where}.arguments")
            if out and out[-1].role == "assistant" and reasoning is None:  # calls join the assistant turn they follow
                last = out.pop()
                out.append(HistoryMessage("assistant", last.content, last.tool_calls + (call,), reasoning=last.reasoning))
            else:
                out.append(HistoryMessage("assistant", None, (call,), reasoning=reasoning))
        else:
            out.append(HistoryMessage("tool", item.text(), tool_call_id=item.call_id,
                                      tool_call_id_param=f"{where}.call_id"))
        if not isinstance(item, MessageItem) or item.role == "assistant":
            reasoning = None  # taken by this turn (or a tool result came between: it was about nothing)
    if reasoning is not None:  # reasoning at the end: an assistant turn of reasoning alone
        out.append(HistoryMessage("assistant", None, reasoning=reasoning))
    if not out:
        raise bad_request("'input' must not be empty", param="input")
    return out
