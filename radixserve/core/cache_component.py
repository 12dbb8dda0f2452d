"""CacheComponent: one kind of cached state kept beside the radix tree (plain Python).

The tree (core/radix_cache.py) matches, inserts, locks and evicts nodes; what a node's
blocks hold is kept by components, one per kind of state, each with its own rule for what
it keeps and evicts and its own integrity check:

    RadixCache ── FullBlocks      full-attention blocks in the pool  (core/full_blocks.py)
               └─ TierSlots       their second-tier copies           (core/tier_slots.py)
    KVManager ─── CacheComponent  the kinds a model adds, registered in core/kv_manager.py's
                                  components_for(): sliding-window pages (core/sliding_window.py),
                                  recurrent-layer state snapshots (core/recurrent_snapshots.py)

A registered component sees each request's life through the KVManager (hooks below, all
no-ops here) and each node's through the tree (split, evicted). It keeps what it holds per
node in its own map by node id (or a node field it alone writes). A new kind of cached state
is one subclass in its own file plus its line in components_for(); the memory planner
(engine/memory_plan.py) gives it its share of the KV bytes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from radixserve.core.radix_cache import MatchResult, RadixCache, RadixNode
    from radixserve.core.request import Request


class CacheComponent:
    name = "component"
    cache: "RadixCache"

    def attach(self, cache: "RadixCache") -> None:
        """The tree whose nodes this component keeps state for (KVManager calls it once)."""
        self.cache = cache

    # ---- the tree's side: a node's state ---------------------------------------------

    def split(self, upper: "RadixNode", lower: "RadixNode", n_blocks: int) -> None:
        """`upper` (a new node) took the first n_blocks blocks of `lower`: divide its state."""

    def evicted(self, node: "RadixNode") -> None:
        """`node`'s pool blocks left the pool (moved to the tier or dropped)."""

    def dropped(self, node: "RadixNode") -> None:
        """`node` left the tree (dropped, flushed, or pushed out of the tier)."""

    # ---- the KV manager's side: a request's life --------------------------------------

    def usable_blocks(self, match: "MatchResult") -> int:
        """How many leading blocks of a cached match a request may reuse (the match is cut
        there): the longest end whose state this component keeps."""
        return len(match.blocks) + match.num_tier_blocks

    def fits(self, request: "Request", match: "MatchResult", alone: bool) -> bool:
        """Whether what the request's first chunk needs of this state is free (making room if
        it can). `alone`: no other request runs."""
        return True

    def chunk_limit(self, request: "Request", num_tokens: int) -> int:
        """How many of the `num_tokens` the scheduler would compute for the request next it
        may (a component whose state is taken between steps stops a chunk where it takes it)."""
        return num_tokens

    def before_step(self) -> None:
        """A step is being scheduled: the running requests stand where their computed tokens end."""

    def make_room(self, num_blocks: int) -> bool:
        """Make room for `num_blocks` new pool blocks' state; whether there is."""
        return True

    def adopted(self, request: "Request", blocks: list[int]) -> None:
        """The request took these cached blocks as its block table's start."""

    def extended(self, request: "Request", blocks: list[int]) -> None:
        """New blocks at the end of the request's block table."""

    def shrunk(self, request: "Request", blocks: list[int]) -> None:
        """These blocks left the end of the request's block table (about to be freed)."""

    def inserted(self, request: "Request", node: "RadixNode") -> None:
        """The request's computed blocks went into the tree, ending at `node`."""

    def released(self, request: "Request", node: "RadixNode | None") -> None:
        """The request left (its blocks are in the tree up to `node`); its references are
        dropped right after."""

    def after_step(self, running: list["Request"]) -> None:
        """A step ran: the running requests advanced."""

    def check_integrity(self, refs: list[int], running: list) -> None:
        """Raise AssertionError if this state disagrees with its holders: `refs`, each pool
        block's expected reference count; `running`, what holds blocks (requests, holds)."""
