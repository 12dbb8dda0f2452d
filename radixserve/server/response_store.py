"""ResponseStore: finished Responses API conversations kept in memory for `previous_response_id`.

Bounded three ways: at most `max_entries` responses (the least recently stored goes
first), each kept `ttl_s` seconds, and a conversation longer than `max_chars` is not kept
(its response says so: `store: false`). Nothing survives a restart.

A response belongs to the tenant (API key) that made it: it is stored under (owner, id),
so another key's lookup of the same id finds nothing, as if it did not exist. Handlers
use `for_owner(tenant)`, a view that can only reach that tenant's responses.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from radixserve.server.tools.history import HistoryMessage

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
        self._entries: OrderedDict[tuple[str | None, str], tuple[float, tuple[HistoryMessage, ...]]] = OrderedDict()

    def put(self, response_id: str, history: list[HistoryMessage], owner: str | None = None) -> bool:
        """Keep the conversation up to and including this response; False if it is too long."""
        if _chars(history) > self.max_chars:
            return False
        self._expire()
        self._entries[(owner, response_id)] = (self._clock() + self.ttl_s, tuple(history))
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
        return True

    def get(self, response_id: str, owner: str | None = None) -> list[HistoryMessage] | None:
        """`owner`'s stored conversation, or None when unknown, expired or another's."""
        self._expire()
        entry = self._entries.get((owner, response_id))
        return list(entry[1]) if entry is not None else None

    def for_owner(self, owner: str | None) -> "OwnedResponses":
        return OwnedResponses(self, owner)

    def __len__(self) -> int:
        self._expire()
        return len(self._entries)

    def _expire(self) -> None:
        now = self._clock()
        while self._entries:
            oldest, (deadline, _) = next(iter(self._entries.items()))
            if deadline > now:
                return
            del self._entries[oldest]


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
