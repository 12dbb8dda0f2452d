"""ToolCalling: what the server needs to serve tools for one model: the chat template in force
(--chat-template, a request's `chat_template` when trusted, else the model's own) and its call
format (--tool-call-parser, or `auto`: detected from that template). A request's conversation
becomes a ChatPrompt, which the engine's PromptBuilder (engine/prompt_builder.py) builds into
token ids and the calls' grammar on a prepare worker, one hop from the event loop."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Protocol

from radixserve.engine.prompt_builder import ChatPrompt
from radixserve.engine.reply_ids import ReplyLookup
from radixserve.server.chat_template import check_chat_template
from radixserve.server.errors import bad_request
from radixserve.tools.call_format import ToolCallFormat
from radixserve.tools.definitions import ToolSpec
from radixserve.tools.formats import format_named
from radixserve.tools.history import HistoryMessage
from radixserve.tools.rendering import ChatRenderer, own_template

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
        derived._derived = {}
        return derived

    def spec(self, request: ToolRequest) -> ToolSpec:
        """The request's checked tools (names and tool_choice; their schemas compile where the
        prompt is built, on a prepare worker)."""
        return request.tool_spec()

    def prompt(
        self, history: list[HistoryMessage], spec: ToolSpec, replies: ReplyLookup | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> ChatPrompt:
        """The prompt of a conversation with tools (rendered tool-aware where it is built).
        `replies`: stored reply ids to splice in (engine/reply_ids.py)."""
        return ChatPrompt(tuple(history), spec, self.renderer, replies, template_kwargs)

    def given(self, token_ids: list[int], spec: ToolSpec) -> ChatPrompt:
        """The client's own prompt ids; the tools still constrain and parse the answer."""
        return ChatPrompt((), spec, self.renderer, token_ids=tuple(token_ids))


@dataclass(frozen=True)
class ToolOutput:
    """How a response reads calls out of generated text (None in a responder: no tools)."""

    spec: ToolSpec
    fmt: ToolCallFormat
