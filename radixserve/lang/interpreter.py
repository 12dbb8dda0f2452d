"""Interpreter: what each op does to a StateRecord (runs on the state's executor thread)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from radixserve.lang.backend import Backend
from radixserve.lang.choice_scoring import decide, score_requests
from radixserve.lang.expr import Expr, Gen, RoleBegin, RoleEnd, Select, Text
from radixserve.lang.record import OpenMessage, StateRecord
from radixserve.sampling_params import SamplingParams

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

    def _role_begin(self, record: StateRecord, op: RoleBegin) -> None:
        if record.open is not None:
            raise ValueError(f"cannot open a {op.role} message inside the open {record.open.role} message")
        before, after = self.backend.chat_template.markers(record.messages, op.role)
        record.append_marker(before)
        record.open = OpenMessage(op.role, after)

    def _role_end(self, record: StateRecord, op: RoleEnd) -> None:
        message = record.open
        if message is None or message.role != op.role:
            raise ValueError(f"no open {op.role} message to end")
        record.append_marker(message.end_marker)
        record.messages.append({"role": message.role, "content": message.content})
        record.open = None

    def _gen(self, record: StateRecord, op: Gen) -> None:
        params = gen_params(op, self.defaults)
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
            record.set_var(op.name, completion.text, completion.meta())

    def _select(self, record: StateRecord, op: Select) -> None:
        choices = list(op.choices)
        requests = score_requests(self.backend.encode, record.text, choices)
        result = decide(choices, requests, self.backend.score(requests), op.choices_method)
        record.append(result.choice)
        if op.name is not None:
            record.set_var(op.name, result.choice, result.as_dict(), result)

    def _prompt_ids(self, record: StateRecord) -> list[int]:
        if not record.text:
            raise ValueError("gen needs some text before it: the program's text is empty")
        return self.backend.encode(record.text)


_RUNNERS: dict[type, Callable[[Interpreter, StateRecord, Any], None]] = {
    Text: Interpreter._text,
    RoleBegin: Interpreter._role_begin,
    RoleEnd: Interpreter._role_end,
    Gen: Interpreter._gen,
    Select: Interpreter._select,
}
