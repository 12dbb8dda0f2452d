"""A speculative draft as a tree: several candidate continuations verified in one step.

A draft is its tokens and, for each, the index of its parent among them (-1: the request's
last token, the one the step computes before the draft). Nodes come parents first, the
heaviest chain leading (nodes 0..k-1 are the chain a chain drafter would give), siblings
with distinct tokens. A chain is parents [-1, 0, 1, ...]; `parents` empty means one too.

Node i's K/V is written to the request's slot base + i (base: the slot after its last
token) and it is computed at position base + depth(i); its attention row sees the request's
tokens before base and its ancestors and itself (ancestor_masks: bit j = node j, the tree
masks of attention/metadata.py). After verification the accepted path's K/V move from slot
base + node to base + depth where those differ (moves), so the request's slots hold its
tokens in order again.
"""

from __future__ import annotations

MAX_NODES = 64  # a tree row's mask has one bit per node


def chain(n: int) -> list[int]:
    return list(range(-1, n - 1))


def is_chain(parents: list[int]) -> bool:
    return all(p == i - 1 for i, p in enumerate(parents))


def depths(parents: list[int]) -> list[int]:
    out: list[int] = []
    for p in parents:
        out.append(out[p] + 1 if p >= 0 else 0)
    return out


def ancestor_masks(parents: list[int]) -> list[int]:
    """Each node's bit and its ancestors' (bit j: node j)."""
    out: list[int] = []
    for i, p in enumerate(parents):
        out.append((1 << i) | (out[p] if p >= 0 else 0))
    return out


def children(parents: list[int]) -> dict[int, list[int]]:
    """Node -> its children in node order (-1: the root's)."""
    out: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        out.setdefault(p, []).append(i)
    return out


def check(tokens: list[int], parents: list[int]) -> None:
    """ValueError unless parents describes a tree over tokens as this module lays it out."""
    if len(parents) != len(tokens) or len(tokens) > MAX_NODES:
        raise ValueError(f"a draft tree has one parent per token and at most {MAX_NODES} nodes")
    seen: set[tuple[int, int]] = set()
    for i, (token, p) in enumerate(zip(tokens, parents)):
        if not -1 <= p < i:
            raise ValueError(f"draft node {i}'s parent {p} is not an earlier node or -1")
        if (p, token) in seen:
            raise ValueError(f"draft node {i} repeats a sibling's token {token}")
        seen.add((p, token))


def accepted_path(tokens: list[int], parents: list[int], appended: list[int]) -> list[int]:
    """The nodes verification accepted, root first: the path whose tokens the request appended
    (all of `appended` but its last token, which no node holds or which was rejected)."""
    kids = children(parents)
    path: list[int] = []
    node = -1
    for token in appended[:-1]:
        node = next(c for c in kids.get(node, []) if tokens[c] == token)
        path.append(node)
    return path


def moves(path: list[int]) -> list[tuple[int, int]]:
    """(from node slot, to depth slot) offsets from base for the accepted path's K/V, in an
    order safe to apply one by one (ascending: node path[d] >= d, and no later source is an
    earlier destination)."""
    return [(node, depth) for depth, node in enumerate(path) if node != depth]
