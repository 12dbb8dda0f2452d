"""Reasoning: what the server needs to read reasoning for one model: its parser
(--reasoning-parser, or `auto` from the chat template in force: --chat-template, a request's
own, else the model's) and, per request, the ReasoningMode its template arguments call for."""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import replace
from typing import Any

from radixserve.engine.prompt_builder import ChatPrompt
from radixserve.server.errors import bad_request
from radixserve.server.protocol.jobs import GenerationJob
from radixserve.reasoning.base import ReasoningParser
from radixserve.reasoning.mode import ReasoningMode
from radixserve.reasoning.registry import detect_parser, parser_named, probe

THINKING_SWITCHES = ("enable_thinking", "thinking")  # the template arguments that turn thinking off
MAX_REQUEST_TEMPLATES = 16  # requests' own templates kept ready (their parsers detected)
MAX_KEPT_KEY_CHARS = 4096  # template arguments longer than this (as JSON) are probed each time


class Reasoning:
    """One per server. `parser`: a --reasoning-parser value (`auto`: from the template, `none`:
    off); `chat_template`: --chat-template's text (None: the model's own template)."""

    def __init__(self, tokenizer: Any, parser: str = "auto", chat_template: str | None = None):
        self.tokenizer = tokenizer  # the engine's; decoding only reads it (server/token_text.py)
        self.parser_name = parser
        self.template = chat_template
        self.parser: ReasoningParser | None = (
            detect_parser(tokenizer, chat_template) if parser == "auto" else parser_named(parser))
        self._opened: dict[str, bool] = {}
        self._derived: dict[str, Reasoning] = {}
        self._lock = threading.Lock()

    def for_template(self, template: str | None) -> Reasoning:
        """The reasoning under a request's own chat template (None: this one); the parser
        follows the template under `auto`. The template is checked where the prompt renders."""
        if template is None or template == self.template:
            return self
        with self._lock:
            derived = self._derived.get(template)
        if derived is None:
            derived = Reasoning(self.tokenizer, self.parser_name, template)
            with self._lock:
                while len(self._derived) >= MAX_REQUEST_TEMPLATES:
                    self._derived.pop(next(iter(self._derived)))
                self._derived[template] = derived
        return derived

    def mode(self, template_kwargs: dict[str, Any], budget: int | None = None) -> ReasoningMode | None:
        """How a request with these template arguments reasons (None: its answer is all
        content). Renders a probe turn the first time a set of arguments is seen: call
        off the event loop."""
        parser = self.parser
        if parser is None:
            return None
        if parser.follows_enable_thinking and any(template_kwargs.get(k) is False for k in THINKING_SWITCHES):
            return None
        return ReasoningMode(parser, self._opens(parser, template_kwargs), budget, self._decoder(parser))

    async def mode_async(self, template_kwargs: dict[str, Any], budget: int | None = None) -> ReasoningMode | None:
        """`mode` from the event loop: on a worker thread only when it must render a probe (the
        first time a set of template arguments is seen), else at once (no thread hop)."""
        parser = self.parser
        if parser is not None and not self._known(parser, template_kwargs):
            return await asyncio.to_thread(self.mode, template_kwargs, budget)
        return self.mode(template_kwargs, budget)

    def _known(self, parser: ReasoningParser, template_kwargs: dict[str, Any]) -> bool:
        if parser.follows_enable_thinking and any(template_kwargs.get(k) is False for k in THINKING_SWITCHES):
            return True
        key = json.dumps(template_kwargs, sort_keys=True, default=str)
        with self._lock:
            return key in self._opened

    def _decoder(self, parser: ReasoningParser):
        tokenizer = self.tokenizer
        if tokenizer is None:
            return None
        skip = not parser.keeps_special_tokens
        return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip)

    def _opens(self, parser: ReasoningParser, template_kwargs: dict[str, Any]) -> bool:
        key = json.dumps(template_kwargs, sort_keys=True, default=str)
        with self._lock:
            if key in self._opened:
                return self._opened[key]
        opened = parser.opens_in_prompt(self._probe(template_kwargs))
        if len(key) <= MAX_KEPT_KEY_CHARS:  # arguments are the caller's: keep only small ones
            with self._lock:
                if len(self._opened) >= 256:
                    self._opened.clear()
                self._opened[key] = opened
        return opened

    def _probe(self, template_kwargs: dict[str, Any]) -> str:
        return probe(self.tokenizer, self.template, **template_kwargs)


def with_reasoning(job: GenerationJob, mode: ReasoningMode | None) -> GenerationJob:
    """The job whose conversations read (and constrain) the reasoning block: the prompt
    builder puts it ahead of the answer's constraint, the tools' grammar included, where the
    prompt is built (a constraint that cannot follow it is a 400 then); other prompts' params
    get it here (a 400 for a constraint that cannot follow it)."""
    if mode is None:
        return job
    if all(isinstance(p, ChatPrompt) for p in job.prompts):
        return replace(job, prompts=[replace(p, reasoning=mode) for p in job.prompts])
    try:
        return replace(job, params=[mode.apply(p) for p in job.params])
    except ValueError as exc:
        raise bad_request(str(exc)) from None
