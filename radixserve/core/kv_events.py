"""KVEventLog: what the radix cache stored and removed, block by block, since it was last
read (plain Python). The engine hands each step's events to the publisher
(engine/kv_events.py), which sends them in vLLM's published format.

A block is named by its chained hash (core/hashing.py) and lives in a medium: "pool" (the
KV pool the model reads) or "tier" (the second tier), and in a cache group: FULL (the full
layers' blocks, all the tree holds) or WINDOW (the window layers' pages of a hybrid model,
core/window_pages.py: a cached block keeps one only near a node's end, so they come and go
as windows slide), or RECURRENT (a model's recurrent-layer state snapshots,
core/recurrent_snapshots.py: a node keeping one names it by its last block). The first block of a tenant's namespace carries the namespace's salt. A node that moves from the pool to
the tier is a BlockStored in the tier then a BlockRemoved from the pool; a subscriber that
applies every event in order holds exactly the blocks the cache holds, medium by medium.
"""

from __future__ import annotations

from dataclasses import dataclass

POOL, TIER = "pool", "tier"
FULL, WINDOW, RECURRENT = 0, 1, 2  # cache groups (group_idx on the wire)


@dataclass(frozen=True)
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int | None  # None: the first block of its namespace
    token_ids: list[int]
    medium: str
    group: int = FULL
    salt: str | None = None  # only on a namespace's first block (parent None)


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: list[int]
    medium: str
    group: int = FULL


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventLog:
    """Events in the order the cache made them, taken in one batch per step."""

    def __init__(self) -> None:
        self._events: list[KVEvent] = []

    def stored(self, hashes: list[int], parent: int | None, tokens: list[int], medium: str,
               salt: str | None = None, group: int = FULL) -> None:
        if hashes:
            self._events.append(BlockStored(list(hashes), parent, list(tokens), medium, group,
                                            salt=salt if parent is None else None))

    def removed(self, hashes: list[int], medium: str, group: int = FULL) -> None:
        if hashes:
            self._events.append(BlockRemoved(list(hashes), medium, group))

    def cleared(self) -> None:
        self._events.append(AllBlocksCleared())

    def node_stored(self, node, medium: str) -> None:
        """A tree node's blocks are now in `medium` (named by its digests, chained to its parent's)."""
        parent = None if node.parent.is_root else node.parent.digests[-1]
        self.stored(node.digests, parent, node.tokens, medium, node.salt)

    def node_removed(self, node, medium: str) -> None:
        self.removed(node.digests, medium)

    def take(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events


class NoEventLog(KVEventLog):
    """The log of a cache nobody follows: records nothing (no publisher configured)."""

    def stored(self, hashes: list[int], parent: int | None, tokens: list[int], medium: str,
               salt: str | None = None, group: int = FULL) -> None:
        pass

    def removed(self, hashes: list[int], medium: str, group: int = FULL) -> None:
        pass

    def node_stored(self, node, medium: str) -> None:
        pass

    def node_removed(self, node, medium: str) -> None:
        pass

    def cleared(self) -> None:
        pass
