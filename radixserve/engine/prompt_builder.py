"""PromptBuilder: the one place a chat prompt is built.

A conversation, its tools and tool_choice, the chat template in force and the template's
arguments go in; the prompt's token ids and the constraint that makes the calls parse come
out (with a reasoning block, when the answer reasons, ahead of that constraint), in one call
on whatever thread prepares requests: the server's prepare pool (one hop from its event
loop, for chat completions, Anthropic's messages and Responses alike), the caller's thread
for `Engine.chat` and `Engine.generate` with tools.

Rendering (see tools/rendering.py):

- plain turns (dicts as the template takes them) through the model's own template;
- turns with tools (HistoryMessage) through a template that knows tools (`tools=`, calls as
  `tool_calls`, results as `tool` turns), or any template other than the model's own; else
  the fallback: plain messages carrying the tools, calls and results as text, through the
  model's own template;
- given token ids (a trainer's prompt) as they are: the tools still constrain the answer.

Stored reply ids are spliced in where the conversation re-sends a reply (reply_ids.py).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from radixserve.engine.reply_ids import ReplyLookup, ReplySplicer
from radixserve.request_error import InvalidRequest
from radixserve.sampling_params import SamplingParams
from radixserve.tools.call_format import ToolCallFormat
from radixserve.tools.definitions import NO_TOOLS, ToolSpec
from radixserve.tools.formats import format_named
from radixserve.tools.grammar import tool_constraint
from radixserve.tools.history import HistoryMessage, check_history, history_of
from radixserve.tools.rendering import ChatRenderer, fallback_messages, own_template

if TYPE_CHECKING:
    from radixserve.reasoning.mode import ReasoningMode

MAX_TEMPLATES = 16  # other templates' reply splicers kept (--chat-template, requests' own)


@dataclass(frozen=True, eq=False)
class ChatPrompt:
    """A conversation to build into a prompt (compared by identity: the n samples of one
    request share one ChatPrompt, built once).

    `messages`: dicts as the template takes them (no tools), or HistoryMessage turns
    (rendered with `tools`); `tools`: the checked tools and tool_choice (their schemas compile
    where the prompt is built); `renderer`: the chat template in force and the call format it
    speaks (None: the model's own template and the format detected from it); `replies`: the
    caller's stored reply ids, spliced in; `template_kwargs`: more arguments for the template;
    `reasoning`: how the answer reasons (its block goes ahead of the constraint); `token_ids`:
    given ids in place of the rendered messages."""

    messages: tuple[Any, ...] = ()
    tools: ToolSpec = NO_TOOLS
    renderer: ChatRenderer | None = None
    replies: ReplyLookup | None = None
    template_kwargs: dict[str, Any] | None = None
    reasoning: ReasoningMode | None = None
    token_ids: tuple[int, ...] | None = None

    @property
    def with_tools(self) -> bool:
        """Its turns render tool-aware (HistoryMessage turns)."""
        return bool(self.messages) and isinstance(self.messages[0], HistoryMessage)

    def with_reply(self, text: str) -> ChatPrompt:
        """The conversation with `text` as the next assistant turn (and no given ids)."""
        reply: Any = HistoryMessage("assistant", text) if self.with_tools else {"role": "assistant", "content": text}
        return replace(self, messages=self.messages + (reply,), token_ids=None, reasoning=None)


@dataclass(frozen=True)
class BuiltPrompt:
    """A built prompt: its token ids, the SamplingParams fields that constrain the answer
    (the calls' structural tag; special tokens kept where the format's markers are special
    tokens), the checked tools with their grammars and the call format that reads calls back."""

    token_ids: list[int]
    constraint: dict[str, Any]
    tools: ToolSpec
    fmt: ToolCallFormat
    reasoning: ReasoningMode | None = None

    def params(self, params: SamplingParams) -> SamplingParams:
        """`params` with the tool calls' constraint, then the reasoning block ahead of it."""
        if self.constraint:
            params = replace(params, **self.constraint)
        return self.reasoning.apply(params) if self.reasoning is not None else params


class PromptBuilder:
    """Builds ChatPrompts for one tokenizer; thread-safe (it only reads, but for a small cache
    of other templates' reply splicers). `check_chars(text, what)`: refuses a text too long
    for the context before it is tokenized (the engine's RequestPreparer.check_chars); a
    builder on the tokenizer alone (the cluster's ingress) checks none."""

    def __init__(self, tokenizer: Any, model_name: str = "the model",
                 check_chars: Callable[[str, str], None] | None = None):
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.check_chars = check_chars or (lambda text, what: None)
        self.splicer = ReplySplicer(tokenizer)  # the model's own template
        template = own_template(tokenizer)
        self.renderer = ChatRenderer(tokenizer, format_named("auto", template), None)
        self._splicers: OrderedDict[str, ReplySplicer] = OrderedDict()
        self._lock = threading.Lock()

    def renderer_for(self, template: str | None = None, parser: str = "auto") -> ChatRenderer:
        """The renderer of a chat template (None: the model's own) and a call format
        (--tool-call-parser's names; `auto`: the format the template speaks of)."""
        if template is None and parser == "auto":
            return self.renderer
        fmt = format_named(parser, template if template is not None else own_template(self.tokenizer))
        return ChatRenderer(self.tokenizer, fmt, template)

    def chat_token_ids(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, replies: ReplyLookup | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of plain turns through the model's own chat template; `replies`: the
        model's own ids for its earlier replies (see reply_ids.py)."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"model {self.model_name} has no chat template: serve it with --chat-template FILE, "
                             f"or send the text to the completions API")
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **(template_kwargs or {}))
        self.check_chars(text, "the conversation")
        return self.splicer.encode(text, replies)

    def chat_prompt(
        self, prompt: Any, tools: ToolSpec | None = None, renderer: ChatRenderer | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> ChatPrompt | None:
        """The ChatPrompt of an `Engine.generate` / `Engine.chat` prompt: a conversation (a
        list of message dicts) renders through the template, tool-aware where it has tools,
        tool turns or a template other than the model's own; a text or token ids with `tools`
        is used as it is (the answer still constrained and read for calls). None: a text or
        token ids without tools, a plain prompt."""
        if isinstance(prompt, ChatPrompt):
            return prompt
        if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
            messages = list(prompt)
            tool_turns = any(m.get("tool_calls") or m.get("role") == "tool" for m in messages)
            if tools is not None or tool_turns or (renderer is not None and renderer.template is not None):
                return ChatPrompt(tuple(history_of(messages)), tools or NO_TOOLS, renderer, None, template_kwargs)
            return ChatPrompt(tuple(messages), template_kwargs=template_kwargs)
        if tools is None:
            return None
        if isinstance(prompt, str):
            if not prompt or self.tokenizer is None:
                raise ValueError("prompt is empty" if not prompt else "this model has no tokenizer: give token ids")
            self.check_chars(prompt, "prompt")
            prompt = self.tokenizer.encode(prompt)
        return ChatPrompt(tools=tools, renderer=renderer, token_ids=tuple(prompt))

    def build(self, prompt: ChatPrompt) -> BuiltPrompt:
        """The prompt's token ids and constraint. Raises ValueError (an InvalidRequest naming
        the field where one is at fault) for a prompt that cannot be built."""
        renderer = prompt.renderer or self.renderer
        spec = prompt.tools.compiled() if prompt.tools.parses_calls else prompt.tools
        ids = self.token_ids(prompt)
        return BuiltPrompt(ids, self.constraint(spec, renderer.fmt), spec, renderer.fmt, prompt.reasoning)

    def token_ids(self, prompt: ChatPrompt) -> list[int]:
        """The prompt's token ids alone (what `build` gives, without compiling a grammar)."""
        if prompt.token_ids is not None:
            return list(prompt.token_ids)
        if prompt.with_tools:
            return self._tool_aware(list(prompt.messages), prompt.tools, prompt.renderer or self.renderer, prompt)
        return self.chat_token_ids(list(prompt.messages), True, prompt.replies, prompt.template_kwargs)

    def constraint(self, spec: ToolSpec, fmt: ToolCallFormat) -> dict[str, Any]:
        """SamplingParams fields that make the calls parse (tools/grammar.py)."""
        return tool_constraint(spec, fmt, self.tokenizer)

    def _tool_aware(
        self, history: list[HistoryMessage], spec: ToolSpec, renderer: ChatRenderer, prompt: ChatPrompt,
    ) -> list[int]:
        check_history(history)
        if not renderer.native and renderer.template is None:  # the fallback, through the model's own template
            messages = fallback_messages(history, list(spec.tools), renderer.fmt)
            return self.chat_token_ids(messages, True, prompt.replies, prompt.template_kwargs)
        try:
            text = renderer.render(history, list(spec.tools), prompt.template_kwargs)
        except Exception as exc:
            if isinstance(exc, (ValueError, TypeError)) or type(exc).__module__.startswith("jinja2"):
                raise InvalidRequest(f"the chat template could not render these messages: {exc}",
                                     param="messages") from None
            raise
        self.check_chars(text, "the conversation")
        return self._splicer(renderer.template).encode(text, prompt.replies)

    def _splicer(self, template: str | None) -> ReplySplicer:
        if template is None:
            return self.splicer
        with self._lock:
            splicer = self._splicers.get(template)
            if splicer is None:
                while len(self._splicers) >= MAX_TEMPLATES:
                    self._splicers.popitem(last=False)
                splicer = self._splicers[template] = ReplySplicer(self.tokenizer, template)
            self._splicers.move_to_end(template)
            return splicer
