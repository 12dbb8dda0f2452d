"""RadixCache: a radix tree of token prefixes over reference-counted KV blocks (plain Python),
with an optional second tier that evicted blocks move to instead of being dropped.

The tree is block-granular: every node holds a run of whole blocks and their token ids. A
child is keyed by the token ids of its first block, so two children of one node never
start with the same block. Each node knows where its blocks live: in the pool (`blocks`,
pool block ids), in the tier (`slots`, tier slot ids), or both (a clean copy in the tier).

    root ── [sys prompt: pool 3 7 9] ─┬─ [question A: pool 12 13] ── [answer A: tier 4]
                                      └─ [question B: tier 0 1, pool 15 16]

Residency is top-connected: a node in the pool has its parent in the pool, so the pool
part of any match is a prefix of it, and restoring a match brings in its tail top down.

Ownership: the tree holds one BlockPool reference on every pool block it stores and owns
its tier slots. A request that reuses a prefix takes its own reference on each block and
locks the node where the prefix ends; locking a node locks its ancestors. Only unlocked
pool leaves (no child in the pool) leave the pool: least recently used first, within the
eviction rank that sessions give (demoted, then normal, then protected). A leaving node
moves to the tier when the tier has room (taking its least valuable entries if the one
leaving is worth more), else it is dropped with everything below it.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass

from sortedcontainers import SortedSet

from radixserve.core.block_pool import BlockPool
from radixserve.core.hashing import chain_hashes, root_hash
from radixserve.core.kv_events import POOL, TIER, KVEventLog
from radixserve.kv_tier.index import KVCopy, KVTier, TierEntry

RANK_DEMOTED, RANK_NORMAL, RANK_PROTECTED = 0, 1, 2


class RadixNode:
    __slots__ = (
        "node_id", "parent", "children", "tokens", "blocks", "slots", "window_slots", "digests", "salt", "lock_ref",
        "last_access", "protect", "demoted", "alive", "sort_key", "ev_count", "anchor", "end_access",
    )

    def __init__(self, node_id: int, parent: "RadixNode | None", tokens: list[int], blocks: list[int]):
        self.node_id = node_id
        self.parent = parent
        self.children: dict[tuple[int, ...], RadixNode] = {}
        self.tokens = tokens
        self.blocks = blocks  # pool block ids; [] when the node is only in the tier
        self.slots: list[int] = []  # tier slot ids; [] when the node has no tier copy
        self.window_slots: list[int] = []  # hybrid KV: each tier block's window-page slot (-1: none), or []
        self.digests: list[int] = []  # chained hash of each block's prefix (tier on)
        self.salt: str | None = None
        self.lock_ref = 0
        self.last_access = 0
        self.protect = 0  # sessions and pins whose context passes through this node
        self.demoted = False  # a session moved past this branch: evict it first
        self.alive = True
        self.sort_key: tuple[int, int, int] = (RANK_NORMAL, 0, node_id)
        self.ev_count = 0  # pool blocks this node adds to num_evictable_blocks
        self.anchor = False  # hybrid KV: a prompt's or a reply's end (where agents resume): keeps its window
        self.end_access = 0  # when a match or an insert last ended exactly here (0: never)

    @property
    def is_root(self) -> bool:
        return self.parent is None

    @property
    def in_pool(self) -> bool:
        return bool(self.blocks)

    @property
    def rank(self) -> int:
        if self.protect > 0:
            return RANK_PROTECTED
        return RANK_DEMOTED if self.demoted else RANK_NORMAL

    def __repr__(self) -> str:
        return f"RadixNode(#{self.node_id}, blocks={self.blocks}, slots={self.slots}, lock={self.lock_ref})"


@dataclass(frozen=True)
class MatchResult:
    """The longest cached block-aligned prefix: the pool blocks of its pool part, how many
    blocks follow them in the tier only (restore() brings those in), and where it ends."""

    blocks: list[int]
    node: RadixNode
    num_tier_blocks: int = 0


class RadixCache:
    """Prefix tree over KV blocks in one or two tiers; see the module docstring."""

    caching = True

    def __init__(
        self, pool: BlockPool, block_size: int, tier: KVTier | None = None,
        write_through: bool = False, record_entries: bool = False, events: KVEventLog | None = None,
        window_tier: KVTier | None = None,
    ):
        self.pool = pool
        # hybrid KV: tier slots for window pages; a block saved while it has a page keeps it in one
        # (if one is free), and a restored block has a page only where its window came back
        self.window_tier = window_tier if tier is not None and pool.window is not None else None
        self.events = events  # every block stored and removed, medium by medium (KV events)
        self._digests = tier is not None or events is not None  # nodes name their blocks by chained hash
        self.block_size = block_size
        self.tier = tier
        self.write_through = write_through and tier is not None  # every new block gets a tier copy
        self.record_entries = record_entries and tier is not None  # report slot contents (persistence)
        self._ids = itertools.count()
        self._clock = itertools.count(1)
        self._roots: dict[str | None, RadixNode] = {}
        # Pool leaves and tier candidates in eviction order: eviction never scans the tree.
        self._evictable = SortedSet(key=lambda n: n.sort_key)
        self._tier_evictable = SortedSet(key=lambda n: n.sort_key)
        # hybrid KV: those of the tier candidates that hold window slots (what a save may take)
        self._window_holders = SortedSet(key=lambda n: n.sort_key)
        self.num_cached_blocks = 0  # pool blocks stored in the tree
        self.num_evictable_blocks = 0  # of those, blocks in unlocked nodes
        self.num_tier_blocks = 0  # tier slots held by the tree
        self.num_nodes = 0  # excluding roots
        self.evicted_blocks = 0  # cumulative: blocks that left the pool
        self.evictions: Counter[str] = Counter()  # blocks by reason: demoted, dropped, tier_dropped, flushed
        self.restored_blocks = 0
        self.tier_hits = 0  # matches that restored at least one block
        self.copies: list[KVCopy] = []  # tier copies decided since the last take_copies()
        self.tier_events: list[tuple[str, object]] = []  # ("set", TierEntry) / ("free", slot)
        self.components: list = []  # the KV manager's cache components (core/cache_component.py)

    # ---- matching and inserting -----------------------------------------------------

    def match_prefix(self, tokens: list[int], salt: str | None = None) -> MatchResult:
        """Longest stored prefix of `tokens` made of whole blocks, in either tier. Splits the
        last node when the match ends inside it, so the returned node ends exactly at the
        match. Marks the path as recently used. Takes no references and no locks."""
        bs = self.block_size
        node = self._root(salt)
        blocks: list[int] = []
        tier_blocks = 0
        pos = 0
        now = next(self._clock)
        while pos + bs <= len(tokens):
            child = node.children.get(tuple(tokens[pos:pos + bs]))
            if child is None:
                break
            n = self._common_blocks(child, tokens, pos, len(tokens))
            if n < self._size(child):
                child = self._split(child, n)
            self._touch(child, now)
            if child.in_pool and not tier_blocks:
                blocks.extend(child.blocks)
            else:
                tier_blocks += n
            pos += n * bs
            node = child
        node.end_access = now
        return MatchResult(blocks, node, tier_blocks)

    def peek_prefix(self, tokens: list[int], salt: str | None = None) -> tuple[int, RadixNode | None]:
        """Read-only match for ordering the queue: (cached tokens, node the match reaches).
        Changes nothing: no split, no recency update."""
        bs = self.block_size
        node = self._roots.get(salt)
        if node is None:
            return 0, None
        pos = 0
        while pos + bs <= len(tokens):
            child = node.children.get(tuple(tokens[pos:pos + bs]))
            if child is None:
                break
            n = self._common_blocks(child, tokens, pos, len(tokens))
            pos += n * bs
            node = child
            if n < self._size(child):
                break
        return pos, node

    def tier_only_slots(self, tokens: list[int], salt: str | None = None) -> list[int]:
        """The tier slots a restore of `tokens`' cached prefix would read (its tier-only
        part), found without changing the tree (no split, no recency)."""
        return [s for node, take in self._tier_only(tokens, salt) for s in node.slots[:take]]

    def tier_only_window_slots(self, tokens: list[int], salt: str | None = None) -> list[int]:
        """Hybrid KV: the window slots that restore would read (those of its blocks saved with
        their window), found the same way."""
        return [w for node, take in self._tier_only(tokens, salt) for w in node.window_slots[:take] if w >= 0]

    def _tier_only(self, tokens: list[int], salt: str | None) -> list[tuple[RadixNode, int]]:
        """(node, how many of its leading blocks) of the tier-only part of `tokens`' cached
        prefix, top down; changes nothing."""
        matched, node = self.peek_prefix(tokens, salt)
        if node is None or node.is_root:
            return []
        bs = self.block_size
        left = matched // bs
        parts = []
        for node in reversed(self._path(node)):
            take = min(len(node.tokens) // bs, left)
            left -= take
            if not node.blocks:
                parts.append((node, take))
        return parts

    def tier_windows(self, match: MatchResult) -> list[bool]:
        """Hybrid KV: for each block of the match's tier-only tail, in order, whether its
        window page is in the tier too (a restore brings it back; the others come back as
        tombstones)."""
        path = []
        node = match.node
        while not node.is_root and not node.in_pool:
            path.append(node)
            node = node.parent
        return [w >= 0 for n in reversed(path) for w in self._window_slots(n)]

    def restore_windows(self, match: MatchResult) -> list[bool]:
        """Hybrid KV: for each block of the match's tier-only tail, whether a restore gives it a
        window page: saved with its window and within the window before the match's end (the
        request reads none further back, and a page there would serve no end of its path)."""
        saved = self.tier_windows(match)
        first = self.pool.window.first_needed((len(match.blocks) + len(saved)) * self.block_size) - len(match.blocks)
        return [w and i >= first for i, w in enumerate(saved)]

    def _window_slots(self, node: RadixNode) -> list[int]:
        return node.window_slots or [-1] * len(node.slots)

    def restore(self, match: MatchResult) -> list[int]:
        """Bring the tier-only tail of a (locked) match into the pool, top down, evicting
        other entries as needed; returns the pool blocks of the whole match. The copies are
        queued in `copies`. Raises MemoryError (nothing restored) if the pool cannot hold it."""
        if not match.num_tier_blocks:
            return list(match.blocks)
        path = []
        node = match.node
        while not node.is_root and not node.in_pool:
            path.append(node)
            node = node.parent
        need = sum(self._size(n) for n in path)
        given = self.restore_windows(match) if self.pool.window is not None else []
        pages = sum(given) if self.pool.window is not None else need
        if need > self.pool.num_free_blocks:
            self.evict(need - self.pool.num_free_blocks)
        if need > self.pool.num_free_blocks or (self.pool.window is not None and pages > self.pool.window.num_free):
            raise MemoryError(f"restoring {need} blocks ({pages} window pages): only {self.pool.num_free} free")
        blocks = list(match.blocks)
        for node in reversed(path):
            if self.pool.window is None:
                node.blocks = self.pool.allocate(len(node.slots))
                self.copies.extend(KVCopy(False, b, s) for b, s in zip(node.blocks, node.slots))
            else:  # a window page only where restore_windows gives one: the others are tombstones
                windows = self._window_slots(node)
                mine, given = given[:len(node.slots)], given[len(node.slots):]
                node.blocks = self.pool.allocate(len(node.slots), mine)
                page_of = self.pool.window.page_of
                self.copies.extend(KVCopy(False, b, s, page_of[b], w) if g else KVCopy(False, b, s)
                                   for b, s, w, g in zip(node.blocks, node.slots, windows, mine))
            self._stored(node, POOL)
            self.num_cached_blocks += len(node.blocks)
            blocks.extend(node.blocks)
            self._refresh(node)
            self._refresh(node.parent)
        self.restored_blocks += need
        self.tier_hits += 1
        return blocks

    def insert(self, tokens: list[int], blocks: list[int], salt: str | None = None) -> RadixNode:
        """Store the prefix `tokens[:len(blocks) * block_size]` held in `blocks`.

        Where the tree already holds a pool block for the same tokens, the tree keeps its own
        and the caller's duplicate is not adopted (the caller frees it with the rest of its
        references); where it holds the tokens only in the tier, it adopts the caller's
        blocks. Returns the node where the inserted prefix ends.
        """
        bs = self.block_size
        if len(tokens) < len(blocks) * bs:
            raise ValueError(f"{len(blocks)} blocks need {len(blocks) * bs} tokens, got {len(tokens)}")
        node = self._root(salt)
        pos = 0
        now = next(self._clock)
        end = len(blocks) * bs
        while pos < end:
            child = node.children.get(tuple(tokens[pos:pos + bs]))
            if child is None:
                return self._add_leaf(node, tokens[pos:end], blocks[pos // bs:], now)
            n = self._common_blocks(child, tokens, pos, end)
            if n < self._size(child):
                child = self._split(child, n)
            if not child.in_pool:
                self._adopt(child, blocks[pos // bs:pos // bs + n])
            self._touch(child, now)
            pos += n * bs
            node = child
        node.end_access = now
        return node

    def mark_anchor(self, node: RadixNode, num_blocks: int) -> RadixNode | None:
        """Mark the end of the first `num_blocks` blocks of `node`'s path as an anchor (hybrid
        KV: a prompt's or a reply's end, whose window the cache keeps), splitting the node
        there if it ends further on; returns that node (None for 0 blocks)."""
        path = self._path(node)
        end = sum(self._size(n) for n in path)
        if not 0 < num_blocks <= end:
            return None
        for n in path:  # deepest first
            start = end - self._size(n)
            if start < num_blocks:
                if num_blocks < end:
                    n = self._split(n, num_blocks - start)
                n.anchor = True
                n.end_access = max(n.end_access, node.end_access)
                return n
            end = start
        return None

    def now(self) -> int:
        """The recency clock (a tick of it)."""
        return next(self._clock)

    # ---- locks and hints ------------------------------------------------------------

    def lock(self, node: RadixNode) -> None:
        """Protect `node` and its ancestors from eviction (counted: lock twice, unlock twice)."""
        while not node.is_root:
            node.lock_ref += 1
            self._refresh(node)
            node = node.parent

    def unlock(self, node: RadixNode) -> None:
        while not node.is_root:
            if node.lock_ref <= 0:
                raise RuntimeError(f"unlock of unlocked node {node}")
            node.lock_ref -= 1
            self._refresh(node)
            node = node.parent

    def protect(self, node: RadixNode, delta: int = 1) -> None:
        """Raise (delta=1) or lower (delta=-1) the eviction rank of node and its ancestors:
        protected entries leave after unprotected ones. A hint, never a reservation."""
        while node is not None and not node.is_root:
            node.protect += delta
            if node.protect < 0:
                raise RuntimeError(f"unprotect of unprotected node {node}")
            self._refresh(node)
            node = node.parent

    def demote_branch(self, old: RadixNode, keep: RadixNode | None) -> int:
        """Mark the nodes on old's path that are not on keep's path as first to evict (a
        session moved on from them); returns how many were marked."""
        on_keep = set()
        node = keep
        while node is not None and not node.is_root:
            on_keep.add(node.node_id)
            node = node.parent
        marked = 0
        node = old
        while node is not None and not node.is_root and node.node_id not in on_keep:
            if node.alive and node.protect == 0:
                node.demoted = True
                self._refresh(node)
                marked += 1
            node = node.parent
        return marked

    # ---- eviction -------------------------------------------------------------------

    def evict(self, num_blocks: int) -> int:
        """Free at least `num_blocks` pool blocks if that many are evictable, taking unlocked
        pool leaves in eviction order and each leaf's deepest blocks first; with a tier they
        move there. Returns how many pool blocks were freed."""
        freed = 0
        while freed < num_blocks and self._evictable:
            leaf = self._evictable[0]
            take = min(num_blocks - freed, self._size(leaf))
            if take < self._size(leaf):
                self._split(leaf, self._size(leaf) - take)  # leaf keeps the deepest `take` blocks
            freed += self._leave_pool(leaf)
        return freed

    def flush(self, namespace: str | None = None) -> int:
        """Drop every unlocked entry from both tiers (only under salt `namespace` and the
        salts `namespace/...` below it, when given); returns the number of pool blocks freed."""
        freed = 0
        for node in reversed(list(self.nodes(namespace))):  # children before parents
            if node.alive and node.lock_ref == 0 and not node.children:
                freed += self._drop(node, "flushed")
        return freed

    def take_copies(self) -> list[KVCopy]:
        copies, self.copies = self.copies, []
        return copies

    def take_tier_events(self) -> list[tuple[str, object]]:
        events, self.tier_events = self.tier_events, []
        return events

    # ---- loading a persisted tier ---------------------------------------------------

    def load_tier_entries(self, entries: list[TierEntry]) -> list[TierEntry]:
        """Rebuild tier-only nodes from persisted block entries (before any request runs).
        An entry is adopted only if its digest chain from its namespace's root checks out
        and its slot is unused; returns the entries adopted. Hybrid KV: an adopted entry keeps
        its window slot where that is in range and unused (else it comes back as a tombstone
        for the window layers: its entry as returned says -1)."""
        if self.tier is None:
            return []
        windows: set[int] = set()

        def window_of(e: TierEntry) -> TierEntry:
            w = e.window_slot
            if w < 0 or (self.window_tier is not None and 0 <= w < self.window_tier.num_slots and w not in windows):
                windows.add(w)
                return e
            return TierEntry(e.slot, e.salt, e.parent, e.digest, e.tokens)

        by_parent: dict[tuple[str | None, int], list[TierEntry]] = {}
        for e in entries:
            if 0 <= e.slot < self.tier.num_slots and len(e.tokens) == self.block_size:
                by_parent.setdefault((e.salt, e.parent), []).append(e)
        adopted: list[TierEntry] = []
        used: set[int] = set()
        for salt in {e.salt for e in entries}:
            root = self._root(salt)
            stack = [(root, root_hash(salt))]
            while stack:
                node, digest = stack.pop()
                for e in by_parent.get((salt, digest), ()):
                    key = tuple(e.tokens)
                    if e.slot in used or key in node.children:
                        continue
                    if chain_hashes(digest, list(e.tokens), self.block_size) != [e.digest]:
                        continue
                    used.add(e.slot)
                    e = window_of(e)
                    adopted.append(e)
                    stack.append((self._add_tier_leaf(node, e), e.digest))
        self.tier.take(used)
        if self.window_tier is not None:
            self.window_tier.take(windows - {-1})
        return adopted

    # ---- reading the tree -----------------------------------------------------------

    def nodes(self, namespace: str | None = None):
        """Every node except the roots, parents before children; with `namespace`, only
        those under salt `namespace` and its sub-salts `namespace/...`."""
        stack = [root for salt, root in self._roots.items() if _within(salt, namespace)]
        while stack:
            node = stack.pop()
            if not node.is_root:
                yield node
            stack.extend(node.children.values())

    def held_blocks(self) -> list[int]:
        """Every pool block id the tree holds a reference on (for integrity checks)."""
        return [b for node in self.nodes() for b in node.blocks]

    def held_slots(self) -> list[int]:
        return [s for node in self.nodes() for s in node.slots]

    def check_integrity(self) -> None:
        """Raise AssertionError if the counters, the eviction sets, the block locations or
        the tier's slots disagree with the tree."""
        cached = evictable = nodes = tier_blocks = 0
        want_evictable, want_tier = set(), set()
        stack = [(root, 0) for root in self._roots.values()]
        while stack:
            node, parent_lock = stack.pop()
            if not node.is_root:
                nodes += 1
                cached += len(node.blocks)
                tier_blocks += len(node.slots)
                self._check_node(node, parent_lock)
                if node.lock_ref == 0:
                    evictable += len(node.blocks)
                if self._pool_evictable(node):
                    want_evictable.add(node.node_id)
                if self._tier_candidate(node):
                    want_tier.add(node.node_id)
            lock = node.lock_ref if not node.is_root else float("inf")
            stack.extend((c, lock) for c in node.children.values())
        counters = (self.num_cached_blocks, self.num_evictable_blocks, self.num_nodes, self.num_tier_blocks)
        if counters != (cached, evictable, nodes, tier_blocks):
            raise AssertionError(
                f"counters (cached, evictable, nodes, tier) = {counters}, tree says {(cached, evictable, nodes, tier_blocks)}"
            )
        got = {n.node_id for n in self._evictable}
        if got != want_evictable:
            raise AssertionError(f"evictable set {sorted(got)} != unlocked pool leaves {sorted(want_evictable)}")
        got_tier = {n.node_id for n in self._tier_evictable}
        if got_tier != want_tier:
            raise AssertionError(f"tier eviction set {sorted(got_tier)} != candidates {sorted(want_tier)}")
        holders = {n.node_id for n in self._window_holders}
        if holders != {n.node_id for n in self._tier_evictable if _holds_window(n)}:
            raise AssertionError(f"window holders {sorted(holders)} are not the tier candidates holding windows")
        if self.tier is not None:
            self.tier.check_integrity(self.held_slots())
        if self.window_tier is not None:
            self.window_tier.check_integrity([w for node in self.nodes() for w in node.window_slots if w >= 0])
        if self.tier is None and tier_blocks:
            raise AssertionError("tier slots held without a tier")

    # ---- helpers ----------------------------------------------------------------

    def _path(self, node: RadixNode) -> list[RadixNode]:
        """The nodes from `node` up to its root's child."""
        path = []
        while not node.is_root:
            path.append(node)
            node = node.parent
        return path

    def _size(self, node: RadixNode) -> int:
        return len(node.tokens) // self.block_size

    def _root(self, salt: str | None) -> RadixNode:
        root = self._roots.get(salt)
        if root is None:
            root = self._roots[salt] = RadixNode(next(self._ids), None, [], [])
            root.salt = salt
            if self._digests:
                root.digests = [root_hash(salt)]
        return root

    def _common_blocks(self, node: RadixNode, tokens: list[int], pos: int, end: int) -> int:
        """How many of node's blocks match tokens[pos:end] (at least 1: the key matched)."""
        bs = self.block_size
        n = 1
        limit = min(self._size(node), (end - pos) // bs)
        while n < limit and node.tokens[n * bs:(n + 1) * bs] == tokens[pos + n * bs:pos + (n + 1) * bs]:
            n += 1
        return n

    def _split(self, node: RadixNode, n_blocks: int) -> RadixNode:
        """Cut node after n_blocks; returns the new upper part (which keeps node's key)."""
        bs = self.block_size
        parent = node.parent
        upper = RadixNode(next(self._ids), parent, node.tokens[:n_blocks * bs], node.blocks[:n_blocks])
        upper.slots = node.slots[:n_blocks]
        upper.window_slots = node.window_slots[:n_blocks]
        upper.digests = node.digests[:n_blocks]
        for attr in ("salt", "lock_ref", "last_access", "protect", "demoted"):
            setattr(upper, attr, getattr(node, attr))
        parent.children[tuple(upper.tokens[:bs])] = upper
        node.tokens = node.tokens[n_blocks * bs:]
        node.blocks = node.blocks[n_blocks:]
        node.slots = node.slots[n_blocks:]
        node.window_slots = node.window_slots[n_blocks:]
        node.digests = node.digests[n_blocks:]
        node.parent = upper
        upper.children[tuple(node.tokens[:bs])] = node
        self.num_nodes += 1
        self._refresh(node)
        self._refresh(upper)
        return upper

    def _new_node(self, parent: RadixNode, tokens: list[int], blocks: list[int], now: int) -> RadixNode:
        node = RadixNode(next(self._ids), parent, list(tokens), list(blocks))
        node.last_access = now
        node.salt = parent.salt
        if self._digests:
            node.digests = chain_hashes(parent.digests[-1], node.tokens, self.block_size)
        parent.children[tuple(tokens[:self.block_size])] = node
        self.num_nodes += 1
        return node

    def _add_leaf(self, parent: RadixNode, tokens: list[int], blocks: list[int], now: int) -> RadixNode:
        leaf = self._new_node(parent, tokens, blocks, now)
        self.pool.share(blocks)
        self._stored(leaf, POOL)
        self.num_cached_blocks += len(blocks)
        self._refresh(leaf)
        self._refresh(parent)
        if self.write_through and self._make_tier_room(len(blocks), leaf.sort_key):
            self._save(leaf)
        return leaf

    def _add_tier_leaf(self, parent: RadixNode, entry: TierEntry) -> RadixNode:
        node = self._new_node(parent, list(entry.tokens), [], next(self._clock))
        node.slots = [entry.slot]
        if self.window_tier is not None:
            node.window_slots = [entry.window_slot]
        self._stored(node, TIER)
        self.num_tier_blocks += 1
        self._refresh(node)
        self._refresh(parent)
        return node

    def _adopt(self, node: RadixNode, blocks: list[int]) -> None:
        """A tier-only node gets pool blocks computed by a request (the same tokens)."""
        self.pool.share(blocks)
        node.blocks = list(blocks)
        self._stored(node, POOL)
        self.num_cached_blocks += len(blocks)
        self._refresh(node)
        self._refresh(node.parent)

    def _leave_pool(self, leaf: RadixNode) -> int:
        """Take an unlocked pool leaf out of the pool: keep it in the tier if it has a copy
        there or the tier makes room for it, else drop it with its subtree."""
        n = len(leaf.blocks)
        if not leaf.slots and not self._make_tier_room(n, leaf.sort_key):
            return self._drop(leaf, "dropped")
        if not leaf.slots:
            self._save(leaf)
        freed = self.pool.free(reversed(leaf.blocks))
        self._removed(leaf, POOL)
        self.num_cached_blocks -= n
        self.evicted_blocks += n
        self.evictions["demoted"] += n
        leaf.blocks = []
        self._refresh(leaf)
        self._refresh(leaf.parent)
        return freed

    def _save(self, node: RadixNode) -> None:
        node.slots = self.tier.allocate(len(node.blocks))
        self._stored(node, TIER)
        self.num_tier_blocks += len(node.slots)
        if self.window_tier is None:
            self.copies.extend(KVCopy(True, b, s) for b, s in zip(node.blocks, node.slots))
        else:  # the pages of the window before the node's end (where a later match stops) go too, while a
            # window slot is free or can be taken from an entry worth less (else the tier copy is a tombstone)
            window, wt = self.pool.window, self.window_tier
            end = sum(len(n.tokens) for n in self._path(node))
            first = window.first_needed(end) - (end - len(node.tokens)) // self.block_size
            save = [i >= first and window.has_page(b) for i, b in enumerate(node.blocks)]
            self._make_window_room(sum(save), node)
            node.window_slots = [wt.allocate(1)[0] if keep and wt.num_free else -1 for keep in save]
            page_of = window.page_of
            self.copies.extend(KVCopy(True, b, s, page_of[b] if w >= 0 else -1, w)
                               for b, s, w in zip(node.blocks, node.slots, node.window_slots))
        self._record(node)
        self._refresh(node)

    def save_windows(self, node: RadixNode) -> None:
        """Hybrid KV: blocks on `node`'s path whose tier copy has no window but whose pool block
        has a page now (a tombstone healed where a later prompt branches, a window kept at an
        end) save it in a window slot (while one is free or can be taken from an entry worth
        less): a tier written through saved each node once, with only its end's window, and a
        persisted tier is all a restart has. The block is copied again with it (same tokens)."""
        if self.window_tier is None:
            return
        window, wt = self.pool.window, self.window_tier
        for n in self._path(node):
            if not n.slots or not n.blocks:
                continue
            windows = self._window_slots(n)
            missing = [i for i, (b, w) in enumerate(zip(n.blocks, windows)) if w < 0 and window.has_page(b)]
            if not missing:
                continue
            self._make_window_room(len(missing), n)
            windows = list(self._window_slots(n))  # (room never takes n's own)
            for i in missing[:wt.num_free]:
                b, windows[i] = n.blocks[i], wt.allocate(1)[0]
                self.copies.append(KVCopy(True, b, n.slots[i], window.page_of[b], windows[i]))
            n.window_slots = windows
            self._record(n)
            self._refresh(n)

    def _record(self, node: RadixNode) -> None:
        """Report what the node's tier slots hold (persistence): its entries, set anew."""
        if not self.record_entries:
            return
        parents = [node.parent.digests[-1]] + node.digests[:-1]
        windows = self._window_slots(node)
        bs = self.block_size
        for i, slot in enumerate(node.slots):
            entry = TierEntry(slot, node.salt, parents[i], node.digests[i], tuple(node.tokens[i * bs:(i + 1) * bs]),
                              windows[i])
            self.tier_events.append(("set", entry))

    def _make_window_room(self, n: int, node: RadixNode) -> None:
        """Hybrid KV: free window slots until n are free (or none is left to take), taking the
        saved windows of tier entries worth less than `node` (eviction order). Those entries
        keep their full layers, as tombstones for the window layers. Without this, a tier
        written through (persistence) would fill its window slots with old windows and save
        every later block as a tombstone."""
        wt, holders = self.window_tier, self._window_holders
        i = 0  # holders in eviction order, past `node` itself (a victim leaves the set)
        while wt.num_free < n and i < len(holders) and holders[i].sort_key <= node.sort_key:
            victim = holders[i]
            if victim is node:
                i += 1
                continue
            wt.free([w for w in victim.window_slots if w >= 0])
            victim.window_slots = []
            self._record(victim)
            self._refresh(victim)

    def _make_tier_room(self, n: int, worth: tuple[int, int, int]) -> bool:
        """Free tier slots until n are free, taking tier entries that are worth less than
        `worth` (eviction order); False (nothing more taken) if that is not possible."""
        if self.tier is None or n > self.tier.num_slots:
            return False
        while self.tier.num_free < n:
            if not self._tier_evictable or self._tier_evictable[0].sort_key > worth:
                return False
            victim = self._tier_evictable[0]
            if victim.in_pool:
                self._free_slots(victim)  # a clean copy: nothing is lost
            else:
                self._drop(victim, "tier_dropped")
        return True

    def _free_slots(self, node: RadixNode) -> None:
        self.tier.free(node.slots)
        if node.window_slots:
            self.window_tier.free([w for w in node.window_slots if w >= 0])
            node.window_slots = []
        self._removed(node, TIER)
        if self.record_entries:
            self.tier_events.extend(("free", s) for s in node.slots)
        self.num_tier_blocks -= len(node.slots)
        node.slots = []
        self._refresh(node)

    def _drop(self, node: RadixNode, reason: str) -> int:
        """Remove an unlocked node and its whole subtree from both tiers; returns the pool
        blocks freed."""
        freed = 0
        for child in list(node.children.values()):
            freed += self._drop(child, reason)
        if node.slots:
            if not node.blocks:
                self.evictions[reason] += len(node.slots)
            self._free_slots(node)
        if node.blocks:
            n = len(node.blocks)
            freed += self.pool.free(reversed(node.blocks))
            self._removed(node, POOL)
            self.num_cached_blocks -= n
            self.evicted_blocks += n
            self.evictions[reason] += n
            node.blocks = []
        parent = node.parent
        del parent.children[tuple(node.tokens[:self.block_size])]
        node.alive = False
        self.num_nodes -= 1
        self._refresh(node)
        self._refresh(parent)
        return freed

    def _stored(self, node: RadixNode, medium: str) -> None:
        if self.events is not None:
            parent = None if node.parent.is_root else node.parent.digests[-1]
            self.events.stored(node.digests, parent, node.tokens, medium, node.salt)

    def _removed(self, node: RadixNode, medium: str) -> None:
        if self.events is not None:
            self.events.removed(node.digests, medium)

    def _touch(self, node: RadixNode, now: int) -> None:
        node.last_access = now
        node.demoted = False
        self._refresh(node)

    def _pool_evictable(self, node: RadixNode) -> bool:
        return node.in_pool and node.lock_ref == 0 and not any(c.blocks for c in node.children.values())

    def _tier_candidate(self, node: RadixNode) -> bool:
        return bool(node.slots) and (node.in_pool or (not node.children and node.lock_ref == 0))

    def _refresh(self, node: RadixNode) -> None:
        """Recompute node's eviction key, its place in both eviction sets and its share of
        num_evictable_blocks. Called after anything about the node changes."""
        if node.is_root:
            return
        self._evictable.discard(node)
        self._tier_evictable.discard(node)
        self._window_holders.discard(node)
        ev = len(node.blocks) if node.alive and node.lock_ref == 0 else 0
        self.num_evictable_blocks += ev - node.ev_count
        node.ev_count = ev
        if not node.alive:
            return
        node.sort_key = (node.rank, node.last_access, node.node_id)
        if self._pool_evictable(node):
            self._evictable.add(node)
        if self._tier_candidate(node):
            self._tier_evictable.add(node)
            if _holds_window(node):
                self._window_holders.add(node)

    def _check_node(self, node: RadixNode, parent_lock: float) -> None:
        size = self._size(node)
        if len(node.tokens) != size * self.block_size or size == 0:
            raise AssertionError(f"{node}: {len(node.tokens)} tokens is not a positive number of blocks")
        if len(node.window_slots) not in (0, len(node.slots)):
            raise AssertionError(f"{node}: {len(node.window_slots)} window slots for {len(node.slots)} tier blocks")
        if len(node.blocks) not in (0, size) or len(node.slots) not in (0, size):
            raise AssertionError(f"{node}: {size} blocks but {len(node.blocks)} in pool, {len(node.slots)} in tier")
        if not node.blocks and not node.slots:
            raise AssertionError(f"{node} lives nowhere")
        if node.blocks and not node.parent.is_root and not node.parent.blocks:
            raise AssertionError(f"{node} is in the pool but its parent is not")
        if node.lock_ref > parent_lock:
            raise AssertionError(f"{node} locked more than its parent")
        if self._digests and len(node.digests) != size:
            raise AssertionError(f"{node}: {len(node.digests)} digests for {size} blocks")
        if not node.alive or node.parent.children.get(tuple(node.tokens[:self.block_size])) is not node:
            raise AssertionError(f"{node} is not its parent's child")


def _within(salt: str | None, namespace: str | None) -> bool:
    if namespace is None:
        return True
    return salt is not None and (salt == namespace or salt.startswith(namespace + "/"))


def _holds_window(node: RadixNode) -> bool:
    """Whether any of the node's tier blocks keeps its window in a window slot (mostly the last)."""
    return any(w >= 0 for w in reversed(node.window_slots))
