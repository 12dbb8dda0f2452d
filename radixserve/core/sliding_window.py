"""SlidingWindow: the cache component for a hybrid model's sliding-window pages (plain Python).

A window layer's K/V for a block lives in a window page (core/window_pages.py) or nowhere (a
tombstone). This component decides which cached blocks keep their page: the windows before
the tree's kept ends (a path's end, a branch point, an anchor: a prompt's or a reply's end,
where agents resume), while running requests keep theirs; under page pressure cached windows
are trimmed least valuable first, never an entry evicted for a page. A cached match is usable
only up to an end whose window is all resident (usable_blocks): a match is cut there.

Its integrity check (WindowPages.check_integrity): a page is attached to exactly one live
block, free + attached == all pages, every block a running request reads has a page and
the users counts equal the running requests' windows.
"""

from __future__ import annotations

import math

from radixserve.core.block_pool import BlockPool
from radixserve.core.cache_component import CacheComponent
from radixserve.core.radix_cache import MatchResult, RadixCache, RadixNode
from radixserve.core.request import Request


class SlidingWindow(CacheComponent):
    name = "window"

    def __init__(self, pool: BlockPool, block_size: int, max_chunk_tokens: int = 0):
        self.pool = pool
        self.window = pool.window
        self.block_size = block_size
        self.max_chunk_tokens = max_chunk_tokens  # the most tokens one request computes in a step

    # ---- admission ----------------------------------------------------------------

    def usable_blocks(self, match: MatchResult) -> int:
        """Only as far as the window before the match's end is resident (a tier block's
        window counts where a restore brings it back)."""
        resident = [self.window.has_page(b) for b in match.blocks]
        if match.num_tier_blocks:
            resident += self.cache.tier_windows(match)
        return self.window.valid_length(resident)

    def fits(self, request: Request, match: MatchResult, alone: bool) -> bool:
        """Whether the window pages the request's first chunk allocates are free, trimming
        cached windows for them if not (the pool's blocks are checked apart)."""
        matched, tier = len(match.blocks), match.num_tier_blocks
        chunk = min(request.num_tokens, (matched + tier) * self.block_size + self.max_chunk_tokens)
        need = -(-chunk // self.block_size) - matched - tier
        if tier:
            need += sum(self.cache.restore_windows(match))  # the pages a restore brings back
        first = self.window.first_needed((matched + tier) * self.block_size)
        keep = set(match.blocks[first:]) if matched else set()
        return self._free_pages(need, keep, in_use=alone)

    def make_room(self, num_blocks: int) -> bool:
        """Whether pages for `num_blocks` new blocks are free, trimming cached windows for
        them if not (never an entry for a page)."""
        return self._free_pages(num_blocks)

    def _free_pages(self, need: int, keep: set[int] = frozenset(), in_use: bool = False) -> bool:
        """Make `need` window pages free by trimming cached windows (their ends become
        tombstones for the window layers; their full-layer KV stays cached), never by
        evicting an entry: that would free no page more, since every page left is read by a
        running request, kept for the one being admitted (`keep`), or kept on the path of a
        request in use (a locked node: a shared prefix's branch, which every later turn
        that lost its own end's window matches to). Those last go too only with `in_use`
        (nothing else runs); otherwise a running request that finds no page is preempted
        (the newest first) and a waiting one waits."""
        window = self.window
        if need > window.num_free and self.cache.caching:
            self._trim_cached_windows(need - window.num_free, keep, in_use)
        return need <= window.num_free

    # ---- a request's blocks ----------------------------------------------------------

    def adopted(self, request: Request, blocks: list[int]) -> None:
        request.window_first = self.window.first_needed(len(blocks) * self.block_size)
        self._use(request.block_table[request.window_first:], 1)

    def extended(self, request: Request, blocks: list[int]) -> None:
        self._use(blocks, 1)

    def shrunk(self, request: Request, blocks: list[int]) -> None:
        self._use(blocks, -1)

    def inserted(self, request: Request, node: RadixNode) -> None:
        if request.num_computed_tokens >= request.num_prompt_tokens:
            self.cache.mark_anchor(node, request.num_prompt_tokens // self.block_size)  # retries, n > 1 resume here

    def released(self, request: Request, node: RadixNode | None) -> None:
        self._use(request.block_table[request.window_first:], -1)
        request.window_first = 0
        if node is not None:
            self._mark_anchors(request, node)
            self._heal_cached_path(node, request.block_table)
            self._trim_cached_path(node)
            self.cache.save_windows(node)

    def check_integrity(self, refs: list[int], running: list) -> None:
        self.window.check_integrity(refs, [(r.block_table, r.window_first) for r in running
                                           if hasattr(r, "window_first")])

    # ---- trimming ------------------------------------------------------------------

    def _trim_cached_windows(self, need: int, keep: set[int] = frozenset(), in_use: bool = False) -> int:
        """Drop at least `need` pages of the cache's blocks that no running request reads
        (none of `keep`): first pages that serve no resident window at all, then whole kept
        windows (_cached_ends) least valuable first: demoted sessions' before the others',
        protected ones' last, and within a rank by compute saved per page, the tokens a match
        ending there would recompute without it (back to the kept end before it) over its
        share of the pages it keeps (a page kept by k windows counts 1/k to each), discounted
        by the log of how long ago (recency ticks) a match or an insert last ended there: an
        agent that comes back after the others' turns is still likely to, so age weighs less
        than what a window saves.
        Unlocked ends only unless `in_use` (then locked ones after them); then the pages that
        trimming left serving nothing. Returns how many were dropped."""
        window = self.window
        dropped = self._trim_orphan_pages(keep)
        if dropped >= need:
            return dropped
        ends = self._cached_ends()
        kept = [0] * self.pool.num_blocks  # kept windows holding each block
        for _, blocks, _ in ends:
            for b in blocks:
                kept[b] += 1
        now = self.cache.now()
        order = []
        for node, blocks, saved in ends:
            if node.lock_ref and not in_use:
                continue
            own = sum(1 / kept[b] for b in blocks if window.users[b] == 0 and b not in keep and window.has_page(b))
            if own:
                value = saved / (own * math.log2(now - node.end_access + 2))
                order.append(((node.lock_ref > 0, node.rank, value, node.node_id), blocks))
        order.sort(key=lambda o: o[0])
        for _, blocks in order:
            for b in blocks:
                kept[b] -= 1
                if kept[b] == 0 and window.users[b] == 0 and b not in keep and window.trim(b):
                    dropped += 1
            if dropped >= need:
                break
        return dropped + self._trim_orphan_pages(keep)

    def _cached_ends(self) -> list[tuple[RadixNode, list[int], int]]:
        """Every kept end of the cache's pool part (a path's end, a branch point, an anchor):
        its node, the blocks of its window (with slack) and the tokens from the kept end
        before it on its path (or the root) to it."""
        window, bs = self.window, self.block_size
        span = window.window // bs + window.slack + 2  # at least any kept window's blocks
        tails: dict[int, list[int]] = {}  # node id -> the last `span` blocks of its path
        prev: dict[int, int] = {}  # node id -> depth of the deepest kept end above and at it
        ends = []
        for node, depth in _pool_nodes(self.cache):
            parent = node.parent
            tail = (tails.get(parent.node_id, []) + node.blocks)[-span:]
            tails[node.node_id] = tail
            end = depth + len(node.blocks)
            above = prev.get(parent.node_id, 0)
            if _kept_end(node):
                first = window.kept_from(end)
                ends.append((node, tail[len(tail) - (end - first):], (end - above) * bs))
                above = end
            prev[node.node_id] = above
        return ends

    def _trim_orphan_pages(self, keep: set[int] = frozenset()) -> int:
        """Drop the pages of cached blocks that lie in no resident window: a match can stop
        at a block boundary only where the window before it is all resident, so a page
        serves something only inside a run of resident blocks, along some path of the tree,
        at least a window long or reaching back to the root. Returns how many were dropped."""
        window, bs = self.window, self.block_size
        span = -(-window.window // bs)  # blocks in the window before a block-aligned end
        order = _pool_nodes(self.cache)
        up: dict[int, tuple[int, bool]] = {}  # node id -> (resident run ending at its last block, from the root)
        for node, _ in order:
            parent = node.parent
            run, rooted = up.get(parent.node_id, (0, True)) if not parent.is_root else (0, True)
            for b in node.blocks:
                run, rooted = (run + 1, rooted) if window.has_page(b) else (0, False)
            up[node.node_id] = (run, rooted)
        down: dict[int, int] = {}  # node id -> resident run from its first block down some path
        for node, _ in reversed(order):
            below = max((down.get(c.node_id, 0) for c in node.children.values()), default=0)
            run = 0
            for b in reversed(node.blocks):
                run = run + 1 if window.has_page(b) else 0
                if run == 0:
                    below = 0
            down[node.node_id] = run + below if run == len(node.blocks) else run
        dropped = 0
        for node, _ in order:
            parent = node.parent
            run, rooted = up.get(parent.node_id, (0, True)) if not parent.is_root else (0, True)
            below = max((down.get(c.node_id, 0) for c in node.children.values()), default=0)
            after = [0] * len(node.blocks)  # resident run after each block, down some path
            tail = below
            for k in range(len(node.blocks) - 1, -1, -1):
                after[k] = tail
                tail = tail + 1 if window.has_page(node.blocks[k]) else 0
            for k, b in enumerate(node.blocks):
                if not window.has_page(b):
                    run, rooted = 0, False
                    continue
                run += 1
                if rooted or run + after[k] >= span or window.users[b] or b in keep:
                    continue
                window.trim(b)
                dropped += 1
        return dropped

    def after_step(self, running: list[Request]) -> None:
        """After a step: each running request stops counting the blocks that fell out of its
        window; a page nobody else holds (the block is the request's alone) is dropped now,
        a shared one when its last holder leaves the cache (release)."""
        window = self.window
        for request in running:
            first = min(window.first_needed(request.num_computed_tokens), len(request.block_table))
            if first <= request.window_first:
                continue
            ends = cached = None  # the request's cached path: its kept ends and blocks, found when needed
            for i in range(request.window_first, first):
                b = request.block_table[i]
                window.users[b] -= 1
                if window.users[b] or not window.has_page(b):
                    continue
                if ends is None:
                    ends = _kept_ends(request.cache_node)
                    cached = [c for n in reversed(_path(request.cache_node)) for c in n.blocks]
                needed = self._tail_needs(i, ends)
                if self.pool.ref_counts[b] > 1:  # shared: trimmed unless a kept node end needs it
                    if i >= (ends[0] if ends else 0) // self.block_size or needed:
                        continue
                elif needed and i < len(cached) and not window.has_page(cached[i]):
                    window.move(b, cached[i])  # the cache's own block for these tokens was a tombstone
                    continue
                window.trim(b)
            request.window_first = first

    def _tail_needs(self, index: int, ends: list[int]) -> bool:
        """Whether block `index` lies in the window (with its slack) before one of these node ends."""
        window, bs = self.window, self.block_size
        return any(window.kept_from(e // bs) <= index < e // bs for e in ends)

    def _use(self, blocks: list[int], delta: int) -> None:
        users = self.window.users
        for b in blocks:
            users[b] += delta

    def _mark_anchors(self, request: Request, node: RadixNode) -> None:
        """The ends where agents resume keep their windows: the request's prompt's (a retry, a
        regenerated reply, the next question on a shared prefix) and its own (the next turn)."""
        if node.is_root:
            return
        node.anchor = True
        self.cache.mark_anchor(node, request.num_prompt_tokens // self.block_size)

    def _heal_cached_path(self, node: RadixNode, table: list[int]) -> None:
        """Where the cache kept its own block for tokens the request computed again (its match
        stopped at a tombstone), the cached block takes the request's window page."""
        window = self.window
        cached = [b for n in reversed(_path(node)) for b in n.blocks]
        for mine, theirs in zip(table, cached):
            if mine != theirs and window.has_page(mine) and not window.has_page(theirs) and window.users[mine] == 0:
                window.move(mine, theirs)

    def _trim_cached_path(self, node: RadixNode) -> None:
        """Drop the pages of the cached path's blocks that no kept node end needs and no
        running request reads. Kept ends (_kept_ends): the path's own end, the ends where it
        branches (a later prompt that shares the prefix diverges there) and its anchors (every
        prompt's and reply's end: retries, regenerations, re-rendered turns resume there)."""
        window, bs = self.window, self.block_size
        ends = _kept_ends(node)
        index = ends[0] // bs if ends else 0
        for n in _path(node):
            for b in reversed(n.blocks):
                index -= 1
                if window.users[b] == 0 and window.has_page(b) and not self._tail_needs(index, ends):
                    window.trim(b)


def _path(node: RadixNode) -> list[RadixNode]:
    """node and its ancestors, deepest first (roots excluded)."""
    path = []
    while node is not None and not node.is_root:
        path.append(node)
        node = node.parent
    return path


def _pool_nodes(cache: RadixCache) -> list[tuple[RadixNode, int]]:
    """The cache's nodes with pool blocks and their depth in blocks, parents before children."""
    out, ends = [], {}
    for node in cache.nodes():  # parents before children
        if node.blocks:
            depth = ends.get(node.parent.node_id, 0)
            ends[node.node_id] = depth + len(node.blocks)
            out.append((node, depth))
    return out


def _kept_ends(node: RadixNode | None) -> list[int]:
    """Token counts at which the path to `node` keeps a window, deepest first: its own end,
    each anchor's (a prompt's or a reply's end) and each ancestor's that branches (two or
    more children)."""
    path = _path(node) if node is not None else []
    ends, end = [], sum(len(n.tokens) for n in path)
    for depth, n in enumerate(path):
        if depth == 0 or n.anchor or len(n.children) > 1:
            ends.append(end)
        end -= len(n.tokens)
    return ends


def _kept_end(node: RadixNode) -> bool:
    """Whether a pool node's end keeps its window: a path's end in the pool, a branch point, an anchor."""
    return node.anchor or len(node.children) > 1 or not any(c.blocks for c in node.children.values())
