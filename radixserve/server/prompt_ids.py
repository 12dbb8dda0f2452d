"""PromptIds: the token ids of the prompt a generating route's body becomes, without an engine
(the cluster's ingress names a request's KV blocks by them: cluster/request_blocks.py).

A chat-like body goes through its route's own job builder (chat_job, messages_job,
responses_job: the chat template with tools, Anthropic's and the Responses API's
conversions), a completion, /generate or a pin through its request model (the first prompt
of a batch); a conversation is then templated and tokenized by the engine's own prompt builder
(engine/prompt_builder.py, on the tokenizer alone), with the server's own options
(chat template, tool-call parser, reasoning parser). So the ids are the replica's, except where only a replica knows more: the ids of its
own earlier replies that it splices into a conversation re-sending them (--reply-token-reuse;
they differ from the reply's text tokenized again only now and then), and the stored
conversation a Responses request continues (previous_response_id: no ids).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from radixserve.engine.prompt_builder import ChatPrompt, PromptBuilder
from radixserve.server.api.anthropic import messages_job
from radixserve.server.api.chat import chat_job
from radixserve.server.api.responses import responses_job
from radixserve.server.options import ServerOptions
from radixserve.server.protocol import ChatCompletionRequest, CompletionRequest, GenerateRequest, ServedModel, parse
from radixserve.server.protocol.agent_hints import without_hints
from radixserve.server.protocol.jobs import Prompt
from radixserve.server.protocol.responses import ResponsesRequest
from radixserve.server.protocol.sessions import PinPrefixRequest
from radixserve.server.reasoning import Reasoning
from radixserve.server.response_store import ResponseStore
from radixserve.server.tool_calling import ToolCalling

_UNBOUNDED = 1 << 30  # the replica checks n and batch sizes; naming only reads the first prompt


@dataclass(frozen=True)
class PromptTokens:
    token_ids: list[int]
    cache_salt: str | None  # the body's own (the replica adds the caller's namespace)


class PromptIds:
    """One per model and server options; thread-safe as the server's renderers are."""

    def __init__(self, tokenizer: Any, options: ServerOptions | None = None):
        options = options or ServerOptions()
        self.tokenizer = tokenizer
        self.calling = ToolCalling(tokenizer, options.tool_call_parser, options.chat_template,
                                   options.trust_request_chat_template)
        self.reasoning = Reasoning(tokenizer, options.reasoning_parser, options.chat_template)
        # the engine's prompt builder on the tokenizer alone: no context limit (the replica checks it)
        self.builder = PromptBuilder(tokenizer)

    async def of(self, path: str, body: Any) -> PromptTokens | None:
        """The prompt of `body` sent to `path`; None for a path that is not a prompt's, a body
        its route refuses (APIError, InvalidRequest, ...) or a prompt only a replica can render."""
        read = _ROUTES.get(path)
        if read is None:
            return None
        try:
            prompt, salt = await read(self, without_hints(body))
            ids = await asyncio.to_thread(self.token_ids, prompt)
        except Exception:  # the replica answers the body with its own error
            return None
        return PromptTokens(ids, salt) if ids else None

    def token_ids(self, prompt: Prompt) -> list[int]:
        """A job's prompt as the engine prepares it (Engine.build_prompt, Engine.prepare)."""
        if isinstance(prompt, ChatPrompt):
            return self.builder.token_ids(prompt)
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("no tokenizer: only token ids are named")
            return self.tokenizer.encode(prompt)  # as RequestPreparer.prepare tokenizes a text prompt
        return list(prompt)

    # ---- each route's prompt ----------------------------------------------------------

    async def _chat(self, body: Any) -> tuple[Prompt, str | None]:
        request = parse(ChatCompletionRequest, body)
        job, _ = await chat_job(request, _served(request.model), self.calling)
        return job.prompts[0], job.cache_salt

    async def _messages(self, body: Any) -> tuple[Prompt, str | None]:
        job, _ = await messages_job(body, _served(body.get("model")), self.calling, self.reasoning)
        return job.prompts[0], job.cache_salt

    async def _responses(self, body: Any) -> tuple[Prompt, str | None]:
        request = parse(ResponsesRequest, body)
        store = ResponseStore().for_owner(None)  # empty: a previous_response_id is the replica's to read
        job, _ = await responses_job(request, _served(request.model), self.calling, store, None, self.reasoning)
        return job.prompts[0], job.cache_salt

    async def _completions(self, body: Any) -> tuple[Prompt, str | None]:
        request = parse(CompletionRequest, body)
        return request.prompts()[0], request.cache_salt

    async def _generate(self, body: Any) -> tuple[Prompt, str | None]:
        request = parse(GenerateRequest, body)
        return request.prompts()[0][0], request.cache_salt

    async def _pin(self, body: Any) -> tuple[Prompt, str | None]:
        request = parse(PinPrefixRequest, body)
        return request.prompt(), request.cache_salt


def _served(model: Any) -> ServedModel:
    """A served model answering to the body's own name (the replica checks the name)."""
    return ServedModel((model if isinstance(model, str) else "",), _UNBOUNDED, _UNBOUNDED, _UNBOUNDED)


# Every route whose prompt the cluster routes (server/protocol/routed.py's ROUTED), by path.
_ROUTES: dict[str, Callable[[PromptIds, Any], Awaitable[tuple[Prompt, str | None]]]] = {
    "/v1/completions": PromptIds._completions,
    "/v1/chat/completions": PromptIds._chat,
    "/v1/responses": PromptIds._responses,
    "/v1/messages": PromptIds._messages,
    "/generate": PromptIds._generate,
    "/v1/sessions/pin": PromptIds._pin,
}
PATHS = tuple(_ROUTES)
