"""ToolCalling: what the server needs to serve tools for one model: its call format
(--tool-call-parser, or detected from the chat template) and how its prompts render."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Protocol

from radixserve.engine.reply_ids import ReplyLookup, ReplySplicer
from radixserve.server.errors import template_error
from radixserve.server.request_group import ChatPrompt
from radixserve.server.tools.call_format import ToolCallFormat, detect_format, format_named
from radixserve.server.tools.definitions import ToolSpec
from radixserve.server.tools.history import HistoryMessage, check_history
from radixserve.server.tools.rendering import ChatRenderer, fallback_messages
from radixserve.server.tools.grammar import tool_call_structural_tag

Prompt = ChatPrompt | list[int]


class ToolRequest(Protocol):
    """A request body that declares tools (chat, Responses, Anthropic's messages)."""

    tools: Any

    def tool_spec(self) -> ToolSpec: ...


class ToolCalling:
    """One per server. `parser`: a --tool-call-parser value (`auto` detects from the template)."""

    def __init__(self, tokenizer: Any, parser: str = "auto"):
        template = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
        self.fmt: ToolCallFormat = detect_format(template if isinstance(template, str) else None) \
            if parser == "auto" else format_named(parser)
        self.renderer = ChatRenderer(tokenizer, self.fmt)
        self.tokenizer = tokenizer
        self.splicer = ReplySplicer(tokenizer)

    async def spec(self, request: ToolRequest) -> ToolSpec:
        """The request's checked tools. Checking compiles each tool's schema: with tools it
        runs on a worker thread, off the event loop."""
        return await asyncio.to_thread(request.tool_spec) if request.tools else request.tool_spec()

    async def prompt(
        self, history: list[HistoryMessage], spec: ToolSpec, replies: ReplyLookup | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> Prompt:
        """The prompt of a conversation with tools. The fallback rendering is plain messages,
        templated where every chat prompt is; a template that knows tools is rendered here
        (with `tools=`), on a worker thread, into token ids. `replies`: stored reply ids to
        splice in (engine/reply_ids.py)."""
        check_history(history)
        if not self.renderer.native:
            return ChatPrompt(tuple(fallback_messages(history, list(spec.tools), self.fmt)), replies, template_kwargs)
        try:
            return await asyncio.to_thread(self._native_ids, history, spec, replies, template_kwargs)
        except Exception as exc:
            if (refused := template_error(exc)) is not None:
                raise refused from None
            raise

    def constraint(self, spec: ToolSpec) -> dict[str, Any]:
        """SamplingParams fields that make the calls parse (none for `none`)."""
        tag = tool_call_structural_tag(spec, self.fmt)
        return {"structural_tag": tag} if tag is not None else {}

    def _native_ids(
        self, history: list[HistoryMessage], spec: ToolSpec, replies: ReplyLookup | None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        text = self.renderer.render(history, list(spec.tools), template_kwargs)
        return self.splicer.encode(text, replies)


@dataclass(frozen=True)
class ToolOutput:
    """How a response reads calls out of generated text (None in a responder: no tools)."""

    spec: ToolSpec
    fmt: ToolCallFormat
