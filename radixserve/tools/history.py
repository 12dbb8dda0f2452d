"""HistoryMessage: one turn of a conversation as the renderer sees it, whichever API it came
from (chat messages, Responses API input items), and the checks a history must pass."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

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


def history_of(messages: list[dict[str, Any]]) -> list[HistoryMessage]:
    """OpenAI-style chat messages given as Python dicts (`Engine.chat`, the DSL) as turns:
    `role` (developer counts as system), `content` (a string, or a list of text parts),
    an assistant's `tool_calls` ({"id", "function": {"name", "arguments"}}, arguments as
    JSON text or a value), a tool result's `tool_call_id` and `name`, an assistant's
    `reasoning_content`. An InvalidRequest naming the field for anything else."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InvalidRequest("'messages' must be a non-empty list of messages", param="messages")
    return [_turn(message, f"messages[{i}]") for i, message in enumerate(messages)]


def _turn(message: Any, where: str) -> HistoryMessage:
    if not isinstance(message, dict):
        raise InvalidRequest(f"'{where}' must be a dict, got {type(message).__name__}", param=where)
    role = message.get("role")
    if role not in ("system", "developer", "user", "assistant", "tool"):
        raise InvalidRequest(f"'{where}.role' must be system, developer, user, assistant or tool, got {role!r}",
                             param=f"{where}.role")
    calls = tuple(_call(call, f"{where}.tool_calls[{j}]", j) for j, call in enumerate(message.get("tool_calls") or ()))
    if calls and role != "assistant":
        raise InvalidRequest(f"'{where}.tool_calls' is only allowed on assistant messages", param=f"{where}.tool_calls")
    content = message.get("content")
    return HistoryMessage("system" if role == "developer" else role, _text(content, f"{where}.content"), calls,
                          message.get("tool_call_id"), message.get("name"), f"{where}.tool_call_id",
                          message.get("reasoning_content"))


def _call(call: Any, where: str, index: int) -> HistoryCall:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise InvalidRequest(f"'{where}' must be {{\"function\": {{\"name\": ..., \"arguments\": ...}}}}", param=where)
    arguments = function.get("arguments", "{}")
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return HistoryCall(str(call.get("id") or f"call_{index}"), function["name"], arguments, f"{where}.function.arguments")


def _text(content: Any, where: str) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise InvalidRequest(f"'{where}' must be a string or a list of text parts", param=where)
