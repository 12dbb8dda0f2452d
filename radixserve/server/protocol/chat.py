"""POST /v1/chat/completions: the request body and the job it becomes.

Fields the OpenAI API has but this server does not implement are refused when they would
change the answer (logit_bias, non-text content parts, audio, the legacy
functions/function_call, any field it does not know) and ignored when they would not (store,
metadata, user, service_tier...: sampling.NO_EFFECT_FIELDS). Tools: see radixserve/tools/.
`chat_template_kwargs` and `reasoning_effort` reach the chat template (template_args.py).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field

from radixserve.server.errors import bad_request
from radixserve.server.protocol.common import Integer, OpenAIModel, ServedModel, expects
from radixserve.server.protocol.jobs import GenerationJob
from radixserve.server.protocol.sampling import Logprobs, OpenAISamplingFields, TokenId
from radixserve.server.protocol.template_args import ReasoningEffort, template_kwargs
from radixserve.engine.prompt_builder import ChatPrompt
from radixserve.tools.definitions import ToolChoice, ToolList, ToolSpec, tool_spec
from radixserve.tools.history import HistoryCall, HistoryMessage

Role = Literal["system", "developer", "user", "assistant", "tool"]


class ContentPart(OpenAIModel):
    """One part of a message's content; only {"type": "text", "text": ...} is supported."""

    type: str
    text: str | None = None


class FunctionCallParam(OpenAIModel):
    name: str
    arguments: str = Field(description="the call's arguments as a JSON text")


class ToolCallParam(OpenAIModel):
    """A call an assistant message made (as the API returned it)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallParam


class ChatMessage(OpenAIModel):
    role: Role
    content: Annotated[str | list[ContentPart], expects("a string or a list of text parts")] | None = Field(
        None, description="may be absent only for an assistant message"
    )
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = Field(None, description="an assistant message's calls")
    tool_call_id: str | None = Field(None, description="a tool message: the call it answers")
    reasoning_content: str | None = Field(None, description="an assistant message's reasoning, as answers carry it")
    reasoning: str | None = Field(None, description="vLLM's newer name of reasoning_content")

    def history_entry(self, where: str) -> HistoryMessage:
        """The message as the tool-aware renderer sees it."""
        if self.tool_calls and self.role != "assistant":
            raise bad_request(f"'{where}.tool_calls' is only allowed on assistant messages", param=f"{where}.tool_calls")
        calls = tuple(
            HistoryCall(c.id, c.function.name, c.function.arguments, f"{where}.tool_calls[{j}].function.arguments")
            for j, c in enumerate(self.tool_calls or [])
        )
        content = self._text(where) if self.content is not None or self.role != "assistant" else None
        role = "system" if self.role == "developer" else self.role
        return HistoryMessage(role, content, calls, self.tool_call_id, self.name, f"{where}.tool_call_id",
                              self._reasoning(where))

    def template_entry(self, where: str) -> dict[str, str]:
        """{"role", "content"} for the chat template ("developer" counts as "system")."""
        entry = {"role": "system" if self.role == "developer" else self.role, "content": self._text(where)}
        if (reasoning := self._reasoning(where)) is not None:
            entry["reasoning_content"] = reasoning
        return entry

    def _reasoning(self, where: str) -> str | None:
        """An assistant message's reasoning sent back (reasoning_content, or vLLM's newer `reasoning`)."""
        if self.reasoning_content is not None and self.reasoning is not None and self.reasoning_content != self.reasoning:
            raise bad_request(f"'{where}.reasoning' and '{where}.reasoning_content' disagree", param=f"{where}.reasoning")
        reasoning = self.reasoning_content if self.reasoning_content is not None else self.reasoning
        if reasoning is not None and self.role != "assistant":
            raise bad_request(f"'{where}.reasoning_content' is only allowed on assistant messages",
                              param=f"{where}.reasoning_content")
        return reasoning

    def _text(self, where: str) -> str:
        if isinstance(self.content, str):
            return self.content
        if self.content is None:
            if self.role == "assistant":
                return ""
            raise bad_request(f"'{where}.content' must be a string or a list of text parts", param=f"{where}.content")
        pieces = []
        for i, part in enumerate(self.content):
            here = f"{where}.content[{i}]"
            if part.type != "text":
                raise bad_request(f"'{here}': content part type '{part.type}' is not supported; only text parts are",
                                  param=here)
            if part.text is None:
                raise bad_request(f"'{here}': a text part needs a string 'text'", param=here)
            pieces.append(part.text)
        return "".join(pieces)


class JsonSchemaFormat(OpenAIModel):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIModel):
    """{"type": "text" | "json_object" | "json_schema", "json_schema": {"name", "schema", "strict"}}."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def constraint(self) -> dict[str, Any]:
        """The SamplingParams constraint this format asks for."""
        if self.type == "json_object":
            return {"json_object": True}
        if self.type == "json_schema":
            if self.json_schema is None:
                raise bad_request("response_format 'json_schema' needs a 'json_schema' object", param="response_format")
            return {"json_schema": self.json_schema.schema_ or {}}
        return {}


class ChatCompletionRequest(OpenAISamplingFields):
    """The body of POST /v1/chat/completions."""

    model_config = ConfigDict(json_schema_extra={"examples": [
        {"model": "default", "messages": [{"role": "user", "content": "What is 17 * 3?"}], "max_tokens": 8},
        {"model": "default", "messages": [{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
         "max_completion_tokens": 4, "stream": True, "stream_options": {"include_usage": True}},
    ]})

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Integer | None = Field(None, ge=1, description="default: up to the model's context")
    max_tokens: Integer | None = Field(None, ge=1, description="the older name of max_completion_tokens")
    logprobs: bool = False
    top_logprobs: Logprobs | None = None
    response_format: ResponseFormat | None = None
    tools: ToolList | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    modalities: list[Literal["text"]] | None = Field(None, description="text only (audio output is refused)")
    functions: list[Any] | None = Field(None, description="legacy: refused; use tools")
    function_call: Any | None = Field(None, description="legacy: refused; use tool_choice")
    prompt_token_ids: list[TokenId] | None = Field(
        None, description="the prompt's token ids, used as given in place of the rendered messages (tools and "
                          "reasoning still read the answer)")
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="more arguments for the chat template (e.g. {\"enable_thinking\": false})")
    reasoning_effort: ReasoningEffort | None = Field(None, description="passed to the chat template")
    chat_template: str | None = Field(None, description="a Jinja chat template in place of the server's (vLLM's "
                                                        "field; needs --trust-request-chat-template)")
    thinking_token_budget: Integer | None = Field(
        None, ge=1, description="vLLM's extension: at most this many reasoning tokens, then the block is closed")

    def template_kwargs(self) -> dict[str, Any]:
        """The checked arguments this request passes to the chat template."""
        return template_kwargs(self.chat_template_kwargs, self.reasoning_effort)

    @property
    def uses_tools(self) -> bool:
        """Tools declared, or a history with calls or tool results: the tool-aware rendering."""
        return bool(self.tools) or any(m.tool_calls or m.role == "tool" for m in self.messages)

    def tool_spec(self) -> ToolSpec:
        for legacy, new in (("functions", "tools"), ("function_call", "tool_choice")):
            if getattr(self, legacy) is not None:
                raise bad_request(f"'{legacy}' (deprecated by OpenAI) is not supported; use '{new}'", param=legacy)
        return tool_spec(self.tools, self.tool_choice, self.parallel_tool_calls, compile=False)

    def history(self) -> list[HistoryMessage]:
        return [m.history_entry(f"messages[{i}]") for i, m in enumerate(self.messages)]

    def to_job(self, served: ServedModel, prompt: ChatPrompt | None = None, calls: bool = False) -> GenerationJob:
        """`prompt` comes from the tool-aware path when the request uses tools (otherwise the
        messages are templated as they are); `calls`: the tools constrain the answer (their
        grammar joins the params where the prompt is built)."""
        model = served.check_model(self.model)
        if prompt is None:
            prompt = ChatPrompt(tuple(m.template_entry(f"messages[{i}]") for i, m in enumerate(self.messages)))
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        served.check_group(1, self.n, "messages")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        formatted = self.response_format.constraint() if self.response_format is not None else {}
        if calls and formatted:
            raise bad_request("'response_format' cannot be combined with tool calls; set tool_choice 'none' "
                              "to constrain the text instead", param="response_format")
        params = self.sampling_params(served, max_tokens, logprobs, **formatted)
        stream, include_usage = self.stream_flags()
        return GenerationJob(
            model, [prompt], self.samples(params), self.n, stream, include_usage, False, logprobs, self.cache_salt,
            session_id=self.session_id, return_token_ids=self.return_token_ids,
        )
