"""ToolCalling: what the server needs to serve tools for one model: the chat template in force
(--chat-template, a request's `chat_template`, else the model's own), its call format
(--tool-call-parser, or `auto`: detected from that template) and how its prompts render."""

from __future__ import annotations

import asyncio
import copy
from dataclasses import dataclass
from typing import Any, Protocol

from radixserve.engine.reply_ids import ReplyLookup, ReplySplicer
from radixserve.server.chat_template import check_chat_template
from radixserve.server.errors import bad_request, template_error
from radixserve.server.request_group import ChatPrompt
from radixserve.tools.call_format import ToolCallFormat
from radixserve.tools.formats import format_named
from radixserve.tools.definitions import ToolSpec
from radixserve.tools.history import HistoryMessage, check_history
from radixserve.tools.rendering import ChatRenderer, fallback_messages, own_template
from radixserve.tools.grammar import tool_call_structural_tag

Prompt = ChatPrompt | list[int]
MAX_REQUEST_TEMPLATES = 16  # requests' own templates kept ready (their formats detected)


class ToolRequest(Protocol):
    """A request body that declares tools (chat, Responses, Anthropic's messages)."""

    tools: Any

    def tool_spec(self) -> ToolSpec: ...


class ToolCalling:
    """One per server. `parser`: a --tool-call-parser value (`auto` detects from the template);
    `chat_template`: --chat-template's text (None: the model's own template);
    `trust_request_templates`: whether a request may bring its own `chat_template`."""

    def __init__(self, tokenizer: Any, parser: str = "auto", chat_template: str | None = None,
                 trust_request_templates: bool = False):
        self.parser = parser
        self.template = chat_template  # None: the model's own, which the engine renders with
        self.fmt: ToolCallFormat = format_named(parser, chat_template or own_template(tokenizer))
        self.renderer = ChatRenderer(tokenizer, self.fmt, chat_template)
        self.tokenizer = tokenizer
        self.splicer = ReplySplicer(tokenizer, chat_template)
        self.trust_request_templates = trust_request_templates
        self._derived: dict[str, ToolCalling] = {}

    def for_template(self, template: str | None, param: str = "chat_template") -> ToolCalling:
        """This server's tool calling under a request's own template (None: this one). The
        format follows the template when the parser is `auto`."""
        if template is None or template == self.template:
            return self
        if not self.trust_request_templates:
            raise bad_request(f"'{param}' is refused: this server does not take chat templates from requests "
                              "(start it with --trust-request-chat-template)", param=param)
        if template not in self._derived:
            try:
                check_chat_template(template, f"'{param}'")
            except ValueError as exc:
                raise bad_request(str(exc), param=param) from None
            while len(self._derived) >= MAX_REQUEST_TEMPLATES:
                self._derived.pop(next(iter(self._derived)))
            self._derived[template] = self._under(template)
        return self._derived[template]

    def _under(self, template: str) -> ToolCalling:
        derived = copy.copy(self)
        derived.template = template
        derived.fmt = format_named(self.parser, template)
        derived.renderer = ChatRenderer(self.tokenizer, derived.fmt, template)
        derived.splicer = ReplySplicer(self.tokenizer, template)
        derived._derived = {}
        return derived

    async def spec(self, request: ToolRequest) -> ToolSpec:
        """The request's checked tools. Checking compiles each tool's schema: with tools it
        runs on a worker thread, off the event loop."""
        return await asyncio.to_thread(request.tool_spec) if request.tools else request.tool_spec()

    async def prompt(
        self, history: list[HistoryMessage], spec: ToolSpec, replies: ReplyLookup | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> Prompt:
        """The prompt of a conversation with tools. The fallback rendering under the model's own
        template is plain messages, templated where every chat prompt is; a template that knows
        tools (with `tools=`), or any template other than the model's own (--chat-template, a
        request's), is rendered here, on a worker thread, into token ids. `replies`: stored reply ids to
        splice in (engine/reply_ids.py)."""
        check_history(history)
        if not self.renderer.native and self.template is None:
            return ChatPrompt(tuple(fallback_messages(history, list(spec.tools), self.fmt)), replies, template_kwargs)
        try:
            return await asyncio.to_thread(self._native_ids, history, spec, replies, template_kwargs)
        except Exception as exc:
            if (refused := template_error(exc)) is not None:
                raise refused from None
            raise

    def constraint(self, spec: ToolSpec) -> dict[str, Any]:
        """SamplingParams fields that make the calls parse (none for `none`); where the format's
        markers are special tokens of the model (Mistral's [TOOL_CALLS], harmony's channels...),
        they stay in the text the parser reads."""
        tag = tool_call_structural_tag(spec, self.fmt)
        if tag is None:
            return {}
        return {"structural_tag": tag, **({"skip_special_tokens": False} if self._special_markers() else {})}

    def _special_markers(self) -> bool:
        special = set(getattr(self.tokenizer, "all_special_tokens", None) or ())
        decoder = getattr(self.tokenizer, "added_tokens_decoder", None) or {}
        special |= {token.content for token in decoder.values() if getattr(token, "special", False)}
        return any(marker in special for marker in self.fmt.markers)

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
