"""WindowPages: the KV pages of a model's sliding-window layers, beside the pool's blocks
(plain Python; hybrid KV).

A model whose layers attend either to everything (full layers) or to the last W tokens
(window layers) keeps two page pools. Block ids (BlockPool) name a run of block_size
tokens everywhere: in request block tables, in the radix tree, and as the full layers'
pages. Window layers' K/V for a block live in a window page attached to it, or nowhere:

    tokens      [  0..15 ][ 16..31 ][ 32..47 ][ 48..63 ][ 64..79 ]   (block_size 16, W 32)
    block ids       3         7        12        13        20        full layers: every block
    window page     -         -         5         0         2        window layers: the last W
                  (a tombstone for the window layers)

A block gets a page when it is allocated and gives it back when it is freed. In between,
its page is dropped ("trimmed", leaving a tombstone) once nobody can read it again: no
running request has the block in its window (`users`), and the radix tree does not need
it before a kept end of the cached tree (the last W tokens before it plus `slack` blocks,
where a later match may stop: core/sliding_window.py says which ends are kept). A cached prefix is
usable only up to a point whose preceding W tokens all still have pages (`valid_prefix`).

Invariants (check_integrity): a page is attached to exactly one live block; free + attached
== num_pages; every block a running request reads (from its window's first block on) has
a page.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

NO_PAGE = -1
SLACK_TOKENS = 64  # a kept end keeps the window of every point this far before it (at most W / 4)


class WindowPages:
    def __init__(self, num_pages: int, num_blocks: int, window: int, block_size: int):
        if num_pages <= 0:
            raise ValueError(f"num_window_pages must be positive, got {num_pages}")
        self.num_pages = num_pages
        self.window = window
        self.block_size = block_size
        # blocks before a kept end whose points stay valid too: a re-rendered turn that differs in
        # its last few tokens still matches to within a block of where it differs
        self.slack = max(1, -(-min(SLACK_TOKENS, window // 4) // block_size))
        self.page_of = [NO_PAGE] * num_blocks  # each block's window page
        self.block_of = [NO_PAGE] * num_pages  # each page's block
        self.users = [0] * num_blocks  # running requests whose window holds the block
        self._free: deque[int] = deque(range(num_pages))
        self.trimmed = 0  # cumulative: pages dropped from live blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_attached(self) -> int:
        return self.num_pages - len(self._free)

    def first_needed(self, num_tokens: int) -> int:
        """The first block a request with `num_tokens` computed tokens may read again: its
        next query's window, from its last full block's end (so that the cache's node,
        which ends there, finds its own window resident)."""
        return max(0, (num_tokens // self.block_size) * self.block_size - self.window) // self.block_size

    def kept_from(self, end_blocks: int) -> int:
        """The first block a kept end at `end_blocks` blocks keeps a page for: the window of
        each point from `slack` blocks before it to it is resident."""
        return self.first_needed(max(0, end_blocks - self.slack) * self.block_size)

    def attach(self, blocks: Iterable[int]) -> None:
        """New blocks (just allocated) each take a free page."""
        for b in blocks:
            if self.page_of[b] != NO_PAGE:
                raise RuntimeError(f"block {b} already has window page {self.page_of[b]}")
            page = self._free.popleft()
            self.page_of[b], self.block_of[page] = page, b

    def release(self, block: int) -> None:
        """The block is free (or trimmed): its page, if any, goes back."""
        page = self.page_of[block]
        if page != NO_PAGE:
            self.page_of[block] = self.block_of[page] = NO_PAGE
            self._free.append(page)

    def trim(self, block: int) -> bool:
        """Drop a live block's page (it becomes a tombstone); False if it had none."""
        if self.page_of[block] == NO_PAGE:
            return False
        self.release(block)
        self.trimmed += 1
        return True

    def reclaim(self, n: int, keep: set[int] = frozenset()) -> int:
        """Under page pressure: drop up to n pages of live blocks that no running request
        reads (users 0) and that are not in `keep` (cached node ends lose their window:
        later matches stop before them). Returns how many were dropped."""
        dropped = 0
        for page, b in enumerate(self.block_of):
            if dropped >= n:
                break
            if b != NO_PAGE and self.users[b] == 0 and b not in keep:
                self.trim(b)
                dropped += 1
        return dropped

    def move(self, source: int, dest: int) -> None:
        """Give `dest` (a block without a page) the page of `source`, a block holding the same
        tokens' KV (a request's duplicate of a cached block): a tombstone healed."""
        page = self.page_of[source]
        self.page_of[source], self.page_of[dest], self.block_of[page] = NO_PAGE, page, dest

    def has_page(self, block: int) -> bool:
        return self.page_of[block] != NO_PAGE

    def valid_prefix(self, blocks: list[int]) -> int:
        """How many of a cached prefix's leading blocks a request may reuse: the longest
        j <= len(blocks) whose window (the blocks from first_needed(j * block_size) to j)
        all have pages."""
        return self.valid_length([self.page_of[b] != NO_PAGE for b in blocks])

    def valid_length(self, resident: list[bool]) -> int:
        """valid_prefix over each block's window residency (a pool block's page, or a tier
        block's saved window page)."""
        j = len(resident)
        while j > 0:
            start = self.first_needed(j * self.block_size)
            hole = next((i for i in range(j - 1, start - 1, -1) if not resident[i]), None)
            if hole is None:
                return j
            j = hole  # every end past the hole but within a window of it sees the hole too
        return 0

    def window_table(self, table: list[int]) -> list[int]:
        """A block table as the window layers read it: pages for blocks, 0 for tombstones
        (never read: they lie before every query's window)."""
        page_of = self.page_of
        return [max(page_of[b], 0) for b in table]

    def check_integrity(self, live: list[int], running_tables: list[tuple[list[int], int]]) -> None:
        """`live`: each block's ref count; `running_tables`: (block table, first needed
        index) of every running request."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("a window page appears twice in the free list")
        attached = [p for p in self.page_of if p != NO_PAGE]
        if any(self.block_of[p] != b for b, p in enumerate(self.page_of) if p != NO_PAGE):
            raise AssertionError("window pages' block_of disagrees with page_of")
        if len(set(attached)) != len(attached):
            raise AssertionError("a window page is attached to two blocks")
        if free & set(attached) or len(free) + len(attached) != self.num_pages:
            raise AssertionError(f"window pages: {len(free)} free + {len(attached)} attached != {self.num_pages}")
        for b, page in enumerate(self.page_of):
            if page != NO_PAGE and live[b] == 0:
                raise AssertionError(f"free block {b} keeps window page {page}")
        users = [0] * len(self.page_of)
        for table, first in running_tables:
            for b in table[first:]:
                users[b] += 1
                if self.page_of[b] == NO_PAGE:
                    raise AssertionError(f"block {b} is in a running request's window but has no window page")
        if users != self.users:
            diff = [(b, have, want) for b, (have, want) in enumerate(zip(self.users, users)) if have != want]
            raise AssertionError(f"window users differ from the running requests (block, have, want): {diff[:10]}")
