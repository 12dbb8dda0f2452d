"""run_ops: what each op does to a state (runs on the state's executor thread)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from radixserve.lang.choice_scoring import decide, score_requests
from radixserve.lang.expr import Expr, Gen, RoleBegin, RoleEnd, Select, Text
from radixserve.lang.state import OpenMessage, ProgramState
from radixserve.sampling_params import SamplingParams

DEFAULT_MAX_TOKENS = 128


def run_ops(state: ProgramState, ops: list[Expr]) -> None:
    for op in ops:
        _RUNNERS[type(op)](state, op)


def gen_params(gen: Gen, defaults: dict[str, Any]) -> SamplingParams:
    """The gen's own options over the run's defaults over DEFAULT_MAX_TOKENS."""
    return SamplingParams(**{"max_tokens": DEFAULT_MAX_TOKENS, **defaults, **gen.sampling})


def _text(state: ProgramState, op: Text) -> None:
    state._append(op.value)


def _role_begin(state: ProgramState, op: RoleBegin) -> None:
    if state._open is not None:
        raise ValueError(f"cannot open a {op.role} message inside the open {state._open.role} message")
    before, after = state.backend.chat_template.markers(state._messages, op.role)
    state._append_marker(before)
    state._open = OpenMessage(op.role, after)


def _role_end(state: ProgramState, op: RoleEnd) -> None:
    message = state._open
    if message is None or message.role != op.role:
        raise ValueError(f"no open {op.role} message to end")
    state._append_marker(message.end_marker)
    state._messages.append({"role": message.role, "content": message.content})
    state._open = None


def _gen(state: ProgramState, op: Gen) -> None:
    params = gen_params(op, state.defaults)
    streamed: list[str] = []

    def on_text(delta: str) -> None:
        streamed.append(delta)
        state._stream.push(delta, op.name)

    completion = state.backend.generate(_prompt_ids(state), params, on_text if state.streaming else None)
    sent = "".join(streamed)
    if completion.text.startswith(sent):
        state._stream.push(completion.text[len(sent):], op.name)
    if op.name is not None:
        state._stream.end(op.name)
    state._append(completion.text, stream=False)
    if op.name is not None:
        state._set_var(op.name, completion.text, completion.meta())


def _select(state: ProgramState, op: Select) -> None:
    backend = state.backend
    choices = list(op.choices)
    requests = score_requests(backend.encode, state._text, choices)
    result = decide(choices, requests, backend.score(requests), op.choices_method)
    state._append(result.choice)
    if op.name is not None:
        state._set_var(op.name, result.choice, result.as_dict(), result)


def _prompt_ids(state: ProgramState) -> list[int]:
    if not state._text:
        raise ValueError("gen needs some text before it: the program's text is empty")
    return state.backend.encode(state._text)


_RUNNERS: dict[type, Callable[[ProgramState, Any], None]] = {
    Text: _text,
    RoleBegin: _role_begin,
    RoleEnd: _role_end,
    Gen: _gen,
    Select: _select,
}
