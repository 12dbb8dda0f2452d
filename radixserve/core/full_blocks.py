"""FullBlocks: the tree's component for full-attention KV blocks in the pool (plain Python).

A node in the pool holds a run of pool block ids (`node.blocks`), one per block of its
tokens, and the tree holds one BlockPool reference on each. Its rule: a block stays while
its node is in the pool; a node leaves the pool only as an unlocked pool leaf, in the tree's
eviction order (radix_cache.py), its deepest blocks first. Every block stored and removed
is a KV event in the POOL medium (core/kv_events.py).

Integrity: `num_cached` equals the blocks the tree's nodes hold; a node holds all of its
blocks or none; a node in the pool has its parent in the pool (residency is top-connected).
The pool's reference counts are checked against every holder by KVManager.check_integrity.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from radixserve.core.block_pool import BlockPool
from radixserve.core.kv_events import POOL, KVEventLog

if TYPE_CHECKING:
    from radixserve.core.radix_node import RadixNode


class FullBlocks:
    name = "full"

    def __init__(self, pool: BlockPool, events: KVEventLog):
        self.pool = pool
        self.events = events
        self.num_cached = 0  # pool blocks stored in the tree

    def store(self, node: "RadixNode", blocks: list[int]) -> None:
        """`node` keeps a request's computed blocks: the tree takes its own reference on each."""
        self.pool.share(blocks)
        node.blocks = list(blocks)
        self.events.node_stored(node, POOL)
        self.num_cached += len(blocks)

    def allocate(self, node: "RadixNode", n: int, windows: list[bool] | None = None) -> list[int]:
        """New pool blocks for `node` (a restore from the tier; the tree's reference is the
        allocation's). Hybrid KV: a window page only where `windows` says."""
        node.blocks = self.pool.allocate(n, windows)
        self.events.node_stored(node, POOL)
        self.num_cached += n
        return node.blocks

    def release(self, node: "RadixNode") -> int:
        """`node` leaves the pool: the tree's references go (deepest first); returns how many
        blocks became free."""
        n = len(node.blocks)
        freed = self.pool.free(reversed(node.blocks))
        self.events.node_removed(node, POOL)
        self.num_cached -= n
        node.blocks = []
        return freed

    def split(self, upper: "RadixNode", lower: "RadixNode", n_blocks: int) -> None:
        upper.blocks = lower.blocks[:n_blocks]
        lower.blocks = lower.blocks[n_blocks:]

    def check_node(self, node: "RadixNode", size: int) -> None:
        if len(node.blocks) not in (0, size):
            raise AssertionError(f"{node}: {size} blocks but {len(node.blocks)} in pool")
        if node.blocks and not node.parent.is_root and not node.parent.blocks:
            raise AssertionError(f"{node} is in the pool but its parent is not")

    def check_integrity(self, nodes: list["RadixNode"]) -> None:
        held = sum(len(n.blocks) for n in nodes)
        if held != self.num_cached:
            raise AssertionError(f"full blocks: {self.num_cached} counted, the tree's nodes hold {held}")
        if any(self.pool.ref_counts[b] <= 0 for n in nodes for b in n.blocks):
            raise AssertionError("a node holds a free pool block")
