"""TextStream: the text a state appends, in order, as it is appended (gens as they decode).

Every piece is kept, so a reader that starts late still sees everything from the start.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

_END = None  # a gen's end marker in the event list


class TextStream:
    """Pieces of text tagged with the gen variable they belong to (None for other text)."""

    def __init__(self, condition: threading.Condition):
        self._cond = condition  # the state's: also notified when its work queue empties
        self._events: list[tuple[str | None, str | None]] = []

    def push(self, text: str, name: str | None = None) -> None:
        if text:
            with self._cond:
                self._events.append((name, text))
                self._cond.notify_all()

    def end(self, name: str) -> None:
        """Gen `name` is complete."""
        with self._cond:
            self._events.append((name, _END))
            self._cond.notify_all()

    def iterate(self, name: str | None, busy: Callable[[], bool]) -> Iterator[str]:
        """All pieces (name None) or gen `name`'s pieces, until that gen ends or, with no
        more work queued (`busy()` false), the pieces run out."""
        seen = 0
        while True:
            with self._cond:
                self._cond.wait_for(lambda: seen < len(self._events) or not busy())
                fresh = self._events[seen:]
                seen += len(fresh)
            if not fresh:
                return
            for tag, text in fresh:
                if name is None and text is not _END:
                    yield text
                elif name is not None and tag == name:
                    if text is _END:
                        return
                    yield text
