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

The tree itself holds only the tree: tokens, children, locks, hints and the eviction
order. What a node's blocks hold is kept by components (core/cache_component.py), each
with its rule and its integrity check: FullBlocks (core/full_blocks.py) the pool blocks and
their references, TierSlots (core/tier_slots.py, NoTierSlots without a tier) the second
tier's copies, and the ones the KV manager registers (sliding-window pages, ...), told of
every split and every node leaving the pool.
"""

from __future__ import annotations

import itertools
from collections import Counter

from sortedcontainers import SortedSet

from radixserve.core.block_pool import BlockPool
from radixserve.core.full_blocks import FullBlocks
from radixserve.core.hashing import chain_hashes, root_hash
from radixserve.core.kv_events import KVEventLog, NoEventLog
from radixserve.core.radix_node import MatchResult, RadixNode
from radixserve.core.tier_slots import NoTierSlots, TierSlots
from radixserve.kv_tier.index import KVCopy, KVTier, TierEntry

__all__ = ["MatchResult", "RadixCache", "RadixNode"]


class RadixCache:
    """Prefix tree over KV blocks in one or two tiers; see the module docstring."""

    caching = True

    def __init__(
        self, pool: BlockPool, block_size: int, tier: KVTier | None = None,
        write_through: bool = False, record_entries: bool = False, events: KVEventLog | None = None,
        window_tier: KVTier | None = None,
    ):
        self.pool = pool
        self.block_size = block_size
        self.events = events  # every block stored and removed, medium by medium (KV events; None: off)
        self.event_log = events if events is not None else NoEventLog()  # where the components write them
        self._digests = tier is not None or events is not None  # nodes name their blocks by chained hash
        self.full = FullBlocks(pool, self.event_log)
        self.tier_slots = (TierSlots(self, tier, write_through, record_entries, window_tier) if tier is not None
                           else NoTierSlots())
        self.components: list = []  # the KV manager's cache components (core/cache_component.py)
        self._ids = itertools.count()
        self._clock = itertools.count(1)
        self._roots: dict[str | None, RadixNode] = {}
        # Pool leaves in eviction order: eviction never scans the tree.
        self._evictable = SortedSet(key=lambda n: n.sort_key)
        self.num_evictable_blocks = 0  # of the cached pool blocks, those in unlocked nodes
        self.num_nodes = 0  # excluding roots
        self.evicted_blocks = 0  # cumulative: blocks that left the pool
        self.evictions: Counter[str] = Counter()  # blocks by reason: demoted, dropped, tier_dropped, flushed

    # ---- what the components count ------------------------------------------------------

    @property
    def num_cached_blocks(self) -> int:
        """Pool blocks stored in the tree."""
        return self.full.num_cached

    @property
    def num_tier_blocks(self) -> int:
        """Tier slots held by the tree."""
        return self.tier_slots.num_blocks

    @property
    def restored_blocks(self) -> int:
        return self.tier_slots.restored_blocks

    @property
    def tier_hits(self) -> int:
        """Matches that restored at least one block."""
        return self.tier_slots.tier_hits

    @property
    def tier(self) -> KVTier | None:
        return self.tier_slots.tier

    @property
    def window_tier(self) -> KVTier | None:
        return self.tier_slots.window_tier

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
        return self.tier_slots.tier_windows(self._tier_tail(match))

    def restore_windows(self, match: MatchResult) -> list[bool]:
        """Hybrid KV: for each block of the match's tier-only tail, whether a restore gives it a
        window page: saved with its window and within the window before the match's end (the
        request reads none further back, and a page there would serve no end of its path)."""
        saved = self.tier_windows(match)
        first = self.pool.window.first_needed((len(match.blocks) + len(saved)) * self.block_size) - len(match.blocks)
        return [w and i >= first for i, w in enumerate(saved)]

    def _tier_tail(self, match: MatchResult) -> list[RadixNode]:
        """The nodes of the match's tier-only tail, top down."""
        path = []
        node = match.node
        while not node.is_root and not node.in_pool:
            path.append(node)
            node = node.parent
        return path[::-1]

    def restore(self, match: MatchResult) -> list[int]:
        """Bring the tier-only tail of a (locked) match into the pool, top down, evicting
        other entries as needed; returns the pool blocks of the whole match. The copies are
        queued in `copies`. Raises MemoryError (nothing restored) if the pool cannot hold it."""
        if not match.num_tier_blocks:
            return list(match.blocks)
        path = self._tier_tail(match)
        need = sum(self._size(n) for n in path)
        given = self.restore_windows(match) if self.pool.window is not None else []
        pages = sum(given) if self.pool.window is not None else need
        if need > self.pool.num_free_blocks:
            self.evict(need - self.pool.num_free_blocks)
        if need > self.pool.num_free_blocks or (self.pool.window is not None and pages > self.pool.window.num_free):
            raise MemoryError(f"restoring {need} blocks ({pages} window pages): only {self.pool.num_free} free")
        blocks = list(match.blocks)
        for node in path:
            n = self._size(node)
            mine, given = (given[:n], given[n:]) if self.pool.window is not None else (None, given)
            # hybrid KV: a window page only where restore_windows gives one: the others are tombstones
            blocks.extend(self.full.allocate(node, n, mine))
            self.tier_slots.restored(node, mine)
            self._refresh(node)
            self._refresh(node.parent)
        self.tier_slots.restored_blocks += need
        self.tier_slots.tier_hits += 1
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
        n = self.node_at(node, num_blocks)
        if n is not None:
            n.anchor = True
            n.end_access = max(n.end_access, node.end_access)
        return n

    def node_at(self, node: RadixNode, num_blocks: int) -> RadixNode | None:
        """The node of `node`'s path that ends after its first `num_blocks` blocks, splitting
        the node there if it ends further on (None for 0 blocks or past the path's end)."""
        path = self._path(node)
        end = sum(self._size(n) for n in path)
        if not 0 < num_blocks <= end:
            return None
        for n in path:  # deepest first
            start = end - self._size(n)
            if start < num_blocks:
                return self._split(n, num_blocks - start) if num_blocks < end else n
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
        return self.tier_slots.take_copies()

    def take_tier_events(self) -> list[tuple[str, object]]:
        return self.tier_slots.take_tier_events()

    def save_windows(self, node: RadixNode) -> None:
        """Hybrid KV: the path's blocks whose pool block has a page but whose tier copy has
        none save it (TierSlots.save_windows)."""
        self.tier_slots.save_windows(node)

    # ---- loading a persisted tier ---------------------------------------------------

    def load_tier_entries(self, entries: list[TierEntry]) -> list[TierEntry]:
        """Rebuild tier-only nodes from persisted block entries (TierSlots.load)."""
        return self.tier_slots.load(entries)

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
        """Raise AssertionError if the counters, the eviction set or the block locations
        disagree with the tree; then each component's own check."""
        evictable, want_evictable, nodes = 0, set(), []
        stack = [(root, 0) for root in self._roots.values()]
        while stack:
            node, parent_lock = stack.pop()
            if not node.is_root:
                nodes.append(node)
                self._check_node(node, parent_lock)
                if node.lock_ref == 0:
                    evictable += len(node.blocks)
                if self._pool_evictable(node):
                    want_evictable.add(node.node_id)
            lock = node.lock_ref if not node.is_root else float("inf")
            stack.extend((c, lock) for c in node.children.values())
        cached, tier_blocks = sum(len(n.blocks) for n in nodes), sum(len(n.slots) for n in nodes)
        counters = (self.num_cached_blocks, self.num_evictable_blocks, self.num_nodes, self.num_tier_blocks)
        if counters != (cached, evictable, len(nodes), tier_blocks):
            raise AssertionError(f"counters (cached, evictable, nodes, tier) = {counters}, "
                                 f"tree says {(cached, evictable, len(nodes), tier_blocks)}")
        got = {n.node_id for n in self._evictable}
        if got != want_evictable:
            raise AssertionError(f"evictable set {sorted(got)} != unlocked pool leaves {sorted(want_evictable)}")
        self.full.check_integrity(nodes)
        self.tier_slots.check_integrity(nodes)

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
        upper = RadixNode(next(self._ids), parent, node.tokens[:n_blocks * bs], [])
        self.full.split(upper, node, n_blocks)
        self.tier_slots.split(upper, node, n_blocks)
        for c in self.components:
            c.split(upper, node, n_blocks)
        upper.digests = node.digests[:n_blocks]
        for attr in ("salt", "lock_ref", "last_access", "protect", "demoted"):
            setattr(upper, attr, getattr(node, attr))
        parent.children[tuple(upper.tokens[:bs])] = upper
        node.tokens = node.tokens[n_blocks * bs:]
        node.digests = node.digests[n_blocks:]
        node.parent = upper
        upper.children[tuple(node.tokens[:bs])] = node
        self.num_nodes += 1
        self._refresh(node)
        self._refresh(upper)
        return upper

    def _new_node(self, parent: RadixNode, tokens: list[int], now: int) -> RadixNode:
        node = RadixNode(next(self._ids), parent, list(tokens), [])
        node.last_access = now
        node.salt = parent.salt
        if self._digests:
            node.digests = chain_hashes(parent.digests[-1], node.tokens, self.block_size)
        parent.children[tuple(tokens[:self.block_size])] = node
        self.num_nodes += 1
        return node

    def _add_leaf(self, parent: RadixNode, tokens: list[int], blocks: list[int], now: int) -> RadixNode:
        leaf = self._new_node(parent, tokens, now)
        self.full.store(leaf, blocks)
        self._refresh(leaf)
        self._refresh(parent)
        self.tier_slots.written_through(leaf)
        return leaf

    def _adopt(self, node: RadixNode, blocks: list[int]) -> None:
        """A tier-only node gets pool blocks computed by a request (the same tokens)."""
        self.full.store(node, blocks)
        self._refresh(node)
        self._refresh(node.parent)

    def _leave_pool(self, leaf: RadixNode) -> int:
        """Take an unlocked pool leaf out of the pool: keep it in the tier if it has a copy
        there or the tier makes room for it, else drop it with its subtree."""
        n = len(leaf.blocks)
        if not leaf.slots and not self.tier_slots.make_room(n, leaf.sort_key):
            return self._drop(leaf, "dropped")
        if not leaf.slots:
            self.tier_slots.save(leaf)
        freed = self.full.release(leaf)
        self.evicted_blocks += n
        self.evictions["demoted"] += n
        for c in self.components:
            c.evicted(leaf)
        self._refresh(leaf)
        self._refresh(leaf.parent)
        return freed

    def _drop(self, node: RadixNode, reason: str) -> int:
        """Remove an unlocked node and its whole subtree from both tiers; returns the pool
        blocks freed."""
        freed = 0
        for child in list(node.children.values()):
            freed += self._drop(child, reason)
        lost = self.tier_slots.drop(node)
        if lost:
            self.evictions[reason] += lost
        if node.blocks:
            n = len(node.blocks)
            freed += self.full.release(node)
            self.evicted_blocks += n
            self.evictions[reason] += n
            for c in self.components:
                c.evicted(node)
        for c in self.components:
            c.dropped(node)
        parent = node.parent
        del parent.children[tuple(node.tokens[:self.block_size])]
        node.alive = False
        self.num_nodes -= 1
        self._refresh(node)
        self._refresh(parent)
        return freed

    def _touch(self, node: RadixNode, now: int) -> None:
        node.last_access = now
        node.demoted = False
        self._refresh(node)

    def _pool_evictable(self, node: RadixNode) -> bool:
        return node.in_pool and node.lock_ref == 0 and not any(c.blocks for c in node.children.values())

    def _refresh(self, node: RadixNode) -> None:
        """Recompute node's eviction key, its place in the eviction sets (the tree's and the
        tier's) and its share of num_evictable_blocks. Called after anything about the node
        changes."""
        if node.is_root:
            return
        self._evictable.discard(node)
        self.tier_slots.discard(node)
        ev = len(node.blocks) if node.alive and node.lock_ref == 0 else 0
        self.num_evictable_blocks += ev - node.ev_count
        node.ev_count = ev
        if not node.alive:
            return
        node.sort_key = (node.rank, node.last_access, node.node_id)
        if self._pool_evictable(node):
            self._evictable.add(node)
        self.tier_slots.add(node)

    def _check_node(self, node: RadixNode, parent_lock: float) -> None:
        size = self._size(node)
        if len(node.tokens) != size * self.block_size or size == 0:
            raise AssertionError(f"{node}: {len(node.tokens)} tokens is not a positive number of blocks")
        self.full.check_node(node, size)
        self.tier_slots.check_node(node, size)
        if not node.blocks and not node.slots:
            raise AssertionError(f"{node} lives nowhere")
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
