"""ReplyIdStore: the token ids of finished replies, by cache namespace and reply text.

A chat reply's exact generated ids are kept under (namespace, its text), so that when the
agent re-sends the reply in its next turn the prompt can use those ids instead of tokenizing
the text again (engine/reply_ids.py: ReplySplicer). The namespace is the caller's API key
and cache_salt (middleware.cache_namespace), kept apart even where keys share the prefix
cache: a lookup reaches only its own namespace's replies.

Bounded two ways, least recently used (stored or spliced) first: at most `max_entries`
replies and `max_tokens` ids in all. Written on the engine thread (a request's final
output), read on prepare workers: one lock guards it.
"""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from radixserve.outputs import RequestOutput

MAX_ENTRIES = 4096
MAX_TOKENS = 1 << 21  # 8 MiB of ids


class ReplyIdStore:
    def __init__(self, max_entries: int = MAX_ENTRIES, max_tokens: int = MAX_TOKENS):
        if max_entries < 1 or max_tokens < 1:
            raise ValueError(f"max_entries and max_tokens must be >= 1, got {max_entries}, {max_tokens}")
        self.max_entries = max_entries
        self.max_tokens = max_tokens
        self._entries: OrderedDict[tuple[str | None, str], array] = OrderedDict()
        self._tokens = 0
        self._lock = threading.Lock()

    def put(self, namespace: str | None, text: str, ids: Sequence[int]) -> bool:
        """Keep `ids` as the reply `text` of `namespace`; False for an empty or oversized reply."""
        if not text or not ids or len(ids) > self.max_tokens:
            return False
        key = (namespace, text)
        stored = array("l", ids)
        with self._lock:
            old = self._entries.pop(key, None)
            self._tokens += len(stored) - (len(old) if old is not None else 0)
            self._entries[key] = stored
            self._evict()
        return True

    def get(self, namespace: str | None, text: str) -> list[int] | None:
        """The ids stored for `text` in `namespace` (now the most recently used), or None."""
        key = (namespace, text)
        with self._lock:
            stored = self._entries.get(key)
            if stored is None:
                return None
            self._entries.move_to_end(key)
            return stored.tolist()

    def texts(self, namespace: str | None) -> list[str]:
        """The reply texts `namespace` has stored, least recently used first."""
        with self._lock:
            return [text for ns, text in self._entries if ns == namespace]

    def view(self, namespace: str | None) -> "NamespaceReplies":
        return NamespaceReplies(self, namespace)

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def num_tokens(self) -> int:
        return self._tokens

    def _evict(self) -> None:
        while len(self._entries) > self.max_entries or self._tokens > self.max_tokens:
            _, ids = self._entries.popitem(last=False)
            self._tokens -= len(ids)


class NamespaceReplies:
    """One namespace's view of a ReplyIdStore: a ReplyLookup for the splicer, and the
    engine's finish hook that records each reply."""

    def __init__(self, store: ReplyIdStore, namespace: str | None):
        self.store = store
        self.namespace = namespace

    def reply_ids(self, text: str) -> list[int] | None:
        return self.store.get(self.namespace, text)

    def record(self, engine: Any, output: RequestOutput) -> None:
        """On the engine thread, at a request's final output: keep its ids under its text
        (the stop token it ended with, if any, is dropped when spliced)."""
        if output.finish_reason in ("stop", "length") and output.text:
            self.store.put(self.namespace, output.text, output.token_ids)
