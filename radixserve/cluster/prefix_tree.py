"""ApproxPrefixTree: what one replica's prefix cache most likely holds, guessed from what was routed there.

The router never sees a replica's real radix cache; it keeps this tree of the routing keys
(characters or token ids) it sent to the replica, with the time each path was last used,
and trims it by age and size the way the replica's own cache evicts: least recently used
leaves first, from their tails. Plain Python, no Ray.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable, Sequence

Key = Sequence[Hashable]  # a str, or a tuple of token ids; keys of both kinds may share a tree


class _Node:
    __slots__ = ("edge", "children", "parent", "last_used")

    def __init__(self, edge: Key, parent: "_Node | None", last_used: float):
        self.edge = edge  # the key elements from the parent to this node
        self.children: dict[Hashable, _Node] = {}  # by the first element of the child's edge
        self.parent = parent
        self.last_used = last_used  # invariant: a parent's last_used >= each child's


def common_prefix_length(a: Key, b: Key) -> int:
    """By bisection over slice comparisons (each runs in C), not element by element."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # invariant: a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class ApproxPrefixTree:
    """A radix tree of keys with LRU timestamps, bounded by `max_size` elements (the summed
    edge lengths) and, when `max_age_s` is set, by age.

    insert(key, now) records key as used at `now`; match_length(key) is the length of the
    longest prefix of key in the tree; evict(now) applies both bounds (insert applies the
    size bound itself)."""

    def __init__(self, max_size: int = 1_000_000, max_age_s: float | None = None):
        if max_size < 1:
            raise ValueError(f"max_size must be >= 1, got {max_size}")
        if max_age_s is not None and max_age_s <= 0:
            raise ValueError(f"max_age_s must be > 0, got {max_age_s}")
        self.max_size = max_size
        self.max_age_s = max_age_s
        self.root = _Node((), None, float("-inf"))
        self.size = 0

    def match_length(self, key: Key) -> int:
        """Elements of key's longest prefix held in the tree."""
        node, matched = self.root, 0
        while matched < len(key):
            child = node.children.get(key[matched])
            if child is None:
                break
            common = common_prefix_length(child.edge, key[matched:matched + len(child.edge)])
            matched += common
            if common < len(child.edge):
                break
            node = child
        return matched

    def insert(self, key: Key, now: float) -> None:
        """Record key (every prefix of it) as used at `now`, then trim to max_size."""
        node, pos = self.root, 0
        node.last_used = max(node.last_used, now)
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                leaf = _Node(key[pos:], node, now)
                node.children[key[pos]] = leaf
                self.size += len(leaf.edge)
                break
            common = common_prefix_length(child.edge, key[pos:pos + len(child.edge)])
            if common < len(child.edge):
                child = self._split(child, common)
            child.last_used = max(child.last_used, now)
            node, pos = child, pos + common
        if self.size > self.max_size:
            self._trim_to(self.max_size)

    def evict(self, now: float) -> int:
        """Drop paths unused for max_age_s, then trim to max_size; returns elements dropped."""
        before = self.size
        if self.max_age_s is not None:
            self._drop_older_than(now - self.max_age_s)
        if self.size > self.max_size:
            self._trim_to(self.max_size)
        return before - self.size

    def clear(self) -> None:
        self.root.children.clear()
        self.size = 0

    def _split(self, child: _Node, at: int) -> _Node:
        """Cut child's edge after `at` elements; returns the new middle node."""
        parent = child.parent
        assert parent is not None
        middle = _Node(child.edge[:at], parent, child.last_used)
        parent.children[middle.edge[0]] = middle
        child.edge = child.edge[at:]
        child.parent = middle
        middle.children[child.edge[0]] = child
        return middle

    def _drop_older_than(self, cutoff: float) -> None:
        stack = [self.root]
        while stack:
            node = stack.pop()
            for first, child in list(node.children.items()):
                if child.last_used < cutoff:  # so is its whole subtree (the invariant)
                    del node.children[first]
                    self.size -= _subtree_size(child)
                else:
                    stack.append(child)

    def _trim_to(self, target: int) -> None:
        """Remove elements from the tails of least recently used leaves until size <= target."""
        order = itertools.count()
        heap = [(leaf.last_used, next(order), leaf) for leaf in self._leaves()]
        heapq.heapify(heap)
        while self.size > target and heap:
            _, _, leaf = heapq.heappop(heap)
            excess = self.size - target
            if excess < len(leaf.edge):
                leaf.edge = leaf.edge[:len(leaf.edge) - excess]
                self.size -= excess
                return
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.edge[0]]
            self.size -= len(leaf.edge)
            if parent is not self.root and not parent.children:
                heapq.heappush(heap, (parent.last_used, next(order), parent))

    def _leaves(self) -> list[_Node]:
        leaves, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            else:
                leaves.append(node)
        return leaves

    def check(self) -> None:
        """Assert the tree's invariants (tests)."""
        total, stack = 0, [self.root]
        while stack:
            node = stack.pop()
            for first, child in node.children.items():
                assert child.edge and child.edge[0] == first and child.parent is node
                assert child.last_used <= node.last_used or node is self.root
                total += len(child.edge)
                stack.append(child)
        assert total == self.size, (total, self.size)


def _subtree_size(node: _Node) -> int:
    total, stack = 0, [node]
    while stack:
        n = stack.pop()
        total += len(n.edge)
        stack.extend(n.children.values())
    return total
