"""RoutedRequest: what a request to a generating route is keyed by in front of several
replicas (radixserve/cluster/routing_key.py), read with the same request models the replica
parses, so the key follows what the replica will render.

A chat-like request (chat completions, Responses, Anthropic messages) is keyed by its tools
and the conversation as the renderer sees it (HistoryMessage turns), so one conversation has
one key whichever API sent it, as it has one rendering; a completion or a native request by
its (first) prompt. A body the model refuses has no key: the replica answers it with its own
error.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from radixserve.request_error import InvalidRequest
from radixserve.server.errors import APIError
from radixserve.server.protocol.agent_hints import without_hints
from radixserve.server.protocol.anthropic import MessagesRequest
from radixserve.server.protocol.chat import ChatCompletionRequest
from radixserve.server.protocol.completions import CompletionRequest
from radixserve.server.protocol.generate import GenerateRequest
from radixserve.server.protocol.responses import ResponsesRequest, input_history
from radixserve.server.protocol.sessions import PinPrefixRequest
from radixserve.tools.definitions import ToolDefinition
from radixserve.tools.history import HistoryMessage

Prompt = str | tuple[int, ...]


@dataclass(frozen=True)
class RoutedRequest:
    prompt: Prompt  # text that shares a prefix wherever the rendered prompts do, or token ids
    session_id: str | None = None  # the client's session (not yet led by its tenant)
    cache_salt: str | None = None
    previous_response_id: str | None = None  # a Responses request continuing a stored response


def routed_request(path: str, body: Any) -> RoutedRequest | None:
    """The routed view of `body` (parsed JSON) sent to `path`; None for a path that is not
    routed by prompt or a body its request model refuses."""
    read = ROUTED.get(path)
    if read is None:
        return None
    try:
        return read(without_hints(body))
    except (ValidationError, APIError, InvalidRequest):
        return None


def conversation_text(tools: Sequence[ToolDefinition], history: Sequence[HistoryMessage]) -> str:
    """The tools, then each turn (role, content, calls), separated by control characters no
    client text is split by; every turn ends with a separator, so a longer conversation's
    text starts with a shorter one's."""
    parts = [_json([t.template_entry() for t in tools])] if tools else []
    for message in history:
        parts.append(f"{message.role}\x1e{message.content or ''}")
        if message.tool_calls:
            parts.append(_json([[c.name, c.arguments] for c in message.tool_calls]))
    return "\x1f".join(parts) + "\x1f"


def _chat(body: Any) -> RoutedRequest:
    request = ChatCompletionRequest.model_validate(body)
    prompt = conversation_text(request.tools or [], request.history())
    return RoutedRequest(prompt, request.session_id, request.cache_salt)


def _messages(body: Any) -> RoutedRequest:
    request = MessagesRequest.model_validate(body)
    prompt = conversation_text([t.definition() for t in request.tools or []], request.history())
    return RoutedRequest(prompt, request.session_id)


def _responses(body: Any) -> RoutedRequest:
    request = ResponsesRequest.model_validate(body)
    head = [HistoryMessage("system", request.instructions)] if request.instructions else []
    tools = [t.definition() for t in request.tools or []]
    return RoutedRequest(conversation_text(tools, head + input_history(request.input)),
                         previous_response_id=request.previous_response_id)


def _completions(body: Any) -> RoutedRequest:
    request = CompletionRequest.model_validate(body)
    return RoutedRequest(_prompt(request.prompts()[0]), request.session_id, request.cache_salt)


def _generate(body: Any) -> RoutedRequest:
    request = GenerateRequest.model_validate(body)
    return RoutedRequest(_prompt(request.prompts()[0][0]), request.session_id, request.cache_salt)


def _pin(body: Any) -> RoutedRequest:
    """A pinned prefix goes where the requests that start with it will."""
    request = PinPrefixRequest.model_validate(body)
    return RoutedRequest(_prompt(request.prompt()), cache_salt=request.cache_salt)


def _prompt(prompt: str | list[int]) -> Prompt:
    return prompt if isinstance(prompt, str) else tuple(prompt)


def _json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False)


# Every route that generates (or pins what generation will reuse), by path.
ROUTED: dict[str, Callable[[Any], RoutedRequest]] = {
    "/v1/completions": _completions,
    "/v1/chat/completions": _chat,
    "/v1/responses": _responses,
    "/v1/messages": _messages,
    "/generate": _generate,
    "/v1/sessions/pin": _pin,
}
