"""HistoryMessage: one turn of a conversation as the renderer sees it, whichever API it came
from (chat messages, Responses API input items), and the checks a history must pass."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from radixserve.server.errors import bad_request


@dataclass(frozen=True)
class HistoryCall:
    """A call the assistant made earlier; `arguments` is JSON text (checked)."""

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


def check_history(messages: list[HistoryMessage]) -> dict[str, HistoryCall]:
    """Every call's arguments are JSON; every tool result answers a call made before it.
    Returns the calls by id. Raises a 400 naming the field."""
    calls: dict[str, HistoryCall] = {}
    for message in messages:
        for call in message.tool_calls:
            _check_arguments(call)
            calls[call.id] = call
        if message.role == "tool":
            _check_result(message, calls)
    return calls


def _check_arguments(call: HistoryCall) -> None:
    param = call.arguments_param
    try:
        json.loads(call.arguments)
    except (ValueError, RecursionError) as exc:
        raise bad_request(f"'{param}' must be a JSON text (the call's arguments), got {call.arguments[:40]!r}: {exc}",
                          param=param) from None


def _check_result(message: HistoryMessage, calls: dict[str, HistoryCall]) -> None:
    param = message.tool_call_id_param
    if not message.tool_call_id:
        raise bad_request(f"'{param}' is required for a tool result", param=param)
    if message.tool_call_id not in calls:
        known = ", ".join(calls) or "none"
        raise bad_request(
            f"'{param}' is '{message.tool_call_id}', which matches no earlier tool call (calls so far: {known})",
            param=param,
        )
