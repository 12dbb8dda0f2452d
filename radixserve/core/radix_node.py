"""RadixNode: one node of the radix tree (core/radix_cache.py), and MatchResult (plain Python).

A node holds a run of whole blocks' token ids and where its blocks live. The tree owns
the tree's fields (parent, children, tokens, salt, locks, hints, the eviction key); each
other field belongs to one component (core/cache_component.py) and only it writes it:
`blocks` FullBlocks, `slots` and `window_slots` TierSlots; `anchor` and `end_access` say
where requests' prompts and replies end (kept ends, read by the components that keep a
state at ends, as sliding-window pages do).
"""

from __future__ import annotations

from dataclasses import dataclass

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
