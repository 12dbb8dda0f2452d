"""HistoryMessage: one turn of a conversation as the renderer sees it, whichever API it came
from (chat messages, Responses API input items), and the checks a history must pass."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from radixserve.request_error import InvalidRequest


@dataclass(frozen=True)
class HistoryCall:
    """A call the assistant made earlier; `arguments` as written: JSON text, or not whole JSON
    where the reply was cut by max_tokens inside the call (rendered back as it was generated)."""

    id: str
    name: str
    arguments: str
    arguments_param: str  # the request field the arguments came from, for errors


@dataclass(frozen=True)
class HistoryMessage:
    role: str  # system / user / assistant / tool ("developer" arrives as "system")
    content: str | None
    tool_calls: tuple[HistoryCall, ...] = field(default_factory=tuple)
    tool_call_id: str | None = None
    name: str | None = None
    tool_call_id_param: str = "tool_call_id"  # the request field tool_call_id came from, for errors
    reasoning: str | None = None  # an assistant turn's reasoning, sent back (the template's reasoning_content)


def check_history(messages: list[HistoryMessage]) -> dict[str, HistoryCall]:
    """Every tool result answers a call made before it. Returns the calls by id. Raises a 400
    naming the field. A call's arguments are not checked: an agent re-sends the reply it got,
    and a reply cut by max_tokens inside a call holds arguments that are not whole JSON."""
    calls: dict[str, HistoryCall] = {}
    for message in messages:
        for call in message.tool_calls:
            calls[call.id] = call
        if message.role == "tool":
            _check_result(message, calls)
    return calls


def parsed_arguments(call: HistoryCall) -> object:
    """The call's arguments as a value for a chat template: parsed where they are JSON, else
    the text as written (a template's `tojson` then writes it as a string)."""
    try:
        return json.loads(call.arguments)
    except (ValueError, RecursionError):
        return call.arguments


def _check_result(message: HistoryMessage, calls: dict[str, HistoryCall]) -> None:
    param = message.tool_call_id_param
    if not message.tool_call_id:
        raise InvalidRequest(f"'{param}' is required for a tool result", param=param)
    if message.tool_call_id not in calls:
        known = ", ".join(calls) or "none"
        raise InvalidRequest(
            f"'{param}' is '{message.tool_call_id}', which matches no earlier tool call (calls so far: {known})",
            param=param,
        )
