"""Interpreter: what each op does to a StateRecord (runs on the state's executor thread)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dataclasses import replace

from radixserve.engine.chat_output import ToolCall
from radixserve.lang.backend import Backend
from radixserve.lang.choice_scoring import decide, score_requests
from radixserve.lang.expr import Expr, Gen, RoleBegin, RoleEnd, Select, Text, Tools
from radixserve.lang.record import OpenMessage, StateRecord
from radixserve.sampling_params import SamplingParams
from radixserve.tools.definitions import checked_tools
from radixserve.tools.formats import format_named
from radixserve.tools.grammar import tool_constraint
from radixserve.tools.parser import parse_tool_calls
from radixserve.tools.rendering import own_template, template_supports_tools, tools_system_text

DEFAULT_MAX_TOKENS = 128


def gen_params(gen: Gen, defaults: dict[str, Any]) -> SamplingParams:
    """The gen's own options over the run's defaults over DEFAULT_MAX_TOKENS."""
    return SamplingParams(**{"max_tokens": DEFAULT_MAX_TOKENS, **defaults, **gen.sampling})


class Interpreter:
    """Runs ops over a record with one backend and one run's sampling defaults; with
    `streaming`, gens push their text to the record's stream as it decodes."""

    def __init__(self, backend: Backend, defaults: dict[str, Any], streaming: bool, session_id: str | None = None):
        self.backend = backend
        self.defaults = defaults
        self.streaming = streaming
        self.session = {"session_id": session_id} if session_id is not None else {}  # a cache hint

    def run(self, record: StateRecord, ops: list[Expr]) -> None:
        for op in ops:
            _RUNNERS[type(op)](self, record, op)

    def _text(self, record: StateRecord, op: Text) -> None:
        record.append(op.value)

    def _tools(self, record: StateRecord, op: Tools) -> None:
        if record.messages or record.open is not None or record.tools:
            raise ValueError("rl.tools(...) comes once, before the conversation's first message")
        record.tools = op.definitions

    def _role_begin(self, record: StateRecord, op: RoleBegin) -> None:
        if record.open is not None:
            raise ValueError(f"cannot open a {op.role} message inside the open {record.open.role} message")
        if record.tools and not record.messages and op.role != "system" and not self._native_tools():
            self._role_begin(record, RoleBegin("system"))  # the tools' own system message, as the server writes it
            self._role_end(record, RoleEnd("system"))
        before, after = self.backend.chat_template.markers(record.messages, op.role, self._template_tools(record))
        record.append_marker(before)
        record.open = OpenMessage(op.role, after)

    def _role_end(self, record: StateRecord, op: RoleEnd) -> None:
        message = record.open
        if message is None or message.role != op.role:
            raise ValueError(f"no open {op.role} message to end")
        if record.tools and not record.messages and op.role == "system" and not self._native_tools():
            text = tools_system_text(list(record.tools), self._format())  # the first system message carries them
            record.append(f"\n\n{text}" if message.content else text)
        record.append_marker(message.end_marker)
        record.messages.append({"role": message.role, "content": message.content})
        record.open = None

    def _gen(self, record: StateRecord, op: Gen) -> None:
        params = gen_params(op, self.defaults)
        spec = None
        if op.calls is not None:
            spec = checked_tools(list(record.tools), op.calls["tool_choice"], op.calls["parallel_tool_calls"])
            params = replace(params, **tool_constraint(spec, self._format(), self.backend.tokenizer))
        streamed: list[str] = []

        def on_text(delta: str) -> None:
            streamed.append(delta)
            record.stream.push(delta, op.name)

        completion = self.backend.generate(
            self._prompt_ids(record), params, on_text if self.streaming else None, **self.session
        )
        sent = "".join(streamed)
        if completion.text.startswith(sent):
            record.stream.push(completion.text[len(sent):], op.name)
        if op.name is not None:
            record.stream.end(op.name)
        record.append(completion.text, stream=False)
        if op.name is not None:
            meta = completion.meta()
            if spec is not None:
                meta["tool_calls"] = self._calls(completion.text, spec)
            record.set_var(op.name, completion.text, meta)

    def _select(self, record: StateRecord, op: Select) -> None:
        choices = list(op.choices)
        requests = score_requests(self.backend.encode, record.text, choices)
        result = decide(choices, requests, self.backend.score(requests), op.choices_method)
        record.append(result.choice)
        if op.name is not None:
            record.set_var(op.name, result.choice, result.as_dict(), result)

    def _calls(self, text: str, spec) -> list[ToolCall]:
        if not spec.parses_calls:
            return []
        parsed = parse_tool_calls(text, self._format(), set(spec.names), spec.schemas)
        return [ToolCall(call.name, call.arguments) for call in parsed.calls]

    def _template(self) -> str | None:
        return own_template(self.backend.tokenizer)

    def _native_tools(self) -> bool:
        """The model's chat template renders tools itself (else the system message carries them)."""
        return template_supports_tools(self._template())

    def _format(self):
        return format_named("auto", self._template())

    def _template_tools(self, record: StateRecord) -> list[dict] | None:
        if not record.tools or not self._native_tools():
            return None
        return [tool.template_entry() for tool in record.tools]

    def _prompt_ids(self, record: StateRecord) -> list[int]:
        if not record.text:
            raise ValueError("gen needs some text before it: the program's text is empty")
        return self.backend.encode(record.text)


_RUNNERS: dict[type, Callable[[Interpreter, StateRecord, Any], None]] = {
    Text: Interpreter._text,
    Tools: Interpreter._tools,
    RoleBegin: Interpreter._role_begin,
    RoleEnd: Interpreter._role_end,
    Gen: Interpreter._gen,
    Select: Interpreter._select,
}
