"""NoPrefixCache: a disabled prefix cache (plain Python): RadixCache's interface, holding nothing.

Every match is empty (it ends at a root that never gets a child), an insert stores
nothing and takes no reference, eviction and flushing free nothing: each request computes
its whole prompt and its blocks go back to the pool when it leaves. The KV manager and its
components treat it like any cache; nothing asks whether caching is on except to report it.
"""

from __future__ import annotations

from collections import Counter

from radixserve.core.cache_component import CacheComponent
from radixserve.core.kv_events import NoEventLog
from radixserve.core.radix_cache import MatchResult, RadixNode
from radixserve.kv_tier.index import KVCopy, TierEntry


class NoPrefixCache:
    caching = False
    num_cached_blocks = num_evictable_blocks = num_tier_blocks = num_nodes = 0
    evicted_blocks = restored_blocks = tier_hits = 0

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.events = None
        self.event_log = NoEventLog()
        self.evictions: Counter[str] = Counter()
        self.components: list[CacheComponent] = []
        self._root = RadixNode(-1, None, [], [])

    def match_prefix(self, tokens: list[int], salt: str | None = None) -> MatchResult:
        return MatchResult([], self._root, 0)

    def peek_prefix(self, tokens: list[int], salt: str | None = None) -> tuple[int, RadixNode | None]:
        return 0, None

    def insert(self, tokens: list[int], blocks: list[int], salt: str | None = None) -> RadixNode:
        return self._root

    def restore(self, match: MatchResult) -> list[int]:
        return list(match.blocks)

    def tier_only_slots(self, tokens: list[int], salt: str | None = None) -> list[int]:
        return []

    def tier_only_window_slots(self, tokens: list[int], salt: str | None = None) -> list[int]:
        return []

    def tier_windows(self, match: MatchResult) -> list[bool]:
        return []

    def restore_windows(self, match: MatchResult) -> list[bool]:
        return []

    def mark_anchor(self, node: RadixNode, num_blocks: int) -> RadixNode | None:
        return None

    def save_windows(self, node: RadixNode) -> None:
        pass

    def now(self) -> int:
        return 0

    def lock(self, node: RadixNode) -> None:
        pass

    def unlock(self, node: RadixNode) -> None:
        pass

    def protect(self, node: RadixNode, delta: int = 1) -> None:
        pass

    def demote_branch(self, old: RadixNode, keep: RadixNode | None) -> int:
        return 0

    def evict(self, num_blocks: int) -> int:
        return 0

    def flush(self, namespace: str | None = None) -> int:
        return 0

    def take_copies(self) -> list[KVCopy]:
        return []

    def take_tier_events(self) -> list[tuple[str, object]]:
        return []

    def load_tier_entries(self, entries: list[TierEntry]) -> list[TierEntry]:
        return []

    def nodes(self, namespace: str | None = None):
        return iter(())

    def held_blocks(self) -> list[int]:
        return []

    def held_slots(self) -> list[int]:
        return []

    def check_integrity(self) -> None:
        """Nothing is held: the root has no child."""
        if self._root.children or self._root.lock_ref:
            raise AssertionError("a disabled prefix cache holds a node")
