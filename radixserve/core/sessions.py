"""SessionTable: agent sessions and pinned prefixes as eviction hints (plain Python).

A session names an agent's conversation. When one of its requests finishes, the node where
its context ends becomes the session's latest context: that path is protected (it leaves
the pool, and then the tier, after every unprotected entry), and the branch it superseded,
if the new context does not extend the old one, is demoted (it leaves first). A pin
protects a prefix (a system prompt and tool list) until its TTL runs out. Holds (agent hints'
ttl_s, core/retention.py) protect a prefix like a pin, refreshed by every hit.

Hints order eviction; they never reserve memory: protected entries are still evicted when
nothing else is left, so no request is refused for memory that eviction could free.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from radixserve.core.agent_hints import NO_HINTS, AgentHints
from radixserve.core.radix_cache import RadixCache, RadixNode
from radixserve.core.retention import RetentionHolds

SessionKey = tuple[str | None, str]  # (cache salt, session id): tenants never share a session


@dataclass
class _Session:
    node: RadixNode
    last_used: float


class SessionTable:
    def __init__(
        self, cache: RadixCache, ttl_s: float, clock: Callable[[], float] = time.monotonic,
        max_hold_s: float = 3600.0,
    ):
        if ttl_s <= 0:
            raise ValueError(f"session TTL must be positive, got {ttl_s}")
        self.cache = cache
        self.ttl_s = ttl_s
        self.clock = clock
        self.holds = RetentionHolds(cache, max_hold_s, clock)
        self._sessions: OrderedDict[SessionKey, _Session] = OrderedDict()  # least recently used first
        self._pins: list[tuple[float, int, RadixNode]] = []  # (expiry, seq, node), a heap
        self._seq = itertools.count()
        self.closed = 0
        self.expired = 0
        self.demoted_nodes = 0

    @property
    def num_open(self) -> int:
        return len(self._sessions)

    @property
    def num_pins(self) -> int:
        return len(self._pins)

    def advance(self, salt: str | None, session_id: str, node: RadixNode) -> None:
        """The session's latest context now ends at `node` (a request of it finished)."""
        key = (salt, session_id)
        session = self._sessions.pop(key, None)
        now = self.clock()
        if session is None:
            self.cache.protect(node)
            session = _Session(node, now)
        elif session.node is not node:
            self.cache.protect(node)  # before the old path is released: shared ancestors stay protected
            self.cache.protect(session.node, -1)
            self.demoted_nodes += self.cache.demote_branch(session.node, node)
            session.node = node
        session.last_used = now
        self._sessions[key] = session

    def close(self, salt: str | None, session_id: str) -> bool:
        """Release a session's hold (its context becomes an ordinary entry); False if unknown."""
        session = self._sessions.pop((salt, session_id), None)
        if session is None:
            return False
        self.cache.protect(session.node, -1)
        self.closed += 1
        return True

    def is_open(self, salt: str | None, session_id: str) -> bool:
        return (salt, session_id) in self._sessions

    def release(self, salt: str | None, session_id: str | None, node: RadixNode | None) -> int:
        """Drop now what holds a prefix: the session (if open), the holds and pins on the
        session's context and on `node`'s path and below; returns how many were dropped."""
        released = 0
        session = self._sessions.get((salt, session_id)) if session_id is not None else None
        for end in (session.node if session is not None else None, node):
            if end is not None and not end.is_root:
                released += self.holds.release(end) + self._unpin(end)
        if session is not None and self.close(salt, session_id):
            released += 1
        return released

    def pin(self, node: RadixNode, ttl_s: float) -> None:
        """Protect the prefix ending at `node` for ttl_s seconds."""
        if ttl_s <= 0:
            raise ValueError(f"pin TTL must be positive, got {ttl_s}")
        self.cache.protect(node)
        heapq.heappush(self._pins, (self.clock() + ttl_s, next(self._seq), node))

    def expire(self) -> int:
        """Release sessions idle longer than the TTL and pins past their expiry; returns
        how many were released."""
        now = self.clock()
        released = 0
        while self._sessions:
            key, session = next(iter(self._sessions.items()))
            if now - session.last_used < self.ttl_s:
                break
            del self._sessions[key]
            self.cache.protect(session.node, -1)
            self.expired += 1
            released += 1
        while self._pins and self._pins[0][0] <= now:
            _, _, node = heapq.heappop(self._pins)
            self.cache.protect(node, -1)
            released += 1
        return released + self.holds.expire()

    def protect_counts(self) -> dict[int, int]:
        """node id -> how many sessions and pins protect it (for integrity checks)."""
        counts: dict[int, int] = {}
        for node in [s.node for s in self._sessions.values()] + [p[2] for p in self._pins] + self.holds.nodes():
            while node is not None and not node.is_root:
                counts[node.node_id] = counts.get(node.node_id, 0) + 1
                node = node.parent
        return counts

    def apply_hints(
        self, salt: str | None, session_id: str | None, node: RadixNode, hints: AgentHints, priority_ttl_s: float,
    ) -> None:
        """A finished request's agent hints, applied to the prefix it left ending at `node`:
        release drops what holds it, ttl_s (or a positive priority: priority_ttl_s) holds it,
        a negative priority makes it leave first."""
        if node.is_root or hints is NO_HINTS:
            return
        if hints.release:
            self.release(salt, session_id, node)
        elif hints.ttl_s is not None:
            self.holds.hold(node, hints.ttl_s)
        elif hints.priority > 0 and priority_ttl_s > 0:
            self.holds.hold(node, priority_ttl_s)
        elif hints.priority < 0 and not hints.warmup:
            self.cache.demote_branch(node, None)

    def _unpin(self, end: RadixNode) -> int:
        """Drop the pins on `end`'s path; returns how many."""
        path = set()
        node = end
        while node is not None and not node.is_root:
            path.add(node.node_id)
            node = node.parent
        dropped = [p for p in self._pins if p[2].node_id in path]
        if dropped:
            self._pins = [p for p in self._pins if p[2].node_id not in path]
            heapq.heapify(self._pins)
            for _, _, node in dropped:
                self.cache.protect(node, -1)
        return len(dropped)

    def check_integrity(self) -> None:
        """Raise AssertionError unless every live node's protect count equals the sessions
        and pins whose context passes through it."""
        counts = self.protect_counts()
        for node in self.cache.nodes():
            if node.protect != counts.get(node.node_id, 0):
                raise AssertionError(f"{node} protect {node.protect}, held by {counts.get(node.node_id, 0)}")
