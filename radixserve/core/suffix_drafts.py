"""Suffix drafting (`speculative="suffix"`): candidate continuations of a request's last
tokens from two corpora, merged into a trie and scored by frequency.

- the request's own tokens, through a per-request suffix index (KEY-token keys -> the
  positions where they end, extended as the request grows);
- the radix cache's stored sequences of the request's own namespace (core/tree_drafts.py):
  earlier prompts and replies, so a tool loop's repeated JSON, a file read back and written
  again, a retried turn, or a ReAct scaffold draft from what was said before.

Every place a key occurs gives the tokens that followed it there, weighted by the square of
how many tokens matched backwards. The draft follows the heaviest child of the trie from its root
while the path's estimated probability (the product of each step's share of its parent's
weight) stays at or above MIN_PATH_SHARE; a request with no place falls back to prompt
lookup. With a tree width over 1 the draft is a tree (core/draft_tree.py): the trie's likeliest
nodes within the length, that path first (best_tree). Length, pauses and
eligibility are PromptLookupDrafter's (core/prompt_lookup.py).
"""

from __future__ import annotations

import heapq
import itertools
from typing import Any

from radixserve.core.prompt_lookup import PromptLookupDrafter, lookup
from radixserve.core.request import Request
from radixserve.core.tree_drafts import KEY, MAX_MATCH, TreeIndex, evidence

MIN_PATH_SHARE = 0.3  # drafting stops where the path's estimated probability falls below this
OWN_PLACES = 16  # most recent places in the request's own tokens read per lookup


class SuffixIndex:
    """KEY-token keys of one request's tokens -> where each occurrence ends."""

    def __init__(self) -> None:
        self.ends: dict[tuple[int, ...], list[int]] = {}
        self.indexed = 0  # tokens [0, indexed) have their keys in `ends`

    def extend(self, tokens: list[int]) -> None:
        for e in range(max(self.indexed, KEY - 1), len(tokens)):
            self.ends.setdefault(tuple(tokens[e - KEY + 1:e + 1]), []).append(e)
        self.indexed = len(tokens)

    def continuations(self, tokens: list[int], depth: int) -> list[tuple[list[int], float]]:
        """(tokens after an earlier occurrence of the last KEY tokens, evidence() of the tokens matched backwards)."""
        self.extend(tokens)
        last = len(tokens) - 1
        out = []
        for e in reversed(self.ends.get(tuple(tokens[-KEY:]), [])):
            if e == last:
                continue
            match = 0
            while match < MAX_MATCH and e - match >= 0 and tokens[e - match] == tokens[last - match]:
                match += 1
            out.append((tokens[e + 1:e + 1 + depth], evidence(match)))
            if len(out) >= OWN_PLACES:
                break
        return out


class _TrieNode:
    __slots__ = ("weight", "children")

    def __init__(self) -> None:
        self.weight = 0.0
        self.children: dict[int, _TrieNode] = {}


def _trie(candidates: list[tuple[list[int], float]], depth: int) -> _TrieNode:
    root = _TrieNode()
    for tokens, weight in candidates:
        if weight <= 0:
            continue
        root.weight += weight
        node = root
        for token in tokens[:depth]:
            node = node.children.setdefault(token, _TrieNode())
            node.weight += weight
    return root


def best_path(candidates: list[tuple[list[int], float]], k: int, min_share: float = MIN_PATH_SHARE) -> list[int]:
    """The heaviest path of the candidates' trie, cut where its probability estimate drops
    below min_share, at most k tokens."""
    return best_tree(candidates, k, 1, min_share)[0]


def best_tree(candidates: list[tuple[list[int], float]], k: int, width: int,
              min_share: float = MIN_PATH_SHARE) -> tuple[list[int], list[int]]:
    """At most k nodes of the candidates' trie as a draft tree (tokens, parents; core/draft_tree.py):
    the likeliest nodes by their path's probability estimate (the product of each step's share
    of its parent's weight; at least min_share), each node's `width` heaviest children at most,
    so that the tree holds the most accepted tokens the estimate expects. Laid out with its
    heaviest path first (width 1: that path alone, as a chain drafter follows it)."""
    root = _trie(candidates, k)
    order = itertools.count()
    frontier: list[tuple[float, int, int, _TrieNode, _TrieNode | None]] = []  # (-share, tie, token, node, parent)

    def offer(parent: _TrieNode, share: float) -> None:
        for token, child in sorted(parent.children.items(), key=lambda item: -item[1].weight)[:width]:
            estimate = share * child.weight / parent.weight
            if estimate >= min_share:
                heapq.heappush(frontier, (-estimate, next(order), token, child, parent))

    offer(root, 1.0)
    chosen: list[tuple[int, _TrieNode, _TrieNode]] = []  # (token, node, parent node), parents first
    while frontier and len(chosen) < k:
        negative, _, token, node, parent = heapq.heappop(frontier)
        chosen.append((token, node, parent))
        offer(node, -negative)
    # the heaviest path among the chosen nodes first, then the others as chosen
    kids: dict[int, list[tuple[int, _TrieNode]]] = {}
    for token, node, parent in chosen:
        kids.setdefault(id(parent), []).append((token, node))
    chain, node = [], root
    while id(node) in kids:
        node = max(kids[id(node)], key=lambda item: item[1].weight)[1]
        chain.append(node)
    on_chain = {id(n) for n in chain}
    laid = chain + [node for _, node, _ in chosen if id(node) not in on_chain]
    index = {id(node): i for i, node in enumerate(laid)}
    token_of = {id(node): token for token, node, _ in chosen}
    parent_of = {id(node): parent for _, node, parent in chosen}
    return ([token_of[id(n)] for n in laid],
            [index.get(id(parent_of[id(n)]), -1) for n in laid])


class SuffixDrafter(PromptLookupDrafter):
    """Prompt lookup's drafter drawing from the suffix index and the radix tree; `cache`
    None (no prefix cache) leaves the request's own tokens."""

    def __init__(self, num_tokens: int, ngram_min: int, ngram_max: int, default_on: bool, cache: Any = None,
                 tree_width: int = 1):
        super().__init__(num_tokens, ngram_min, ngram_max, default_on)
        self.tree = TreeIndex(cache) if cache is not None else None
        self.tree_width = tree_width  # > 1: drafts are trees of candidates (best_tree)
        self._indexes: dict[str, SuffixIndex] = {}

    def _lookup(self, request: Request, k: int) -> list[int]:
        index = self._indexes.setdefault(request.request_id, SuffixIndex())
        candidates = index.continuations(request.token_ids, k)
        own = len(candidates)
        if self.tree is not None:
            candidates += self.tree.continuations(request.cache_salt, request.token_ids, k)
        draft, parents = best_tree(candidates, k, self.tree_width)
        if not draft:
            return lookup(request.token_ids, k, self.ngram_min, self.ngram_max)
        state = self._states[request.request_id]
        state.from_tree = len(candidates) > own  # counted if drafted
        state.parents = parents
        return draft

    def forget(self, request_id: str) -> None:
        super().forget(request_id)
        self._indexes.pop(request_id, None)
