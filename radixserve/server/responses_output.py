"""ResponseOutputBuilder: a Responses API answer's output items (message, function_call), built
from the generated text as it grows, with the stream events that announce them."""

from __future__ import annotations

import uuid
from typing import Any

from radixserve.outputs import RequestOutput
from radixserve.server.tools.history import HistoryCall, HistoryMessage
from radixserve.server.tools.parser import ArgumentsDelta, CallStarted, ContentDelta, Event, ToolCallParser, text_events


class ResponseOutputBuilder:
    """Feed the text as it grows (`parser` None: all of it is content). The same builder
    makes the non-streamed body, so a stream always assembles to the body."""

    def __init__(self, parser: ToolCallParser | None):
        self.parser = parser
        self.items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None

    def feed(self, text: str, final: bool) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        for event in text_events(self.parser, text, final):
            events += self._apply(event)
        if final:
            events += self._close()
        return events

    def history(self) -> list[HistoryMessage]:
        """The output as one assistant turn (text, then calls), for a later previous_response_id."""
        text = "".join(i["content"][0]["text"] for i in self.items if i["type"] == "message") or None
        calls = tuple(HistoryCall(i["call_id"], i["name"], i["arguments"], "output") for i in self.items
                      if i["type"] == "function_call")
        return [HistoryMessage("assistant", text, calls)]

    def _apply(self, event: Event) -> list[dict[str, Any]]:
        if isinstance(event, ContentDelta):
            events = [] if self._open is not None and self._open["type"] == "message" else self._close() + self._open_message()
            item = self._open
            item["content"][0]["text"] += event.text
            return events + [{"type": "response.output_text.delta", **self._where(), "content_index": 0,
                              "delta": event.text, "logprobs": []}]
        if isinstance(event, CallStarted):
            events = self._close()
            item = {"id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "status": "in_progress",
                    "call_id": f"call_{uuid.uuid4().hex[:24]}", "name": event.name, "arguments": ""}
            return events + self._add(item)
        assert isinstance(event, ArgumentsDelta) and self._open is not None
        self._open["arguments"] += event.text
        return [{"type": "response.function_call_arguments.delta", **self._where(), "delta": event.text}]

    def _open_message(self) -> list[dict[str, Any]]:
        item = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "status": "in_progress", "role": "assistant",
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


def response_usage(output: RequestOutput) -> dict[str, Any]:
    return {
        "input_tokens": output.prompt_tokens,
        "input_tokens_details": {"cached_tokens": output.cached_tokens},
        "output_tokens": output.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": output.prompt_tokens + output.completion_tokens,
    }
