"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's request bodies and the
conversation they spell, in the chat path's terms (HistoryMessage, ToolSpec).

Supported: `system` (a string or text blocks), messages of text, tool_use and tool_result
blocks (a result's content a string or text blocks, `is_error`), role "system" messages,
custom `tools` with `input_schema`, `tool_choice` auto / any / tool / none (with
`disable_parallel_tool_use`), `max_tokens` (0: fill the cache only), `temperature`,
`top_p`, `top_k`, `stop_sequences`, `metadata`, `stream`, `thinking` (enabled with a
budget, or disabled: see api/anthropic.py); `cache_control` (every prefix is cached: a mark
keeps the prefix it ends pinned for its TTL, see cache_marks) and `service_tier` are
accepted. Unknown fields are a 400, as Anthropic's own API answers; fields it knows that
this server cannot honour (image and document blocks, redacted thinking, server tools, MCP,
containers, structured output, a final assistant turn to continue) are refused with a 400
that says so. Thinking blocks sent back in an assistant turn reach the chat template as the
turn's reasoning_content.

A conversation renders exactly as the equivalent chat completions request would: text
blocks joined as content parts are, a tool_use's `input` written back as the JSON the
grammar generates (`json.dumps`' separators), tool results as tool turns. An error result
is a tool turn whose text starts with "Error: ".
"""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import AfterValidator, BeforeValidator, ConfigDict, Discriminator, Field, Tag, ValidationError
from pydantic_core import PydanticCustomError

from radixserve.sampling_params import SamplingParams
from radixserve.server.errors import APIError, bad_request
from radixserve.server.protocol.common import Integer, OpenAIModel, ServedModel, expects, validation_error
from radixserve.server.protocol.jobs import GenerationJob, Prompt
from radixserve.server.protocol.sampling import MAX_STOP_STRINGS, NonEmptyString, SessionId
from radixserve.tools.definitions import (
    MAX_TOOLS, NAME_PATTERN, FunctionDefinition, ToolDefinition, ToolSpec,
)
from radixserve.tools.history import HistoryCall, HistoryMessage

TAG = "block:"  # pydantic names a union member in an error's location; parse() drops it
ERROR_PREFIX = "Error: "
UNSUPPORTED_BLOCKS = {
    "image": "image blocks", "document": "document blocks", "search_result": "search results",
    "redacted_thinking": "redacted thinking blocks", "container_upload": "container uploads",
    "server_tool_use": "server tools", "web_search_tool_result": "server tools", "web_fetch_tool_result": "server tools",
    "code_execution_tool_result": "server tools", "mcp_tool_use": "MCP tools", "mcp_tool_result": "MCP tools",
}
# Fields of Anthropic's API this server does not implement: each a 400 when present.
REFUSED_FIELDS = (
    "container", "mcp_servers", "output_config", "context_management", "inference_geo", "speed", "diagnostics",
    "user_profile_id", "workspace_id",
)


class AnthropicModel(OpenAIModel):
    """Strict types, null as absent, and an unknown field is a 400 (Anthropic refuses them too)."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid", populate_by_name=True)


TTL_SECONDS = {"5m": 300.0, "1h": 3600.0}


class CacheControl(AnthropicModel):
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None

    @property
    def ttl_s(self) -> float:
        return TTL_SECONDS[self.ttl or "5m"]


class ThinkingEnabled(AnthropicModel):
    type: Literal["enabled"]
    budget_tokens: Integer = Field(ge=1, description="at most this many tokens of reasoning, then the answer")


class ThinkingDisabled(AnthropicModel):
    type: Literal["disabled"]


Thinking = Annotated[
    ThinkingEnabled | ThinkingDisabled,
    expects('{"type": "enabled", "budget_tokens": N} or {"type": "disabled"}'),
]


class TextBlock(AnthropicModel):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = Field(None, description="accepted: every prefix is cached")
    citations: Annotated[list[Any], Field(max_length=0)] | None = Field(None, description="not supported: empty")


class ToolUseBlock(AnthropicModel):
    type: Literal["tool_use"]
    id: Annotated[str, Field(min_length=1)]
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ThinkingBlock(AnthropicModel):
    """An assistant turn's reasoning sent back: it reaches the template as reasoning_content."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = Field(None, description="accepted: this server signs nothing")
    cache_control: ClassVar[None] = None  # Anthropic takes no cache_control on thinking blocks


def _string_is_a_text_block(value: Any) -> Any:
    if isinstance(value, str):
        return [{"type": "text", "text": value}]
    if not isinstance(value, list):
        raise PydanticCustomError("wrong_type", "must be {expected}", {"expected": "a string or a list of blocks"})
    return value


def _supported_block(value: Any) -> Any:
    kind = value.get("type") if isinstance(value, dict) else None
    if isinstance(kind, str) and kind in UNSUPPORTED_BLOCKS:
        raise PydanticCustomError(
            "refused", "content block type '{kind}' is not supported ({what} are not; text, tool_use and "
            "tool_result blocks are)", {"kind": kind, "what": UNSUPPORTED_BLOCKS[kind]},
        )
    return value


def _block_union(*members: type[AnthropicModel]) -> Any:
    """A union of block models chosen by `type`; any other type is one clear error."""
    if len(members) == 1:
        return Annotated[members[0], BeforeValidator(_supported_block)]
    names = {m.model_fields["type"].annotation.__args__[0]: m for m in members}
    quoted = [f"'{n}'" for n in names]
    expected = f"a {', '.join(quoted[:-1])} or {quoted[-1]} block"

    def choose(value: Any) -> str | None:
        kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
        return TAG + kind if isinstance(kind, str) and kind in names else None

    tagged = tuple(Annotated[m, Tag(TAG + n)] for n, m in names.items())
    return Annotated[
        Union[tagged],  # noqa: UP007 - a runtime tuple of members
        Discriminator(choose, custom_error_type="refused", custom_error_message=f"expected {expected}"),
        BeforeValidator(_supported_block),
    ]


ResultBlock = _block_union(TextBlock)


class ToolResultBlock(AnthropicModel):
    type: Literal["tool_result"]
    tool_use_id: Annotated[str, Field(min_length=1)]
    content: Annotated[list[ResultBlock], BeforeValidator(
        _string_is_a_text_block, json_schema_input_type=Union[str, list[ResultBlock]])] = Field(default_factory=list)
    is_error: bool = False
    cache_control: CacheControl | None = None

    def text(self) -> str:
        text = "".join(b.text for b in self.content)
        return ERROR_PREFIX + text if self.is_error else text


ContentBlock = _block_union(TextBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock)
Content = Annotated[list[ContentBlock], BeforeValidator(
    _string_is_a_text_block, json_schema_input_type=Union[str, list[ContentBlock]])]


BLOCKS_OF_ROLE = {
    "user": (TextBlock, ToolResultBlock), "assistant": (TextBlock, ToolUseBlock, ThinkingBlock), "system": (TextBlock,),
}


class AnthropicMessage(AnthropicModel):
    role: Literal["user", "assistant", "system"]
    content: Content

    def history(self, where: str) -> list[HistoryMessage]:
        """The message as chat turns: a user message's tool results become tool turns, its
        text (between them) user turns; an assistant's text and tool_use blocks one turn."""
        allowed = BLOCKS_OF_ROLE[self.role]
        for j, block in enumerate(self.content):
            if not isinstance(block, allowed):
                here = f"{where}.content[{j}]"
                raise bad_request(f"'{here}': a {self.role} message cannot hold a '{block.type}' block", param=here)
        return [self._assistant_turn(where)] if self.role == "assistant" else self._turns(where)

    def _turns(self, where: str) -> list[HistoryMessage]:
        turns: list[HistoryMessage] = []
        texts: list[str] = []
        for j, block in enumerate(self.content):
            if isinstance(block, TextBlock):
                texts.append(block.text)
                continue
            if texts:
                turns.append(HistoryMessage(self.role, "".join(texts)))
                texts = []
            turns.append(HistoryMessage("tool", block.text(), tool_call_id=block.tool_use_id,
                                        tool_call_id_param=f"{where}.content[{j}].tool_use_id"))
        if texts or not turns:
            turns.append(HistoryMessage(self.role, "".join(texts)))
        return turns

    def _assistant_turn(self, where: str) -> HistoryMessage:
        texts = [b.text for b in self.content if isinstance(b, TextBlock)]
        calls = tuple(
            HistoryCall(b.id, b.name, json.dumps(b.input, ensure_ascii=False), f"{where}.content[{j}].input")
            for j, b in enumerate(self.content) if isinstance(b, ToolUseBlock)
        )
        thinking = [b.thinking for b in self.content if isinstance(b, ThinkingBlock)]
        return HistoryMessage("assistant", "".join(texts) if texts or not calls else None, calls,
                              reasoning="".join(thinking) if thinking else None)


def _object_schema(schema: dict[str, Any]) -> dict[str, Any]:
    if schema.get("type") != "object":
        raise PydanticCustomError("wrong_type", "must be {expected}", {"expected": 'a JSON schema with "type": "object"'})
    return schema


InputSchema = Annotated[dict[str, Any], AfterValidator(_object_schema)]  # kept as given: key order renders


def _custom_tool(value: Any) -> Any:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in (None, "custom"):
        raise PydanticCustomError(
            "refused", "tool type '{kind}' is not supported (Anthropic's server and client tools are not); "
            "give custom tools: a name, a description and an input_schema", {"kind": str(kind)},
        )
    return value


class AnthropicTool(AnthropicModel):
    name: Annotated[str, Field(pattern=NAME_PATTERN)]
    input_schema: InputSchema
    description: str | None = None
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None
    strict: bool | None = Field(None, description="accepted: calls constrained by a grammar always follow the schema")
    eager_input_streaming: bool | None = Field(None, description="accepted: input is always streamed as generated")

    def definition(self) -> ToolDefinition:
        function = FunctionDefinition(name=self.name, description=self.description, parameters=self.input_schema)
        return ToolDefinition(type="function", function=function)


class ToolChoiceAuto(AnthropicModel):
    type: Literal["auto"]
    disable_parallel_tool_use: bool = False


class ToolChoiceAny(AnthropicModel):
    type: Literal["any"]
    disable_parallel_tool_use: bool = False


class ToolChoiceTool(AnthropicModel):
    type: Literal["tool"]
    name: str
    disable_parallel_tool_use: bool = False


class ToolChoiceNone(AnthropicModel):
    type: Literal["none"]


ToolChoice = Annotated[
    ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone,
    expects("{\"type\": \"auto\"}, {\"type\": \"any\"}, {\"type\": \"tool\", \"name\": ...} or {\"type\": \"none\"}"),
]
MODES = {"auto": "auto", "any": "required", "tool": "named", "none": "none"}


class Conversation(AnthropicModel):
    """What count_tokens and messages share: the model, the conversation and its tools."""

    model: str
    messages: Annotated[list[AnthropicMessage], Field(min_length=1)]
    system: Annotated[str | list[TextBlock], expects("a string or a list of text blocks")] | None = None
    tools: Annotated[list[Annotated[AnthropicTool, BeforeValidator(_custom_tool)]], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    cache_control: CacheControl | None = Field(None, description="accepted: every prefix is cached")
    thinking: Thinking | None = Field(None, description="enabled (with a token budget) or disabled; absent: as "
                                      "the chat template does by default")
    container: Any | None = Field(None, description="not supported")
    mcp_servers: Any | None = Field(None, description="not supported")
    output_config: Any | None = Field(None, description="not supported")
    context_management: Any | None = Field(None, description="not supported")
    inference_geo: Any | None = Field(None, description="not supported")
    speed: Any | None = Field(None, description="not supported")
    diagnostics: Any | None = Field(None, description="not supported")
    user_profile_id: Any | None = Field(None, description="not supported")
    workspace_id: Any | None = Field(None, description="not supported")

    def check_supported(self) -> None:
        for name in REFUSED_FIELDS:
            if getattr(self, name) is not None:
                raise bad_request(f"'{name}' is not supported by this server", param=name)

    def template_kwargs(self) -> dict[str, Any]:
        """`thinking` as the chat template's switch (enable_thinking)."""
        return {} if self.thinking is None else {"enable_thinking": isinstance(self.thinking, ThinkingEnabled)}

    @property
    def thinking_budget(self) -> int | None:
        return self.thinking.budget_tokens if isinstance(self.thinking, ThinkingEnabled) else None

    def cache_marks(self) -> list[tuple[float, list[HistoryMessage]]]:
        """Each cache_control mark: its TTL and the conversation up to the block it marks
        (a tool's mark: up to the end of the system turn, where tools render; the request's
        own mark: the whole conversation)."""
        marks: list[tuple[float, list[HistoryMessage]]] = []
        if any(t.cache_control is not None for t in self.tools or []):
            ttl = max(t.cache_control.ttl_s for t in self.tools or [] if t.cache_control is not None)
            marks.append((ttl, self._system_turns(None)))
        for k, block in enumerate(self.system if isinstance(self.system, list) else []):
            if block.cache_control is not None:
                marks.append((block.cache_control.ttl_s, self._system_turns(k + 1)))
        for i, message in enumerate(self.messages):
            for j, block in enumerate(message.content):
                if block.cache_control is not None:
                    cut = AnthropicMessage(role=message.role, content=message.content[: j + 1])
                    marks.append((block.cache_control.ttl_s, self._turns(self.messages[:i] + [cut])))
        if self.cache_control is not None:
            marks.append((self.cache_control.ttl_s, self.history()))
        return marks

    def _system_turns(self, blocks: int | None) -> list[HistoryMessage]:
        system = self.system if isinstance(self.system, str) else "".join(b.text for b in (self.system or [])[:blocks])
        return [HistoryMessage("system", system)] if system else []

    @property
    def uses_tools(self) -> bool:
        """Tools declared, or a history with calls or results: the chat path's tool-aware rendering."""
        return bool(self.tools) or any(
            isinstance(b, (ToolUseBlock, ToolResultBlock)) for m in self.messages for b in m.content
        )

    def history(self) -> list[HistoryMessage]:
        return self._turns(self.messages)

    def _turns(self, messages: list[AnthropicMessage]) -> list[HistoryMessage]:
        turns = self._system_turns(None)
        for i, message in enumerate(messages):
            turns += message.history(f"messages[{i}]")
        return turns

    def tool_spec(self) -> ToolSpec:
        """The checked tools; their input_schemas compile where the prompt is built."""
        tools = self.tools or []
        seen: dict[str, int] = {}
        for index, tool in enumerate(tools):
            if tool.name in seen:
                raise bad_request(f"'tools[{index}].name': '{tool.name}' is already the name of tools[{seen[tool.name]}]",
                                  param=f"tools[{index}].name")
            seen[tool.name] = index
        params = tuple(f"tools[{i}].input_schema" for i in range(len(tools)))
        definitions = tuple(t.definition() for t in tools)
        choice = self.tool_choice
        if choice is None:
            return ToolSpec(definitions, "auto" if tools else "none", None, True, schema_params=params)
        if choice.type in ("any", "tool") and not tools:
            raise bad_request(f"'tool_choice' '{choice.type}' needs at least one tool in 'tools'", param="tool_choice")
        named = choice.name if isinstance(choice, ToolChoiceTool) else None
        if named is not None and named not in seen:
            raise bad_request(f"'tool_choice.name' is '{named}', which is not among the tools (declared: "
                              f"{', '.join(seen) or 'none'})", param="tool_choice.name")
        parallel = not getattr(choice, "disable_parallel_tool_use", False)
        return ToolSpec(definitions, MODES[choice.type], named, parallel, schema_params=params)


class CountTokensRequest(Conversation):
    """The body of POST /v1/messages/count_tokens."""

    model_config = ConfigDict(json_schema_extra={"examples": [
        {"model": "default", "system": "Be brief.", "messages": [{"role": "user", "content": "Hi"}]},
    ]})


class AnthropicMetadata(AnthropicModel):
    user_id: str | None = None


class MessagesRequest(Conversation):
    """The body of POST /v1/messages."""

    model_config = ConfigDict(json_schema_extra={"examples": [
        {"model": "default", "max_tokens": 8, "messages": [{"role": "user", "content": "What is 17 * 3?"}]},
        {"model": "default", "max_tokens": 8, "system": [{"type": "text", "text": "Be brief."}], "stream": True,
         "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}], "temperature": 0},
    ]})

    max_tokens: Integer = Field(ge=0, description="0: compute (and cache) the prompt, generate nothing")
    temperature: float = Field(1.0, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: Integer | None = Field(None, ge=0, description="0: off")
    stop_sequences: Annotated[list[NonEmptyString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stream: bool = False
    metadata: AnthropicMetadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = Field(None, description="accepted; one tier here")
    session_id: SessionId | None = Field(
        None, description="an extension, as on chat: an agent conversation whose latest context is kept ahead of "
        "other cached prefixes (and, in a cluster, that stays on one replica)"
    )

    def check_continuable(self) -> None:
        if self.messages[-1].role == "assistant":
            where = f"messages[{len(self.messages) - 1}]"
            raise bad_request(f"'{where}': a conversation that ends with an assistant turn (prefill, to be "
                              "continued) is not supported; end it with a user turn", param=where)

    def to_job(self, served: ServedModel, prompt: Prompt) -> GenerationJob:
        model = served.check_model(self.model)
        try:
            params = SamplingParams(
                max_tokens=self.max_tokens, temperature=self.temperature,
                top_p=self.top_p if self.top_p is not None else 1.0, top_k=self.top_k or 0,
                stop=list(self.stop_sequences or []),
            )
        except ValueError as exc:
            raise bad_request(str(exc)) from None
        return GenerationJob(model, [prompt], [params], 1, self.stream, False, session_id=self.session_id)


def parse(model: type[Conversation], body: Any) -> Any:
    """`body` as `model`; a 400 naming the first bad field (block tags left out of its path)."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise _untagged_error(exc) from None


def _untagged_error(exc: ValidationError) -> APIError:
    class Untagged:
        def errors(self, include_url: bool = False) -> list[dict[str, Any]]:
            out = []
            for error in exc.errors(include_url=include_url):
                loc = tuple(p for p in error["loc"] if not (isinstance(p, str) and p.startswith(TAG)))
                out.append({**error, "loc": loc})
            return out

    return validation_error(Untagged())  # type: ignore[arg-type]
