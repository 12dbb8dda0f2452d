"""TierSlots: the tree's component for second-tier copies of its blocks (plain Python).

A node's blocks may have a copy in the second tier (`node.slots`, kv_tier/index.py's slot
ids), and on a hybrid model each such block may keep its window page in a window slot
(`node.window_slots`, -1: none, a tombstone for the window layers). Its rules: a pool leaf
leaving the pool moves to the tier when the tier has room (taking the tier entries worth
less, in the tree's eviction order), else it is dropped with its subtree; a write-through
tier (persistence) copies every new block at once; a window slot goes to the entry worth
most. Every copy decided is a KVCopy the engine runs before the step (take_copies), every
slot set or freed a tier event for the on-disk index (record_entries), every node stored
or removed a KV event in the TIER medium.

Integrity: the slots the nodes hold are exactly the tier's held slots (each once), likewise
the window slots; a node holds all of its blocks' slots or none; the tier's eviction set
and its window holders are exactly the nodes they should be.

NoTierSlots: no second tier, the same interface: nothing is saved, a leaving node is dropped.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sortedcontainers import SortedSet

from radixserve.core.hashing import chain_hashes, root_hash
from radixserve.core.kv_events import TIER
from radixserve.kv_tier.index import KVCopy, KVTier, TierEntry

if TYPE_CHECKING:
    from radixserve.core.radix_node import RadixNode


class TierSlots:
    name = "tier"

    def __init__(self, cache: Any, tier: KVTier, write_through: bool = False, record_entries: bool = False,
                 window_tier: KVTier | None = None):
        self.cache = cache
        self.tier = tier
        # hybrid KV: tier slots for window pages; a block saved while it has a page keeps it in one
        # (if one is free), and a restored block has a page only where its window came back
        self.window_tier = window_tier if cache.pool.window is not None else None
        self.write_through = write_through  # every new block gets a tier copy
        self.record_entries = record_entries  # report slot contents (persistence)
        self.num_blocks = 0  # tier slots held by the tree
        self.restored_blocks = 0
        self.tier_hits = 0  # matches that restored at least one block
        self.copies: list[KVCopy] = []  # tier copies decided since the last take_copies()
        self.tier_events: list[tuple[str, object]] = []  # ("set", TierEntry) / ("free", slot)
        # tier candidates in eviction order (taking room never scans the tree), and those of
        # them that hold window slots (what a save may take)
        self.evictable = SortedSet(key=lambda n: n.sort_key)
        self.window_holders = SortedSet(key=lambda n: n.sort_key)

    # ---- the tree's eviction sets ------------------------------------------------------

    def discard(self, node: "RadixNode") -> None:
        """Before the node's eviction key changes."""
        self.evictable.discard(node)
        self.window_holders.discard(node)

    def add(self, node: "RadixNode") -> None:
        """After it changed (the node is alive)."""
        if self.candidate(node):
            self.evictable.add(node)
            if _holds_window(node):
                self.window_holders.add(node)

    @staticmethod
    def candidate(node: "RadixNode") -> bool:
        return bool(node.slots) and (node.in_pool or (not node.children and node.lock_ref == 0))

    def split(self, upper: "RadixNode", lower: "RadixNode", n_blocks: int) -> None:
        upper.slots, lower.slots = lower.slots[:n_blocks], lower.slots[n_blocks:]
        upper.window_slots, lower.window_slots = lower.window_slots[:n_blocks], lower.window_slots[n_blocks:]

    # ---- reading ----------------------------------------------------------------------

    def window_slots(self, node: "RadixNode") -> list[int]:
        return node.window_slots or [-1] * len(node.slots)

    def tier_windows(self, path: list["RadixNode"]) -> list[bool]:
        """For each block of these tier-only nodes (top down), whether its window page is in the tier."""
        return [w >= 0 for n in path for w in self.window_slots(n)]

    # ---- moving blocks ------------------------------------------------------------------

    def restored(self, node: "RadixNode", given: list[bool]) -> None:
        """`node` is back in the pool (its new blocks allocated): queue the copies in (hybrid
        KV: a window page where `given` says; the others are tombstones)."""
        if self.cache.pool.window is None:
            self.copies.extend(KVCopy(False, b, s) for b, s in zip(node.blocks, node.slots))
            return
        page_of = self.cache.pool.window.page_of
        self.copies.extend(KVCopy(False, b, s, page_of[b], w) if g else KVCopy(False, b, s)
                           for b, s, w, g in zip(node.blocks, node.slots, self.window_slots(node), given))

    def written_through(self, leaf: "RadixNode") -> None:
        """A new pool leaf: a write-through tier copies it now (when it can make room)."""
        if self.write_through and self.make_room(len(leaf.blocks), leaf.sort_key):
            self.save(leaf)

    def save(self, node: "RadixNode") -> None:
        node.slots = self.tier.allocate(len(node.blocks))
        self.cache.event_log.node_stored(node, TIER)
        self.num_blocks += len(node.slots)
        if self.window_tier is None:
            self.copies.extend(KVCopy(True, b, s) for b, s in zip(node.blocks, node.slots))
        else:  # the pages of the window before the node's end (where a later match stops) go too, while a
            # window slot is free or can be taken from an entry worth less (else the tier copy is a tombstone)
            window, wt, bs = self.cache.pool.window, self.window_tier, self.cache.block_size
            end = sum(len(n.tokens) for n in self.cache._path(node))
            first = window.first_needed(end) - (end - len(node.tokens)) // bs
            save = [i >= first and window.has_page(b) for i, b in enumerate(node.blocks)]
            self._make_window_room(sum(save), node)
            node.window_slots = [wt.allocate(1)[0] if keep and wt.num_free else -1 for keep in save]
            page_of = window.page_of
            self.copies.extend(KVCopy(True, b, s, page_of[b] if w >= 0 else -1, w)
                               for b, s, w in zip(node.blocks, node.slots, node.window_slots))
        self.record(node)
        self.cache._refresh(node)

    def save_windows(self, node: "RadixNode") -> None:
        """Hybrid KV: blocks on `node`'s path whose tier copy has no window but whose pool block
        has a page now (a tombstone healed where a later prompt branches, a window kept at an
        end) save it in a window slot (while one is free or can be taken from an entry worth
        less): a tier written through saved each node once, with only its end's window, and a
        persisted tier is all a restart has. The block is copied again with it (same tokens)."""
        if self.window_tier is None:
            return
        window, wt = self.cache.pool.window, self.window_tier
        for n in self.cache._path(node):
            if not n.slots or not n.blocks:
                continue
            windows = self.window_slots(n)
            missing = [i for i, (b, w) in enumerate(zip(n.blocks, windows)) if w < 0 and window.has_page(b)]
            if not missing:
                continue
            self._make_window_room(len(missing), n)
            windows = list(self.window_slots(n))  # (room never takes n's own)
            for i in missing[:wt.num_free]:
                b, windows[i] = n.blocks[i], wt.allocate(1)[0]
                self.copies.append(KVCopy(True, b, n.slots[i], window.page_of[b], windows[i]))
            n.window_slots = windows
            self.record(n)
            self.cache._refresh(n)

    def record(self, node: "RadixNode") -> None:
        """Report what the node's tier slots hold (persistence): its entries, set anew."""
        if not self.record_entries:
            return
        parents = [node.parent.digests[-1]] + node.digests[:-1]
        windows = self.window_slots(node)
        bs = self.cache.block_size
        for i, slot in enumerate(node.slots):
            entry = TierEntry(slot, node.salt, parents[i], node.digests[i], tuple(node.tokens[i * bs:(i + 1) * bs]),
                              windows[i])
            self.tier_events.append(("set", entry))

    def _make_window_room(self, n: int, node: "RadixNode") -> None:
        """Hybrid KV: free window slots until n are free (or none is left to take), taking the
        saved windows of tier entries worth less than `node` (eviction order). Those entries
        keep their full layers, as tombstones for the window layers. Without this, a tier
        written through (persistence) would fill its window slots with old windows and save
        every later block as a tombstone."""
        wt, holders = self.window_tier, self.window_holders
        i = 0  # holders in eviction order, past `node` itself (a victim leaves the set)
        while wt.num_free < n and i < len(holders) and holders[i].sort_key <= node.sort_key:
            victim = holders[i]
            if victim is node:
                i += 1
                continue
            wt.free([w for w in victim.window_slots if w >= 0])
            victim.window_slots = []
            self.record(victim)
            self.cache._refresh(victim)

    def make_room(self, n: int, worth: tuple[int, int, int]) -> bool:
        """Free tier slots until n are free, taking tier entries that are worth less than
        `worth` (eviction order); False (nothing more taken) if that is not possible."""
        if n > self.tier.num_slots:
            return False
        while self.tier.num_free < n:
            if not self.evictable or self.evictable[0].sort_key > worth:
                return False
            victim = self.evictable[0]
            if victim.in_pool:
                self.free_slots(victim)  # a clean copy: nothing is lost
            else:
                self.cache._drop(victim, "tier_dropped")
        return True

    def free_slots(self, node: "RadixNode") -> None:
        self.tier.free(node.slots)
        if node.window_slots:
            self.window_tier.free([w for w in node.window_slots if w >= 0])
            node.window_slots = []
        self.cache.event_log.node_removed(node, TIER)
        if self.record_entries:
            self.tier_events.extend(("free", s) for s in node.slots)
        self.num_blocks -= len(node.slots)
        node.slots = []
        self.cache._refresh(node)

    def drop(self, node: "RadixNode") -> int:
        """A node leaves the tree: its slots go; returns how many blocks that loses (those
        held in the tier only)."""
        if not node.slots:
            return 0
        lost = 0 if node.blocks else len(node.slots)
        self.free_slots(node)
        return lost

    def take_copies(self) -> list[KVCopy]:
        copies, self.copies = self.copies, []
        return copies

    def take_tier_events(self) -> list[tuple[str, object]]:
        events, self.tier_events = self.tier_events, []
        return events

    # ---- loading a persisted tier ---------------------------------------------------

    def load(self, entries: list[TierEntry]) -> list[TierEntry]:
        """Rebuild tier-only nodes from persisted block entries (before any request runs).
        An entry is adopted only if its digest chain from its namespace's root checks out
        and its slot is unused; returns the entries adopted. Hybrid KV: an adopted entry keeps
        its window slot where that is in range and unused (else it comes back as a tombstone
        for the window layers: its entry as returned says -1)."""
        cache, bs = self.cache, self.cache.block_size
        windows: set[int] = set()

        def window_of(e: TierEntry) -> TierEntry:
            w = e.window_slot
            if w < 0 or (self.window_tier is not None and 0 <= w < self.window_tier.num_slots and w not in windows):
                windows.add(w)
                return e
            return TierEntry(e.slot, e.salt, e.parent, e.digest, e.tokens)

        by_parent: dict[tuple[str | None, int], list[TierEntry]] = {}
        for e in entries:
            if 0 <= e.slot < self.tier.num_slots and len(e.tokens) == bs:
                by_parent.setdefault((e.salt, e.parent), []).append(e)
        adopted: list[TierEntry] = []
        used: set[int] = set()
        for salt in {e.salt for e in entries}:
            root = cache._root(salt)
            stack = [(root, root_hash(salt))]
            while stack:
                node, digest = stack.pop()
                for e in by_parent.get((salt, digest), ()):
                    key = tuple(e.tokens)
                    if e.slot in used or key in node.children:
                        continue
                    if chain_hashes(digest, list(e.tokens), bs) != [e.digest]:
                        continue
                    used.add(e.slot)
                    e = window_of(e)
                    adopted.append(e)
                    stack.append((self._add_leaf(node, e), e.digest))
        self.tier.take(used)
        if self.window_tier is not None:
            self.window_tier.take(windows - {-1})
        return adopted

    def _add_leaf(self, parent: "RadixNode", entry: TierEntry) -> "RadixNode":
        cache = self.cache
        node = cache._new_node(parent, list(entry.tokens), next(cache._clock))
        node.slots = [entry.slot]
        if self.window_tier is not None:
            node.window_slots = [entry.window_slot]
        cache.event_log.node_stored(node, TIER)
        self.num_blocks += 1
        cache._refresh(node)
        cache._refresh(parent)
        return node

    # ---- integrity --------------------------------------------------------------------

    def check_node(self, node: "RadixNode", size: int) -> None:
        if len(node.window_slots) not in (0, len(node.slots)):
            raise AssertionError(f"{node}: {len(node.window_slots)} window slots for {len(node.slots)} tier blocks")
        if len(node.slots) not in (0, size):
            raise AssertionError(f"{node}: {size} blocks but {len(node.slots)} in tier")

    def check_integrity(self, nodes: list["RadixNode"]) -> None:
        held = [s for n in nodes for s in n.slots]
        if len(held) != self.num_blocks:
            raise AssertionError(f"tier: {self.num_blocks} slots counted, the tree's nodes hold {len(held)}")
        want = {n.node_id for n in nodes if self.candidate(n)}
        got = {n.node_id for n in self.evictable}
        if got != want:
            raise AssertionError(f"tier eviction set {sorted(got)} != candidates {sorted(want)}")
        holders = {n.node_id for n in self.window_holders}
        if holders != {n.node_id for n in self.evictable if _holds_window(n)}:
            raise AssertionError(f"window holders {sorted(holders)} are not the tier candidates holding windows")
        self.tier.check_integrity(held)
        if self.window_tier is not None:
            self.window_tier.check_integrity([w for n in nodes for w in n.window_slots if w >= 0])


class NoTierSlots:
    """No second tier: nothing is saved, and a node that leaves the pool is dropped."""

    name = "tier"
    tier = window_tier = None
    write_through = record_entries = False
    num_blocks = restored_blocks = tier_hits = 0

    def discard(self, node: "RadixNode") -> None:
        pass

    def add(self, node: "RadixNode") -> None:
        pass

    def split(self, upper: "RadixNode", lower: "RadixNode", n_blocks: int) -> None:
        pass

    def tier_windows(self, path: list["RadixNode"]) -> list[bool]:
        return []

    def restored(self, node: "RadixNode", given: list[bool]) -> None:
        raise RuntimeError("a restore without a second tier")

    def written_through(self, leaf: "RadixNode") -> None:
        pass

    def save_windows(self, node: "RadixNode") -> None:
        pass

    def make_room(self, n: int, worth: tuple[int, int, int]) -> bool:
        return False

    def drop(self, node: "RadixNode") -> int:
        return 0

    def take_copies(self) -> list[KVCopy]:
        return []

    def take_tier_events(self) -> list[tuple[str, object]]:
        return []

    def load(self, entries: list[TierEntry]) -> list[TierEntry]:
        return []

    def check_node(self, node: "RadixNode", size: int) -> None:
        pass

    def check_integrity(self, nodes: list["RadixNode"]) -> None:
        if any(n.slots for n in nodes):
            raise AssertionError("tier slots held without a tier")


def _holds_window(node: "RadixNode") -> bool:
    """Whether any of the node's tier blocks keeps its window in a window slot (mostly the last)."""
    return any(w >= 0 for w in reversed(node.window_slots))
