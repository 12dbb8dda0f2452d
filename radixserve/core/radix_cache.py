"""RadixCache: a radix tree of token prefixes over reference-counted KV blocks (plain Python).

The tree is block-granular: every node holds a run of whole blocks, its token ids and
the ids of the blocks that store their K/V. A child is keyed by the token ids of its
first block, so two children of one node never start with the same block.

    root ── [sys prompt: blocks 3 7 9] ─┬─ [question A: 12 13] ── [answer A: 20]
                                        └─ [question B: 15]

Ownership: the tree holds one BlockPool reference on every block it stores. A request
that reuses a prefix takes its own reference on each block and locks the node where the
prefix ends; locking a node locks its ancestors. Only unlocked leaves are evicted,
least recently used first, so a block a running request reads is never evicted.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from sortedcontainers import SortedSet

from radixserve.core.block_pool import BlockPool


class RadixNode:
    __slots__ = ("node_id", "parent", "children", "tokens", "blocks", "lock_ref", "last_access")

    def __init__(self, node_id: int, parent: "RadixNode | None", tokens: list[int], blocks: list[int]):
        self.node_id = node_id
        self.parent = parent
        self.children: dict[tuple[int, ...], RadixNode] = {}
        self.tokens = tokens
        self.blocks = blocks
        self.lock_ref = 0
        self.last_access = 0

    @property
    def is_root(self) -> bool:
        return self.parent is None

    def __repr__(self) -> str:
        return f"RadixNode(#{self.node_id}, blocks={self.blocks}, lock={self.lock_ref})"


@dataclass(frozen=True)
class MatchResult:
    """The longest cached block-aligned prefix: its blocks and the node where it ends."""

    blocks: list[int]
    node: RadixNode


class RadixCache:
    """Prefix tree over KV blocks; see the module docstring for the ownership rules."""

    def __init__(self, pool: BlockPool, block_size: int):
        self.pool = pool
        self.block_size = block_size
        self._ids = itertools.count()
        self._clock = itertools.count(1)
        self._roots: dict[str | None, RadixNode] = {}
        # Unlocked leaves, least recently used first: eviction never scans the tree.
        self._evictable = SortedSet(key=lambda n: (n.last_access, n.node_id))
        self.num_cached_blocks = 0  # blocks stored in the tree
        self.num_evictable_blocks = 0  # of those, blocks in unlocked nodes
        self.num_nodes = 0  # excluding roots
        self.evicted_blocks = 0  # cumulative

    # ---- public API -------------------------------------------------------------

    def match_prefix(self, tokens: list[int], salt: str | None = None) -> MatchResult:
        """Longest stored prefix of `tokens` made of whole blocks. Splits the last node
        when the match ends inside it, so the returned node ends exactly at the match.
        Marks the path as recently used. Takes no references and no locks."""
        bs = self.block_size
        node = self._root(salt)
        blocks: list[int] = []
        pos = 0
        now = next(self._clock)
        while pos + bs <= len(tokens):
            child = node.children.get(tuple(tokens[pos:pos + bs]))
            if child is None:
                break
            n = self._common_blocks(child, tokens, pos, len(tokens))
            if n < len(child.blocks):
                child = self._split(child, n)
            self._touch(child, now)
            blocks.extend(child.blocks)
            pos += n * bs
            node = child
        return MatchResult(blocks, node)

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
            if n < len(child.blocks):
                break
        return pos, node

    def insert(self, tokens: list[int], blocks: list[int], salt: str | None = None) -> RadixNode:
        """Store the prefix `tokens[:len(blocks) * block_size]` held in `blocks`.

        Where the tree already holds a block for the same tokens, the tree keeps its own
        and the caller's duplicate is not adopted (the caller frees it with the rest of
        its references). Returns the node where the inserted prefix ends.
        """
        bs = self.block_size
        if len(tokens) < len(blocks) * bs:
            raise ValueError(f"{len(blocks)} blocks need {len(blocks) * bs} tokens, got {len(tokens)}")
        node = self._root(salt)
        pos = 0
        now = next(self._clock)
        end = len(blocks) * bs
        while pos < end:
            key = tuple(tokens[pos:pos + bs])
            child = node.children.get(key)
            if child is None:
                return self._add_leaf(node, tokens[pos:end], blocks[pos // bs:], now)
            n = self._common_blocks(child, tokens, pos, end)
            if n < len(child.blocks):
                child = self._split(child, n)
            self._touch(child, now)
            pos += n * bs
            node = child
        return node

    def lock(self, node: RadixNode) -> None:
        """Protect `node` and its ancestors from eviction (counted: lock twice, unlock twice)."""
        while not node.is_root:
            if node.lock_ref == 0:
                self.num_evictable_blocks -= len(node.blocks)
                self._evictable.discard(node)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: RadixNode) -> None:
        while not node.is_root:
            if node.lock_ref <= 0:
                raise RuntimeError(f"unlock of unlocked node {node}")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.num_evictable_blocks += len(node.blocks)
                self._update_evictable(node)
            node = node.parent

    def evict(self, num_blocks: int) -> int:
        """Free at least `num_blocks` blocks if that many are evictable, taking unlocked
        leaves least recently used first and each leaf's deepest blocks first.
        Returns how many blocks were freed."""
        freed = 0
        while freed < num_blocks and self._evictable:
            leaf = self._evictable[0]
            take = min(num_blocks - freed, len(leaf.blocks))
            victims = leaf.blocks[len(leaf.blocks) - take:]
            if take == len(leaf.blocks):
                self._remove_leaf(leaf)
            else:
                keep = len(leaf.blocks) - take
                del leaf.blocks[keep:]
                del leaf.tokens[keep * self.block_size:]
            self.num_cached_blocks -= take
            self.num_evictable_blocks -= take
            self.evicted_blocks += take
            freed += self.pool.free(reversed(victims))
        return freed

    def flush(self) -> int:
        """Drop every unlocked entry; returns the number of blocks freed."""
        return self.evict(self.num_evictable_blocks)

    def nodes(self):
        """Every node except the roots, parents before children."""
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            if not node.is_root:
                yield node
            stack.extend(node.children.values())

    def held_blocks(self) -> list[int]:
        """Every block id the tree holds a reference on (for integrity checks)."""
        return [b for node in self.nodes() for b in node.blocks]

    def check_integrity(self) -> None:
        """Raise AssertionError if the counters or the evictable set disagree with the tree."""
        cached = evictable = nodes = 0
        want_evictable = set()
        stack = [(root, 0) for root in self._roots.values()]
        while stack:
            node, parent_lock = stack.pop()
            if not node.is_root:
                nodes += 1
                cached += len(node.blocks)
                if len(node.tokens) != len(node.blocks) * self.block_size or not node.blocks:
                    raise AssertionError(f"{node}: {len(node.tokens)} tokens for {len(node.blocks)} blocks")
                if node.lock_ref > parent_lock:
                    raise AssertionError(f"{node} locked more than its parent")
                if node.lock_ref == 0:
                    evictable += len(node.blocks)
                    if not node.children:
                        want_evictable.add(node.node_id)
            lock = node.lock_ref if not node.is_root else float("inf")
            stack.extend((c, lock) for c in node.children.values())
        got = {n.node_id for n in self._evictable}
        if (cached, evictable, nodes) != (self.num_cached_blocks, self.num_evictable_blocks, self.num_nodes):
            raise AssertionError(
                f"counters (cached, evictable, nodes) = {(self.num_cached_blocks, self.num_evictable_blocks, self.num_nodes)}"
                f", tree says {(cached, evictable, nodes)}"
            )
        if got != want_evictable:
            raise AssertionError(f"evictable set {sorted(got)} != unlocked leaves {sorted(want_evictable)}")

    # ---- helpers ----------------------------------------------------------------

    def _root(self, salt: str | None) -> RadixNode:
        root = self._roots.get(salt)
        if root is None:
            root = self._roots[salt] = RadixNode(next(self._ids), None, [], [])
        return root

    def _common_blocks(self, node: RadixNode, tokens: list[int], pos: int, end: int) -> int:
        """How many of node's blocks match tokens[pos:end] (at least 1: the key matched)."""
        bs = self.block_size
        n = 1
        limit = min(len(node.blocks), (end - pos) // bs)
        while n < limit and node.tokens[n * bs:(n + 1) * bs] == tokens[pos + n * bs:pos + (n + 1) * bs]:
            n += 1
        return n

    def _split(self, node: RadixNode, n_blocks: int) -> RadixNode:
        """Cut node after n_blocks; returns the new upper part (which keeps node's key)."""
        bs = self.block_size
        parent = node.parent
        upper = RadixNode(next(self._ids), parent, node.tokens[:n_blocks * bs], node.blocks[:n_blocks])
        upper.lock_ref = node.lock_ref
        upper.last_access = node.last_access
        parent.children[tuple(upper.tokens[:bs])] = upper
        node.tokens = node.tokens[n_blocks * bs:]
        node.blocks = node.blocks[n_blocks:]
        node.parent = upper
        upper.children[tuple(node.tokens[:bs])] = node
        self.num_nodes += 1
        return upper

    def _add_leaf(self, parent: RadixNode, tokens: list[int], blocks: list[int], now: int) -> RadixNode:
        leaf = RadixNode(next(self._ids), parent, list(tokens), list(blocks))
        leaf.last_access = now
        self.pool.share(blocks)
        if not parent.children:
            self._evictable.discard(parent)
        parent.children[tuple(tokens[:self.block_size])] = leaf
        self.num_nodes += 1
        self.num_cached_blocks += len(blocks)
        self.num_evictable_blocks += len(blocks)
        self._evictable.add(leaf)
        return leaf

    def _remove_leaf(self, leaf: RadixNode) -> None:
        self._evictable.discard(leaf)
        parent = leaf.parent
        del parent.children[tuple(leaf.tokens[:self.block_size])]
        self.num_nodes -= 1
        if not parent.is_root:
            self._update_evictable(parent)

    def _touch(self, node: RadixNode, now: int) -> None:
        in_set = node in self._evictable
        if in_set:
            self._evictable.discard(node)
        node.last_access = now
        if in_set:
            self._evictable.add(node)

    def _update_evictable(self, node: RadixNode) -> None:
        if node.lock_ref == 0 and not node.children and not node.is_root:
            self._evictable.add(node)
