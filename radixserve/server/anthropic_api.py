"""Anthropic's Messages API, a third spelling of the chat path: POST /v1/messages and
POST /v1/messages/count_tokens (see radixserve/server/protocol/anthropic.py for the
fields). The conversation renders through the same ToolCalling as chat completions, tool
calls are constrained by the same grammar and read back by the same parser, so a
conversation renders to the same tokens whichever API sent it (and hits the same cache)."""

from __future__ import annotations

import asyncio
from typing import Any

from radixserve.server.anthropic_output import MessagesResponder
from radixserve.server.errors import template_error
from radixserve.server.protocol.anthropic import Conversation, CountTokensRequest, MessagesRequest, parse
from radixserve.server.protocol.common import ServedModel
from radixserve.server.protocol.jobs import GenerationJob, Prompt
from radixserve.server.request_group import ChatPrompt
from radixserve.server.tools.definitions import ToolSpec
from radixserve.server.tools.parser import ToolCallParser
from radixserve.server.tools.serving import ToolCalling


async def messages_job(body: Any, served: ServedModel, calling: ToolCalling) -> tuple[GenerationJob, MessagesResponder]:
    """The engine job of a /v1/messages body and the responder that answers it."""
    request: MessagesRequest = parse(MessagesRequest, body)
    request.check_continuable()
    spec, prompt = await _prompt(request, calling)
    job = request.to_job(served, prompt, calling.constraint(spec))
    parser = ToolCallParser(calling.fmt, spec.names) if spec.parses_calls else None
    return job, MessagesResponder(job, parser, list(request.stop_sequences or []))


async def count_tokens(body: Any, served: ServedModel, calling: ToolCalling, engine: Any) -> dict[str, Any]:
    """{"input_tokens": n}: the prompt a /v1/messages request with this conversation would have."""
    request: CountTokensRequest = parse(CountTokensRequest, body)
    served.check_model(request.model)
    _, prompt = await _prompt(request, calling)
    if isinstance(prompt, ChatPrompt):
        try:
            prompt = await asyncio.to_thread(engine.apply_chat_template, list(prompt.messages))
        except Exception as exc:
            if (refused := template_error(exc)) is not None:
                raise refused from None
            raise
    return {"input_tokens": len(prompt)}


async def _prompt(request: Conversation, calling: ToolCalling) -> tuple[ToolSpec, Prompt]:
    """As chat completions builds it: plain role/content turns without tools, else the
    tool-aware rendering (which checks that every result answers an earlier call)."""
    request.check_supported()
    spec = await asyncio.to_thread(request.tool_spec) if request.tools else request.tool_spec()  # compiles schemas
    history = request.history()
    if not request.uses_tools:
        return spec, ChatPrompt(tuple({"role": m.role, "content": m.content or ""} for m in history))
    return spec, await calling.prompt(history, spec)
