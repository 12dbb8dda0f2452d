"""POST /v1/chat/completions: the request body and the job it becomes.

Fields the OpenAI API has but this server does not implement are refused when they would
change the answer (tools, logit_bias, non-text content parts) and ignored when they would
not (store, metadata, user, service_tier...).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from radixserve.server.errors import bad_request
from radixserve.server.protocol.common import OpenAIModel, ServedModel, expects
from radixserve.server.protocol.jobs import GenerationJob
from radixserve.server.protocol.sampling import Logprobs, OpenAISamplingFields
from radixserve.server.request_group import ChatPrompt

Role = Literal["system", "developer", "user", "assistant", "tool"]


class ContentPart(OpenAIModel):
    """One part of a message's content; only {"type": "text", "text": ...} is supported."""

    type: str
    text: str | None = None


class ChatMessage(OpenAIModel):
    role: Role
    content: Annotated[str | list[ContentPart], expects("a string or a list of text parts")] | None = Field(
        None, description="may be absent only for an assistant message"
    )
    name: str | None = None

    def template_entry(self, where: str) -> dict[str, str]:
        """{"role", "content"} for the chat template ("developer" counts as "system")."""
        return {"role": "system" if self.role == "developer" else self.role, "content": self._text(where)}

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

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: int | None = Field(None, ge=1, description="default: up to the model's context")
    max_tokens: int | None = Field(None, ge=1, description="the older name of max_completion_tokens")
    logprobs: bool = False
    top_logprobs: Logprobs | None = None
    response_format: ResponseFormat | None = None
    tools: list[Any] | None = Field(None, description="not supported: must be absent or empty")
    tool_choice: Annotated[str | dict[str, Any], expects("a string or an object")] | None = Field(
        None, description="only 'none' and 'auto' are supported"
    )

    def to_job(self, served: ServedModel) -> GenerationJob:
        model = served.check_model(self.model)
        prompt = ChatPrompt(tuple(m.template_entry(f"messages[{i}]") for i, m in enumerate(self.messages)))
        if self.tools:
            raise bad_request("'tools' (function calling) is not supported by this server", param="tools")
        if self.tool_choice not in (None, "none", "auto"):
            raise bad_request("'tool_choice' other than 'none' or 'auto' is not supported", param="tool_choice")
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        served.check_group(1, self.n, "messages")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        constraint = self.response_format.constraint() if self.response_format is not None else {}
        params = self.sampling_params(served, max_tokens, logprobs, **constraint)
        stream, include_usage = self.stream_flags()
        return GenerationJob(
            model, [prompt], self.samples(params), self.n, stream, include_usage, False, logprobs, self.cache_salt
        )
