"""ReplyIdStore: the token ids of finished replies, by cache namespace and the prompt they answered.

A chat reply's exact generated ids are kept under (namespace, a digest of its prompt's ids,
its text), so that when the agent re-sends the reply in its next turn the prompt can use those
ids instead of tokenizing the text again (engine/reply_ids.py: ReplySplicer). Keyed by the
prompt, two replies with the same text in one conversation (the same call made twice, each
generated with its own token split) stay apart. The namespace is the caller's API key and
cache_salt (middleware.cache_namespace), kept apart even where keys share the prefix cache:
a lookup reaches only its own namespace's replies.

Bounded two ways, least recently used (stored or spliced) first: at most `max_entries`
replies and `max_tokens` ids in all. Written on the engine thread (a request's final
output), read on prepare workers: one lock guards it.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from radixserve.outputs import RequestOutput

log = logging.getLogger("radixserve.server")

MAX_ENTRIES = 4096
MAX_TOKENS = 1 << 21  # 8 MiB of ids
HEAD_CHARS = 8  # a reply's first characters, indexed for the splicer's cheap check

Key = tuple[str | None, bytes, str]  # (namespace, digest of the prompt ids, reply text)


class ReplyIdStore:
    def __init__(self, max_entries: int = MAX_ENTRIES, max_tokens: int = MAX_TOKENS):
        if max_entries < 1 or max_tokens < 1:
            raise ValueError(f"max_entries and max_tokens must be >= 1, got {max_entries}, {max_tokens}")
        self.max_entries = max_entries
        self.max_tokens = max_tokens
        self._entries: OrderedDict[Key, array] = OrderedDict()
        self._after: dict[tuple[str | None, bytes], set[str]] = {}  # (namespace, prompt) -> reply texts
        self._heads: dict[tuple[str | None, str], int] = {}  # (namespace, first characters) -> replies
        self._tokens = 0
        self._lock = threading.Lock()

    def put(self, namespace: str | None, prompt_ids: Sequence[int], text: str, ids: Sequence[int]) -> bool:
        """Keep `ids` as the reply `text` that followed `prompt_ids` in `namespace`; False for
        an empty or oversized reply."""
        if not text or not ids or len(ids) > self.max_tokens:
            return False
        key = (namespace, _digest(prompt_ids), text)
        stored = array("l", ids)
        with self._lock:
            if key in self._entries:
                self._drop(key)
            self._entries[key] = stored
            self._tokens += len(stored)
            self._after.setdefault(key[:2], set()).add(text)
            head = (namespace, text[:HEAD_CHARS])
            self._heads[head] = self._heads.get(head, 0) + 1
            while len(self._entries) > self.max_entries or self._tokens > self.max_tokens:
                self._drop(next(iter(self._entries)))
        return True

    def after(self, namespace: str | None, prompt_ids: Sequence[int]) -> list[tuple[str, list[int]]]:
        """(text, ids) of the replies that followed exactly `prompt_ids` in `namespace` (each
        now the most recently used)."""
        where = (namespace, _digest(prompt_ids))
        with self._lock:
            found = []
            for text in self._after.get(where, ()):
                self._entries.move_to_end(where + (text,))
                found.append((text, self._entries[where + (text,)].tolist()))
            return found

    def may_begin(self, namespace: str | None, text: str) -> bool:
        """Whether some reply of `namespace` could be a prefix of `text`."""
        with self._lock:
            return any((namespace, text[:n]) in self._heads for n in range(1, HEAD_CHARS + 1))

    def texts(self, namespace: str | None) -> list[str]:
        """The reply texts `namespace` has stored, least recently used first."""
        with self._lock:
            return [text for ns, _, text in self._entries if ns == namespace]

    def view(self, namespace: str | None) -> "NamespaceReplies":
        return NamespaceReplies(self, namespace)

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def num_tokens(self) -> int:
        return self._tokens

    def _drop(self, key: Key) -> None:
        self._tokens -= len(self._entries.pop(key))
        texts = self._after[key[:2]]
        texts.discard(key[2])
        if not texts:
            del self._after[key[:2]]
        head = (key[0], key[2][:HEAD_CHARS])
        self._heads[head] -= 1
        if not self._heads[head]:
            del self._heads[head]


class NamespaceReplies:
    """One namespace's view of a ReplyIdStore: a ReplyLookup for the splicer, and the
    engine's finish hook that records each reply."""

    def __init__(self, store: ReplyIdStore, namespace: str | None):
        self.store = store
        self.namespace = namespace

    def may_begin(self, text: str) -> bool:
        return self.store.may_begin(self.namespace, text)

    def replies_after(self, prompt_ids: Sequence[int]) -> list[tuple[str, list[int]]]:
        return self.store.after(self.namespace, prompt_ids)

    def record(self, engine: Any, output: RequestOutput) -> None:
        """On the engine thread, at a request's final output: keep its ids under its prompt
        and text (the stop token it ended with, if any, is dropped when spliced)."""
        if output.finish_reason not in ("stop", "length") or not output.text:
            return
        try:
            self.store.put(self.namespace, output.prompt_token_ids, output.text, output.token_ids)
        except Exception:  # the engine thread's hook must not raise: the reply is just not kept
            log.exception("keeping a reply's ids failed")


def _digest(ids: Sequence[int]) -> bytes:
    return hashlib.blake2b(array("l", ids).tobytes(), digest_size=16).digest()
