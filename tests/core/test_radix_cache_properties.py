"""Property-based tests: random insert / match / lock / evict / finish / abort sequences
against a simple reference model of what the tree stores."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from radixserve.core.block_pool import BlockPool
from radixserve.core.radix_cache import RadixCache

BS = 2
NUM_BLOCKS = 24
tokens_strategy = st.lists(st.integers(0, 2), min_size=1, max_size=11)


class RadixCacheMachine(RuleBasedStateMachine):
    """Reference model: `stored` maps every block-aligned prefix the tree holds to the
    block id storing its last block. Running requests hold a locked match and blocks."""

    def __init__(self):
        super().__init__()
        self.pool = BlockPool(NUM_BLOCKS)
        self.cache = RadixCache(self.pool, BS)
        self.stored: dict[tuple[int, ...], int] = {}
        self.running: list[dict] = []

    # ---- reference ----------------------------------------------------------

    def expected_match(self, tokens):
        blocks = []
        for k in range(1, len(tokens) // BS + 1):
            prefix = tuple(tokens[: k * BS])
            if prefix not in self.stored:
                break
            blocks.append(self.stored[prefix])
        return blocks

    def record_insert(self, tokens, blocks):
        for k in range(1, len(blocks) + 1):
            self.stored.setdefault(tuple(tokens[: k * BS]), blocks[k - 1])

    def record_evictions(self):
        held = set(self.cache.held_blocks())
        gone = {p for p, b in self.stored.items() if b not in held}
        for p in gone:
            # Only leaves go: nothing longer that extends an evicted prefix may remain.
            assert not any(q[: len(p)] == p and q not in gone for q in self.stored if len(q) > len(p))
            del self.stored[p]
        for r in self.running:  # a locked prefix is never evicted
            for k in range(1, len(r["matched"]) + 1):
                assert tuple(r["tokens"][: k * BS]) in self.stored

    # ---- rules ----------------------------------------------------------------

    @rule(tokens=tokens_strategy)
    def match(self, tokens):
        assert self.cache.match_prefix(tokens).blocks == self.expected_match(tokens)

    @rule(tokens=tokens_strategy)
    def start_request(self, tokens):
        match = self.cache.match_prefix(tokens[:-1])
        assert match.blocks == self.expected_match(tokens[:-1])
        self.cache.lock(match.node)
        need = -(-len(tokens) // BS) - len(match.blocks)
        if need > self.pool.num_free:
            self.cache.evict(need - self.pool.num_free)
            self.record_evictions()
        if need > self.pool.num_free:
            self.cache.unlock(match.node)
            return
        self.pool.share(match.blocks)
        blocks = match.blocks + self.pool.allocate(need)
        self.running.append({"tokens": tokens, "blocks": blocks, "node": match.node, "matched": match.blocks})

    @precondition(lambda self: self.running)
    @rule(index=st.integers(0, 100), computed_everything=st.booleans())
    def finish_request(self, index, computed_everything):
        r = self.running.pop(index % len(self.running))
        full = (len(r["tokens"]) if computed_everything else len(r["tokens"]) - 1) // BS
        self.cache.insert(r["tokens"], r["blocks"][:full])
        self.record_insert(r["tokens"], r["blocks"][:full])
        self.cache.unlock(r["node"])
        self.pool.free(reversed(r["blocks"]))

    @precondition(lambda self: self.running)
    @rule(index=st.integers(0, 100))
    def abort_request(self, index):
        r = self.running.pop(index % len(self.running))
        self.cache.unlock(r["node"])
        self.pool.free(reversed(r["blocks"]))

    @rule(n=st.integers(0, NUM_BLOCKS))
    def evict(self, n):
        evictable = self.cache.num_evictable_blocks
        free_before = self.pool.num_free
        freed = self.cache.evict(n)
        assert freed == min(n, evictable)
        assert self.pool.num_free == free_before + freed
        self.record_evictions()

    @rule()
    def flush(self):
        self.cache.flush()
        self.record_evictions()
        assert self.cache.num_evictable_blocks == 0

    # ---- invariants -------------------------------------------------------------

    @invariant()
    def accounting_holds(self):
        self.cache.check_integrity()
        expected = [0] * NUM_BLOCKS
        for r in self.running:
            for b in r["blocks"]:
                expected[b] += 1
        for b in self.cache.held_blocks():
            expected[b] += 1
        self.pool.check_integrity(expected)  # free + cached + in use == total, no leak, no double free
        assert set(self.cache.held_blocks()) == set(self.stored.values())
        assert len(self.stored) == self.cache.num_cached_blocks


RadixCacheMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
TestRadixCacheProperties = RadixCacheMachine.TestCase
