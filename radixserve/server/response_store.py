"""ResponseStore: finished Responses API conversations kept in memory for `previous_response_id`.

Bounded three ways: at most `max_entries` responses per owner (its least recently
stored goes first), each kept `ttl_s` seconds, and a conversation longer than `max_chars` is not kept
(its response says so: `store: false`). Nothing survives a restart.

A response belongs to the tenant (API key) that made it: it is stored under (owner, id),
so another key's lookup of the same id finds nothing, as if it did not exist. Handlers
use `for_owner(tenant)`, a view that can only reach that tenant's responses.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from radixserve.tools.history import HistoryMessage

MAX_ENTRIES = 1024
TTL_S = 3600.0
MAX_CHARS = 1 << 20


class ResponseStore:
    def __init__(
        self, max_entries: int = MAX_ENTRIES, ttl_s: float = TTL_S, max_chars: int = MAX_CHARS,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self.max_chars = max_chars
        self._clock = clock
        # One queue per owner, oldest first: `max_entries` bounds each owner (the keys are the
        # operator's, so the total stays bounded), and no key's responses push out another's.
        self._entries: dict[str | None, OrderedDict[str, tuple[float, tuple[HistoryMessage, ...]]]] = {}

    def put(self, response_id: str, history: list[HistoryMessage], owner: str | None = None) -> bool:
        """Keep the conversation up to and including this response; False if it is too long."""
        if _chars(history) > self.max_chars:
            return False
        self._expire()
        entries = self._entries.setdefault(owner, OrderedDict())
        entries[response_id] = (self._clock() + self.ttl_s, tuple(history))
        entries.move_to_end(response_id)
        while len(entries) > self.max_entries:
            entries.popitem(last=False)
        return True

    def get(self, response_id: str, owner: str | None = None) -> list[HistoryMessage] | None:
        """`owner`'s stored conversation, or None when unknown, expired or another's."""
        self._expire()
        entry = self._entries.get(owner, {}).get(response_id)
        return list(entry[1]) if entry is not None else None

    def for_owner(self, owner: str | None) -> "OwnedResponses":
        return OwnedResponses(self, owner)

    def __len__(self) -> int:
        self._expire()
        return sum(len(entries) for entries in self._entries.values())

    def _expire(self) -> None:
        now = self._clock()
        for owner in list(self._entries):
            entries = self._entries[owner]
            while entries and next(iter(entries.values()))[0] <= now:
                entries.popitem(last=False)
            if not entries:
                del self._entries[owner]


class OwnedResponses:
    """One tenant's view of a ResponseStore: what it stores is its own, what it reads is only its own."""

    def __init__(self, store: ResponseStore, owner: str | None):
        self.store = store
        self.owner = owner
        self.ttl_s = store.ttl_s
        self.max_entries = store.max_entries

    def put(self, response_id: str, history: list[HistoryMessage]) -> bool:
        return self.store.put(response_id, history, self.owner)

    def get(self, response_id: str) -> list[HistoryMessage] | None:
        return self.store.get(response_id, self.owner)


def _chars(history: list[HistoryMessage]) -> int:
    return sum(len(m.content or "") + sum(len(c.arguments) + len(c.name) for c in m.tool_calls) for m in history)
