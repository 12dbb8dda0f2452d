"""ResponseOutputBuilder: a Responses API answer's output items (message, function_call), built
from the answer's output events (server/output/events.py), with the stream events that announce them."""

from __future__ import annotations

from typing import Any

from radixserve.server.output.events import CallArguments, CallStart, Event, Finish, TextDelta
from radixserve.server.output.ids import new_id
from radixserve.server.tools.history import HistoryCall, HistoryMessage


class ResponseOutputBuilder:
    """Apply the answer's events as they come. The same builder makes the non-streamed
    body, so a stream always assembles to the body."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None
        self.finish: Finish | None = None

    def apply(self, events: list[Event]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for event in events:
            out += self._apply(event)
        return out

    def history(self) -> list[HistoryMessage]:
        """The output as one assistant turn (text, then calls), for a later previous_response_id."""
        text = "".join(i["content"][0]["text"] for i in self.items if i["type"] == "message") or None
        calls = tuple(HistoryCall(i["call_id"], i["name"], i["arguments"], "output") for i in self.items
                      if i["type"] == "function_call")
        return [HistoryMessage("assistant", text, calls)]

    def _apply(self, event: Event) -> list[dict[str, Any]]:
        if isinstance(event, TextDelta):
            events = [] if self._open is not None and self._open["type"] == "message" else self._close() + self._open_message()
            item = self._open
            item["content"][0]["text"] += event.text
            return events + [{"type": "response.output_text.delta", **self._where(), "content_index": 0,
                              "delta": event.text, "logprobs": []}]
        if isinstance(event, CallStart):
            events = self._close()
            item = {"id": new_id("fc_"), "type": "function_call", "status": "in_progress",
                    "call_id": "call_" + event.id_hex, "name": event.name, "arguments": ""}
            return events + self._add(item)
        if isinstance(event, CallArguments):
            self._open["arguments"] += event.text
            return [{"type": "response.function_call_arguments.delta", **self._where(), "delta": event.text}]
        if isinstance(event, Finish):
            self.finish = event
        return self._close()  # CallEnd, Finish

    def _open_message(self) -> list[dict[str, Any]]:
        item = {"id": new_id("msg_"), "type": "message", "status": "in_progress", "role": "assistant",
                "content": []}
        events = self._add(item)
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        item["content"].append(part)
        return events + [{"type": "response.content_part.added", **self._where(), "content_index": 0,
                          "part": dict(part)}]

    def _add(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        self.items.append(item)
        self._open = item
        return [{"type": "response.output_item.added", "output_index": len(self.items) - 1, "item": _copy(item)}]

    def _close(self) -> list[dict[str, Any]]:
        item = self._open
        if item is None:
            return []
        self._open = None
        item["status"] = "completed"
        where = {"item_id": item["id"], "output_index": self.items.index(item)}
        if item["type"] == "message":
            part = item["content"][0]
            events = [
                {"type": "response.output_text.done", **where, "content_index": 0, "text": part["text"], "logprobs": []},
                {"type": "response.content_part.done", **where, "content_index": 0, "part": dict(part)},
            ]
        else:
            events = [{"type": "response.function_call_arguments.done", **where, "name": item["name"],
                       "arguments": item["arguments"]}]
        return events + [{"type": "response.output_item.done", "output_index": where["output_index"], "item": _copy(item)}]

    def _where(self) -> dict[str, Any]:
        return {"item_id": self._open["id"], "output_index": len(self.items) - 1}


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    copied = dict(item)
    if "content" in copied:
        copied["content"] = [dict(p) for p in copied["content"]]
    return copied
