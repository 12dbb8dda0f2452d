"""BlockPool: reference-counted KV block ids and their free list (plain Python)."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from radixserve.core.window_pages import WindowPages


class BlockPool:
    """Hands out block ids 0..num_blocks-1. A block is free exactly when its ref count is 0.

    Holders of references: running requests (one per block in their block table) and the
    radix cache (one per block stored in the tree). `free` drops one reference per id and
    returns the ids that reached zero to the free list, in the order given, so a caller
    that frees tail first makes the least shared blocks the next to be reused.

    With `window` (a hybrid KV model's window-layer pages), every allocated block takes a
    window page and a freed one gives its page back; a block can be allocated only while
    both a block and a page are free.

    `snapshots`: a model with recurrent layers keeps this many snapshots of their states
    beside the blocks (core/recurrent_snapshots.py decides which; 0: none).
    """

    def __init__(self, num_blocks: int, window: WindowPages | None = None, snapshots: int = 0):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self.window = window
        self.snapshots = snapshots

    @property
    def num_free(self) -> int:
        if self.window is not None:
            return min(len(self._free), self.window.num_free)
        return len(self._free)

    @property
    def num_free_blocks(self) -> int:
        """Free block ids (on a hybrid pool, pages may be scarcer: num_free)."""
        return len(self._free)

    def allocate(self, n: int, windows: list[bool] | None = None) -> list[int]:
        """Take n free blocks (ref count 1 each). Raises if fewer than n are free. On a hybrid
        pool each takes a window page, or (`windows`) only those marked True: the others are
        tombstones from the start (a tier restore whose window did not come back)."""
        pages = n if windows is None or self.window is None else sum(windows)
        if n > len(self._free) or (self.window is not None and pages > self.window.num_free):
            raise MemoryError(f"asked for {n} KV blocks ({pages} window pages), only {self.num_free} free")
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self.ref_counts[b] = 1
        if self.window is not None:
            self.window.attach(blocks if windows is None else [b for b, w in zip(blocks, windows) if w])
        return blocks

    def share(self, blocks: Iterable[int]) -> None:
        """Add one reference to each (already referenced) block."""
        for b in blocks:
            if self.ref_counts[b] <= 0:
                raise RuntimeError(f"share of free block {b}")
            self.ref_counts[b] += 1

    def free(self, blocks: Iterable[int]) -> int:
        """Drop one reference from each block; returns how many became free."""
        freed = 0
        for b in blocks:
            count = self.ref_counts[b]
            if count <= 0:
                raise RuntimeError(f"double free of block {b}")
            self.ref_counts[b] = count - 1
            if count == 1:
                self._free.append(b)
                if self.window is not None:
                    self.window.release(b)
                freed += 1
        return freed

    def check_integrity(self, expected_refs: list[int] | None = None) -> None:
        """Raise AssertionError if the free list and the ref counts disagree, or (when given)
        if the ref counts differ from what the holders say they hold."""
        free = list(self._free)
        free_set = set(free)
        if len(free_set) != len(free):
            raise AssertionError("a block appears twice in the free list")
        for b, count in enumerate(self.ref_counts):
            if count < 0:
                raise AssertionError(f"block {b} has negative ref count {count}")
            if (count == 0) != (b in free_set):
                raise AssertionError(f"block {b}: ref count {count} but in free list: {b in free_set}")
        if expected_refs is not None and expected_refs != self.ref_counts:
            diff = [
                (b, have, want)
                for b, (have, want) in enumerate(zip(self.ref_counts, expected_refs))
                if have != want
            ]
            raise AssertionError(f"ref counts differ from holders (block, have, want): {diff[:10]}")
