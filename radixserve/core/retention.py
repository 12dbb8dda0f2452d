"""RetentionHolds: TTL holds on cached prefixes from agent hints (plain Python).

A hold protects the path from the root to its node (RadixCache.protect: evicted after
every unprotected entry, never reserved memory). A match whose path crosses a held node
refreshes that hold's expiry; a hold ends at expiry or on release. One hold per node: a
second hold on the same node extends it. Stale heap entries (superseded expiries) are
skipped when they come up.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

from radixserve.core.radix_cache import RadixCache, RadixNode


@dataclass
class _Hold:
    node: RadixNode
    ttl_s: float
    expiry: float


class RetentionHolds:
    def __init__(self, cache: RadixCache, max_ttl_s: float, clock: Callable[[], float] = time.monotonic):
        self.cache = cache
        self.max_ttl_s = max_ttl_s
        self.clock = clock
        self._holds: dict[int, _Hold] = {}  # node id -> hold
        self._heap: list[tuple[float, int, int]] = []  # (expiry, seq, node id)
        self._seq = itertools.count()
        self.expired = 0
        self.released = 0

    def __len__(self) -> int:
        return len(self._holds)

    def hold(self, node: RadixNode, ttl_s: float) -> None:
        """Hold the prefix ending at `node` for min(ttl_s, max_ttl_s) seconds."""
        ttl_s = min(ttl_s, self.max_ttl_s)
        hold = self._holds.get(node.node_id)
        if hold is None:
            self.cache.protect(node)
            hold = self._holds[node.node_id] = _Hold(node, ttl_s, 0.0)
        hold.ttl_s = max(hold.ttl_s, ttl_s)
        self._extend(hold)

    def refresh(self, node: RadixNode) -> int:
        """A match reached `node`: every hold on its path starts its TTL again; returns how many."""
        if not self._holds:
            return 0
        n = 0
        while node is not None and not node.is_root:
            hold = self._holds.get(node.node_id)
            if hold is not None:
                self._extend(hold)
                n += 1
            node = node.parent
        return n

    def release(self, node: RadixNode) -> int:
        """End the holds on `node`'s path and below it; returns how many ended."""
        path = set()
        walk = node
        while walk is not None and not walk.is_root:
            path.add(walk.node_id)
            walk = walk.parent
        ended = [h for h in self._holds.values() if h.node.node_id in path or _below(h.node, node)]
        for hold in ended:
            self._end(hold)
        self.released += len(ended)
        return len(ended)

    def expire(self) -> int:
        """End the holds whose expiry has passed; returns how many ended."""
        now = self.clock()
        ended = 0
        while self._heap and self._heap[0][0] <= now:
            expiry, _, node_id = heapq.heappop(self._heap)
            hold = self._holds.get(node_id)
            if hold is not None and hold.expiry == expiry:
                self._end(hold)
                ended += 1
        self.expired += ended
        return ended

    def nodes(self) -> list[RadixNode]:
        return [h.node for h in self._holds.values()]

    def held_blocks(self) -> int:
        """Pool blocks on the held paths, each counted once."""
        seen: set[int] = set()
        blocks = 0
        for node in self.nodes():
            while node is not None and not node.is_root and node.node_id not in seen:
                seen.add(node.node_id)
                blocks += len(node.blocks) if node.alive else 0
                node = node.parent
        return blocks

    def _extend(self, hold: _Hold) -> None:
        hold.expiry = self.clock() + hold.ttl_s
        heapq.heappush(self._heap, (hold.expiry, next(self._seq), hold.node.node_id))

    def _end(self, hold: _Hold) -> None:
        del self._holds[hold.node.node_id]
        self.cache.protect(hold.node, -1)


def _below(node: RadixNode, ancestor: RadixNode) -> bool:
    node = node.parent
    while node is not None:
        if node is ancestor:
            return True
        node = node.parent
    return False
