"""Drafts from the radix tree: where a request's last tokens occur among the sequences the
prefix cache holds (earlier prompts and replies), and what followed them there.

Only the request's own namespace is read: the tree under the root of its exact cache salt
(with API keys the salt leads with the key's digest, so another key's prompts and replies
are never looked at). The tree is read through its nodes only (`tokens`, `children`,
`parent`, `alive`, `last_access`), never changed; the one other thing taken from the cache
is the root of a salt (`_root_of`), kept here so a rename of the cache's internals is one
line to follow.

TreeIndex keeps, per namespace, the places (node, offset) where each KEY-token sequence
ends, refreshed from the tree when its counters move: nodes it has not seen (or whose
tokens changed: a split shortens a node from the front) are indexed again, and entries of
dead or changed nodes are skipped on reading and pruned when they pile up.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

KEY = 3  # tokens of the key a place is indexed by
MAX_PLACES = 48  # most recent places read per lookup
MAX_PATHS = 8  # continuations one place may branch into (most recently used children first)
MAX_MATCH = 32  # tokens compared backwards to weigh a place


def evidence(match: int) -> float:
    """A place's weight from the tokens it matched backwards: their square, so a place that
    agrees on a longer context (more specific evidence, as a higher-order n-gram) outvotes
    several that agree only on the key (replayed against six recorded traces: 0-5% more tokens
    per decode step than the plain count, none fewer)."""
    return float(match * match)


def _root_of(cache: Any, salt: str | None) -> Any:
    """The root node of the salt's tree, or None (the cache's only internal read here)."""
    return cache._roots.get(salt)


class _Namespace:
    def __init__(self) -> None:
        self.places: dict[tuple[int, ...], list[tuple[Any, int, int]]] = defaultdict(list)  # key -> (node, end, len)
        self.seen: dict[int, tuple[Any, int]] = {}  # node_id -> (node, tokens indexed)
        self.entries = 0
        self.stale = 0


class TreeIndex:
    """Continuations of a token context among the cache's stored sequences of one salt."""

    def __init__(self, cache: Any):
        self.cache = cache
        self._spaces: dict[str | None, _Namespace] = {}
        self._signature: dict[str | None, tuple[int, ...]] = {}

    def continuations(self, salt: str | None, context: list[int], depth: int) -> list[tuple[list[int], float]]:
        """(tokens that followed, weight) for each stored place whose tokens end like
        `context`: the weight is evidence() of how many tokens matched backwards; a place whose sequence
        branches gives each branch (up to MAX_PATHS), split evenly. Up to `depth` tokens each."""
        if depth <= 0 or len(context) < KEY:
            return []
        space = self._refreshed(salt)
        if space is None:
            return []
        key = tuple(context[-KEY:])
        places = space.places.get(key)
        if not places:
            return []
        out: list[tuple[list[int], float]] = []
        read = 0
        for node, end, length in reversed(places):
            if not node.alive or len(node.tokens) != length:
                continue
            match = _match_back(node, end, context)
            paths = _paths_after(node, end + 1, depth)
            for path in paths:
                if path:
                    out.append((path, evidence(match) / len(paths)))
            read += 1
            if read >= MAX_PLACES:
                break
        return out

    def _refreshed(self, salt: str | None) -> _Namespace | None:
        root = _root_of(self.cache, salt)
        if root is None:
            self._spaces.pop(salt, None)
            return None
        c = self.cache
        signature = (id(root), c.num_nodes, c.num_cached_blocks, c.num_tier_blocks, c.evicted_blocks)
        space = self._spaces.get(salt)
        if space is not None and self._signature.get(salt) == signature:
            return space
        if space is None or space.stale > max(1024, space.entries // 2):
            space = self._spaces[salt] = _Namespace()
        _index_new(space, root)
        self._signature[salt] = signature
        return space


def _index_new(space: _Namespace, root: Any) -> None:
    """Index every node under root not indexed at its present length (parents first, so a
    key that starts in the parent is read from the parent's tokens)."""
    stack = list(root.children.values())
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        seen = space.seen.get(node.node_id)
        if seen is not None and seen[1] == len(node.tokens):
            continue
        if seen is not None:
            space.stale += seen[1]
        space.seen[node.node_id] = (node, len(node.tokens))
        head = node.parent.tokens[-(KEY - 1):] if node.parent.tokens else []
        tokens = head + node.tokens
        shift = len(head)
        length = len(node.tokens)
        for i in range(max(KEY - 1, shift), len(tokens)):
            space.places[tuple(tokens[i - KEY + 1:i + 1])].append((node, i - shift, length))
        space.entries += length


def _match_back(node: Any, end: int, context: list[int]) -> int:
    """How many tokens, up to MAX_MATCH, agree backwards from node.tokens[end] and context[-1]."""
    n, i = 0, len(context) - 1
    while n < MAX_MATCH and i >= 0 and node is not None:
        while end < 0:
            node = node.parent
            if node is None or not node.tokens:
                return n
            end += len(node.tokens)
        if node.tokens[end] != context[i]:
            return n
        n += 1
        i -= 1
        end -= 1
    return n


def _paths_after(node: Any, start: int, depth: int) -> list[list[int]]:
    """The token runs of up to `depth` tokens that follow node.tokens[start - 1] in the
    tree: along the node, then into its children (most recently used first), at most
    MAX_PATHS of them."""
    head = node.tokens[start:start + depth]
    if len(head) == depth or not node.children:
        return [head]
    children = sorted(node.children.values(), key=lambda c: c.last_access, reverse=True)
    paths: list[list[int]] = []
    for child in children:
        for tail in _paths_after(child, 0, depth - len(head)):
            paths.append(head + tail)
            if len(paths) >= MAX_PATHS:
                return paths
    return paths
