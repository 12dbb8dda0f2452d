"""KVTier: slots of the second KV tier and the copies that move blocks between tiers
(plain Python; the bytes move in the runner).

A tier slot holds one block's K/V outside the pool. Slots are owned by radix nodes: every
slot is free or held by exactly one node. The cache decides which blocks move, and records
each move as a KVCopy; the engine takes a step's copies from the KV manager after scheduling
(beside the StepPlan, not in it) and Tiering runs them in order before the forward pass (so a
block saved to the tier is read before anything overwrites it, and a restored block is written
before attention reads it).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

@dataclass(frozen=True)
class KVCopy:
    """Copy pool block `block` to tier slot `slot` (to_tier) or back (not to_tier). Hybrid KV:
    with `page` and `window_slot` (both >= 0), the block's window page too, to or from that
    slot of the tier's window part."""

    to_tier: bool
    block: int
    slot: int
    page: int = -1
    window_slot: int = -1


@dataclass(frozen=True)
class TierEntry:
    """What a tier slot holds, for the on-disk index: one block of a prefix, named by the
    chained hash of the prefix it ends (core/hashing.py), with its parent's hash and its own
    token ids. Hybrid KV: `window_slot`, the window slot holding its window page (-1: none,
    a tombstone for the window layers)."""

    slot: int
    salt: str | None
    parent: int
    digest: int
    tokens: tuple[int, ...]
    window_slot: int = -1


class KVTier:
    """Hands out tier slot ids 0..num_slots-1 (least recently freed last)."""

    def __init__(self, num_slots: int):
        if num_slots <= 0:
            raise ValueError(f"num_slots must be positive, got {num_slots}")
        self.num_slots = num_slots
        self._free: deque[int] = deque(range(num_slots))
        self._is_free = [True] * num_slots
        self.version = 0  # changes whenever the free list does

    @property
    def num_free(self) -> int:
        return len(self._free)

    def peek_free(self, n: int) -> list[int]:
        """The next (up to) n slots allocate() hands out, in that order."""
        return list(itertools.islice(self._free, n))

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"asked for {n} tier slots, only {len(self._free)} free")
        slots = [self._free.popleft() for _ in range(n)]
        for s in slots:
            self._is_free[s] = False
        self.version += 1
        return slots

    def take(self, slots: Iterable[int]) -> None:
        """Mark specific free slots as held (used when the index is loaded from disk)."""
        wanted = set(slots)
        for s in wanted:
            if not self._is_free[s]:
                raise RuntimeError(f"tier slot {s} is already held")
            self._is_free[s] = False
        self._free = deque(s for s in self._free if s not in wanted)
        self.version += 1

    def free(self, slots: Iterable[int]) -> None:
        for s in slots:
            if self._is_free[s]:
                raise RuntimeError(f"double free of tier slot {s}")
            self._is_free[s] = True
            self._free.append(s)
        self.version += 1

    def check_integrity(self, held: list[int]) -> None:
        """Raise AssertionError unless every slot is free xor held by exactly one holder."""
        free = list(self._free)
        if len(set(free)) != len(free):
            raise AssertionError("a tier slot appears twice in the free list")
        if len(set(held)) != len(held):
            raise AssertionError(f"a tier slot is held twice: {sorted(held)}")
        if set(free) & set(held):
            raise AssertionError(f"tier slots both free and held: {sorted(set(free) & set(held))}")
        if len(free) + len(held) != self.num_slots:
            raise AssertionError(f"tier: {len(free)} free + {len(held)} held != {self.num_slots} slots")
        if any(self._is_free[s] != (s in set(free)) for s in range(self.num_slots)):
            raise AssertionError("tier free flags disagree with the free list")
