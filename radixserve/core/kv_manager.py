"""KVManager: the scheduler's only view of KV memory (plain Python, no tensors).

Behind it: the block pool (reference-counted pool blocks), the radix cache (prefixes over
those blocks and over second-tier slots), the sessions (eviction hints) and, where the
tier is file-backed, its prefetcher (requests whose restore would read the disk wait,
with status PREFETCHING, until their pages are in). The scheduler asks in terms of a
request: match and lock its cached prefix, grow its block table, release it (its computed
blocks go into the cache, its session advances), restore its tier blocks.

    scheduler ──> KVManager ──> BlockPool      allocate, share, free
                            ├─> RadixCache     match, lock, insert, restore, evict
                            ├─> SessionTable   expire, advance
                            └─> TierPrefetch   hold, ready, unhold (kv_tier/, by protocol)
"""

from __future__ import annotations

import math
from typing import Any, Protocol

from radixserve.core.block_pool import BlockPool
from radixserve.core.radix_cache import MatchResult, RadixCache, RadixNode
from radixserve.core.request import Request
from radixserve.core.sessions import SessionTable
from radixserve.kv_tier.index import KVCopy


class TierPrefetch(Protocol):
    """Reads second-tier slots into memory off the engine thread (kv_tier/tiering.py)."""

    def hold(self, key: str, slots: list[int], window_slots: list[int] = ()) -> bool:
        """Start reading these slots (and window slots) if any page of them is out of memory;
        True when the request named `key` must wait for them."""

    def ready(self, wait_s: float = 0.0) -> list[str]:
        """Keys whose slots are in now (or whose hold ran out); may wait up to wait_s."""

    def unhold(self, key: str) -> bool:
        """Forget a held key; False if it is not held."""


class KVManager:
    def __init__(
        self, pool: BlockPool, cache: RadixCache | None, block_size: int,
        sessions: SessionTable | None = None, prefetch: TierPrefetch | None = None, max_chunk_tokens: int = 0,
    ):
        self.pool = pool
        self.max_chunk_tokens = max_chunk_tokens  # the most tokens one request computes in a step
        self.cache = cache
        self.block_size = block_size
        self.sessions = sessions
        self.prefetch = prefetch if cache is not None else None
        # Blocks held outside the queues, e.g. a KV export awaiting its ack (engine/kv_transfer.py):
        # each value has a block_table (a reference per block) and a locked cache_node, like a
        # running request, and counts as one in check_integrity.
        self.external_holds: dict[str, Any] = {}

    @property
    def caching(self) -> bool:
        """Whether prefixes are cached at all (no cache: every request computes everything)."""
        return self.cache is not None

    # ---- each step ----------------------------------------------------------------

    def begin_step(self) -> None:
        if self.sessions is not None:
            self.sessions.expire()

    def take_copies(self) -> list[KVCopy]:
        """The tier copies decided since the last call, to run in order before anything
        reuses the blocks they read (the one place they are drained)."""
        return self.cache.take_copies() if self.cache is not None else []

    def take_tier_events(self) -> list[tuple[str, object]]:
        return self.cache.take_tier_events() if self.cache is not None else []

    # ---- a new request: prefetch its tier pages -------------------------------------

    def hold_for_prefetch(self, request: Request) -> bool:
        """True when the request's restore would read tier pages that are not in memory:
        they are being read in, and the request waits until `prefetched` names it."""
        if self.prefetch is None:
            return False
        tokens = request.token_ids[: request.reusable_prefix_len()]
        slots = self.cache.tier_only_slots(tokens, request.cache_salt)
        windows = self.cache.tier_only_window_slots(tokens, request.cache_salt) if slots else []
        return self.prefetch.hold(request.request_id, slots, windows)

    def prefetched(self, wait_s: float = 0.0) -> list[str]:
        """Ids of held requests that may run now (see TierPrefetch.ready)."""
        return self.prefetch.ready(wait_s) if self.prefetch is not None else []

    def unhold(self, request: Request) -> None:
        if self.prefetch is not None:
            self.prefetch.unhold(request.request_id)

    # ---- admission --------------------------------------------------------------

    def cached_prefix_len(self, request: Request) -> int:
        """Tokens of the request's reusable prefix in the cache, changing nothing."""
        if self.cache is None:
            return 0
        cached, _ = self.cache.peek_prefix(request.token_ids[: request.reusable_prefix_len()], request.cache_salt)
        return cached

    def match_and_lock(self, request: Request) -> MatchResult | None:
        """The request's longest cached prefix, locked against eviction (None: no cache).
        On a hybrid pool, only as far as the window before its end is resident."""
        if self.cache is None:
            return None
        tokens = request.token_ids[: request.reusable_prefix_len()]
        match = self.cache.match_prefix(tokens, request.cache_salt)
        window = self.pool.window
        if window is not None and (match.blocks or match.num_tier_blocks):
            resident = [window.has_page(b) for b in match.blocks]
            if match.num_tier_blocks:
                resident += self.cache.tier_windows(match)  # where a restore brings the window back
            valid = window.valid_length(resident)
            if valid < len(resident):
                match = self.cache.match_prefix(tokens[: valid * self.block_size], request.cache_salt)
        self.cache.lock(match.node)
        return match

    def unlock(self, match: MatchResult | None) -> None:
        if match is not None:
            self.cache.unlock(match.node)

    def fits(self, request: Request, match: MatchResult | None, output_tokens: int = 1, reserved: int = 0,
             alone: bool = False) -> bool:
        """Whether the rest of the request plus `output_tokens` generated tokens fits in what
        is free or evictable beside `reserved` blocks (admission control: an admitted
        request is not preempted at once). `alone`: no other request runs (hybrid KV: the
        windows on cached paths in use may go too, else nothing could ever run)."""
        matched = len(match.blocks) if match is not None else 0
        need = -(-(request.num_tokens + max(output_tokens, 1)) // self.block_size) - matched
        evictable = self.cache.num_evictable_blocks if self.cache is not None else 0
        if self.pool.window is not None and not self._window_room(request, match, alone):
            return False
        return need + reserved <= self.pool.num_free_blocks + evictable

    def _window_room(self, request: Request, match: MatchResult | None, alone: bool = False) -> bool:
        """Hybrid KV: whether the window pages the request's first chunk allocates are free,
        trimming cached windows for them if not (the pool's blocks are checked apart)."""
        matched = len(match.blocks) if match is not None else 0
        tier = match.num_tier_blocks if match is not None else 0
        chunk = min(request.num_tokens, (matched + tier) * self.block_size + self.max_chunk_tokens)
        need = -(-chunk // self.block_size) - matched - tier
        if tier:
            need += sum(self.cache.restore_windows(match))  # the pages a restore brings back
        first = self.pool.window.first_needed((matched + tier) * self.block_size)
        keep = set(match.blocks[first:]) if matched else set()
        return self._free_pages(need, keep, in_use=alone)

    def make_window_room(self, need: int) -> bool:
        """Hybrid KV: whether `need` window pages are free, trimming unlocked cached windows
        for them if not (a KV import's reserve); True on a pool without window pages."""
        return self.pool.window is None or self._free_pages(need)

    def _free_pages(self, need: int, keep: set[int] = frozenset(), in_use: bool = False) -> bool:
        """Hybrid KV: make `need` window pages free by trimming cached windows (their ends
        become tombstones for the window layers; their full-layer KV stays cached), never by
        evicting an entry: that would free no page more, since every page left is read by a
        running request, kept for the one being admitted (`keep`), or kept on the path of a
        request in use (a locked node: a shared prefix's branch, which every later turn
        that lost its own end's window matches to). Those last go too only with `in_use`
        (nothing else runs); otherwise a running request that finds no page is preempted
        (the newest first) and a waiting one waits."""
        window = self.pool.window
        if need > window.num_free and self.cache is not None:
            self._trim_cached_windows(need - window.num_free, keep, in_use)
        return need <= window.num_free

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
        window = self.pool.window
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
        window, bs = self.pool.window, self.block_size
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
        window, bs = self.pool.window, self.block_size
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

    def adopt_match(self, request: Request, match: MatchResult | None) -> None:
        """Give the request the match's blocks (restoring its tier-only part into the pool
        first) and its lock; the request's computed tokens become the matched ones."""
        blocks = []
        if match is not None:
            blocks = self.cache.restore(match) if match.num_tier_blocks else match.blocks
        self.pool.share(blocks)
        request.block_table = list(blocks)
        request.cache_node = match.node if match is not None else None
        if self.pool.window is not None:
            request.window_first = self.pool.window.first_needed(len(blocks) * self.block_size)
            self._use_window(request.block_table[request.window_first:], 1)

    # ---- running ----------------------------------------------------------------

    def grow(self, request: Request, num_tokens: int) -> bool:
        """Give the request blocks for its first num_tokens tokens, evicting cached blocks if needed."""
        need = -(-num_tokens // self.block_size) - len(request.block_table)
        if need <= 0:
            return True
        if self.pool.window is not None and need > self.pool.window.num_free:
            self._free_pages(need)  # hybrid: cached windows go, never an entry for a page
        while need > self.pool.num_free_blocks and self.cache is not None:
            if not self.cache.evict(need - self.pool.num_free_blocks):
                break
        if need > self.pool.num_free:
            return False
        self._extend(request, self.pool.allocate(need))
        return True

    def grow_from_free(self, request: Request, num_tokens: int, keep_free: int) -> bool:
        """Blocks for num_tokens tokens from free blocks only (never evicting), leaving
        keep_free blocks free; False (nothing taken) when they are not there."""
        need = -(-num_tokens // self.block_size) - len(request.block_table)
        if need > self.pool.num_free - keep_free:
            return False
        if need > 0:
            self._extend(request, self.pool.allocate(need))
        return True

    def _extend(self, request: Request, blocks: list[int]) -> None:
        request.block_table.extend(blocks)
        self._use_window(blocks, 1)

    def shrink(self, request: Request) -> None:
        """Drop the blocks past the request's tokens (tail first): only rejected draft
        tokens used them, and they were never published to the cache."""
        keep = -(-request.num_tokens // self.block_size)
        extra = request.block_table[keep:]
        if extra:
            del request.block_table[keep:]
            self._use_window(extra, -1)
            self.pool.free(reversed(extra))

    def insert_computed(self, request: Request) -> None:
        """Publish the request's computed full blocks to the cache and move its lock to
        the node they end at."""
        full = request.num_computed_tokens // self.block_size
        if self.cache is None or not full:
            return
        node = self.cache.insert(request.token_ids, request.block_table[:full], request.cache_salt)
        if self.pool.window is not None and request.num_computed_tokens >= request.num_prompt_tokens:
            self.cache.mark_anchor(node, request.num_prompt_tokens // self.block_size)  # retries, n > 1 resume here
        if node is not request.cache_node:
            self.cache.lock(node)
            if request.cache_node is not None:
                self.cache.unlock(request.cache_node)
            request.cache_node = node

    def release(self, request: Request) -> RadixNode | None:
        """Hand the request's computed full blocks to the cache (its session advances to
        where they end), then drop its references (tail first) and its lock. Returns the
        node where its cached prefix ends (None: no cache)."""
        node = None
        if self.cache is not None:
            full = request.num_computed_tokens // self.block_size
            node = request.cache_node
            if full:
                node = self.cache.insert(request.token_ids, request.block_table[:full], request.cache_salt)
            if self.sessions is not None and request.session_id is not None and node is not None:
                self.sessions.advance(request.cache_salt, request.session_id, node)
            if request.cache_node is not None:
                self.cache.unlock(request.cache_node)
        request.cache_node = None
        self._use_window(request.block_table[request.window_first:], -1)
        request.window_first = 0
        if self.pool.window is not None and node is not None:
            self._mark_anchors(request, node)
            self._heal_cached_path(node, request.block_table)
            self._trim_cached_path(node)
            self.cache.save_windows(node)
        self.pool.free(reversed(request.block_table))
        request.block_table = []
        return node

    # ---- hybrid KV: window pages ------------------------------------------------

    def trim_windows(self, running: list[Request]) -> None:
        """After a step: each running request stops counting the blocks that fell out of its
        window; a page nobody else holds (the block is the request's alone) is dropped now,
        a shared one when its last holder leaves the cache (release)."""
        window = self.pool.window
        if window is None:
            return
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
        window, bs = self.pool.window, self.block_size
        return any(window.kept_from(e // bs) <= index < e // bs for e in ends)

    def _use_window(self, blocks: list[int], delta: int) -> None:
        window = self.pool.window
        if window is not None:
            for b in blocks:
                window.users[b] += delta

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
        window = self.pool.window
        cached = [b for n in reversed(_path(node)) for b in n.blocks]
        for mine, theirs in zip(table, cached):
            if mine != theirs and window.has_page(mine) and not window.has_page(theirs) and window.users[mine] == 0:
                window.move(mine, theirs)

    def _trim_cached_path(self, node: RadixNode) -> None:
        """Drop the pages of the cached path's blocks that no kept node end needs and no
        running request reads. Kept ends (_kept_ends): the path's own end, the ends where it
        branches (a later prompt that shares the prefix diverges there) and its anchors (every
        prompt's and reply's end: retries, regenerations, re-rendered turns resume there)."""
        window, bs = self.pool.window, self.block_size
        ends = _kept_ends(node)
        index = ends[0] // bs if ends else 0
        for n in _path(node):
            for b in reversed(n.blocks):
                index -= 1
                if window.users[b] == 0 and window.has_page(b) and not self._tail_needs(index, ends):
                    window.trim(b)

    def flush(self, namespace: str | None = None) -> int:
        """Drop every unlocked cache entry (only under salt `namespace` and its sub-salts,
        when given); returns the number of pool blocks freed."""
        return self.cache.flush(namespace) if self.cache is not None else 0

    # ---- accounting -------------------------------------------------------------

    def check_integrity(self, running: list[Request], waiting: list[Request]) -> None:
        """Raise AssertionError unless every block reference and node lock is accounted for:
        free + cached + in use == total, ref counts equal their holders, locks equal users."""
        running = [*running, *self.external_holds.values()]
        expected = [0] * self.pool.num_blocks
        for request in running:
            for b in request.block_table:
                expected[b] += 1
        for request in waiting:
            if request.block_table or request.cache_node is not None:
                raise AssertionError(f"waiting {request} holds blocks or a lock")
        if self.cache is not None:
            for b in self.cache.held_blocks():
                expected[b] += 1
            self.cache.check_integrity()
            self._check_locks(running)
            if self.sessions is not None:
                self.sessions.check_integrity()
        self.pool.check_integrity(expected)
        if self.pool.window is not None:
            self.pool.window.check_integrity(expected, [(r.block_table, r.window_first) for r in running
                                                        if hasattr(r, "window_first")])

    def _check_locks(self, running: list[Request]) -> None:
        expected: dict[int, int] = {}
        for request in running:
            node = request.cache_node
            while node is not None and not node.is_root:
                expected[node.node_id] = expected.get(node.node_id, 0) + 1
                node = node.parent
        for node in self.cache.nodes():
            if node.lock_ref != expected.get(node.node_id, 0):
                raise AssertionError(f"{node} lock {node.lock_ref}, held by {expected.get(node.node_id, 0)} requests")


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
