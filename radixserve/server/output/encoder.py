"""BlockEncoder: the base of the encoders that turn one answer's events into blocks (Anthropic's
content blocks, the Responses API's output items) and the API's own events announcing them."""

from __future__ import annotations

from typing import Any

from radixserve.server.output.events import Event, Finish


class BlockEncoder:
    """Apply each step's events as they come; at most one block is open at a time. The same
    encoder makes the whole answer, so a stream always assembles to the body."""

    def __init__(self) -> None:
        self._open: dict[str, Any] | None = None
        self.finish: Finish | None = None  # set once the answer has finished

    def apply(self, events: list[Event]) -> list[dict[str, Any]]:
        """The API's events for these output events."""
        out: list[dict[str, Any]] = []
        for event in events:
            if isinstance(event, Finish):
                self.finish = event
            out += self._apply(event)
        return out

    def _apply(self, event: Event) -> list[dict[str, Any]]:
        raise NotImplementedError
