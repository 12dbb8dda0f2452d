"""Property-based test over pool + tier + sessions: random requests (some in sessions),
finishes, aborts, evictions, flushes, session closes, TTL expiry and pins, with the
integrity of every structure checked after every step.

The K/V bytes are simulated: a block's "content" is the token prefix whose last block it
stores. Requests write the content of the blocks they compute, and the tier copies are run
in order as the runner runs them, so every match proves that the blocks it returns (pool
hits and restores alike) hold exactly the prefix asked for: never wrong KV."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from radixserve.core.block_pool import BlockPool
from radixserve.kv_tier.index import KVTier
from radixserve.core.radix_cache import RadixCache
from radixserve.core.sessions import SessionTable

BS = 2
NUM_BLOCKS = 8
NUM_SLOTS = 10
# A few recurring prefixes (agents' histories) with random continuations, so that evicted
# prefixes come back and get restored.
BASES = [[0, 1, 2, 0, 1, 2, 0, 1], [0, 1, 2, 0, 2, 2], [1, 1, 1, 1, 1, 1, 1, 1], [2, 0, 2, 0], [0, 1], []]
tokens_strategy = st.builds(
    lambda base, tail: base + tail, st.sampled_from(BASES), st.lists(st.integers(0, 2), max_size=5)
).filter(lambda t: len(t) >= 1)


class TieredCacheMachine(RuleBasedStateMachine):
    write_through = False  # True: every new block is also saved to the tier (persistence)

    def __init__(self):
        super().__init__()
        self.pool = BlockPool(NUM_BLOCKS)
        self.cache = RadixCache(self.pool, BS, KVTier(NUM_SLOTS), write_through=self.write_through, record_entries=True)
        self.now = 0.0
        self.sessions = SessionTable(self.cache, ttl_s=10.0, clock=lambda: self.now)
        self.pool_bytes: list[tuple | None] = [None] * NUM_BLOCKS
        self.tier_bytes: list[tuple | None] = [None] * NUM_SLOTS
        self.running: list[dict] = []

    # ---- the runner, simulated --------------------------------------------------------

    def run_copies(self):
        for c in self.cache.take_copies():
            if c.to_tier:
                self.tier_bytes[c.slot] = self.pool_bytes[c.block]
            else:
                self.pool_bytes[c.block] = self.tier_bytes[c.slot]
        self.cache.take_tier_events()

    def check_content(self, tokens, blocks):
        for i, b in enumerate(blocks):
            assert self.pool_bytes[b] == tuple(tokens[: (i + 1) * BS]), f"block {b} holds the wrong prefix"

    # ---- rules --------------------------------------------------------------------------

    @rule(tokens=tokens_strategy, session=st.sampled_from([None, "a", "b"]))
    def start_request(self, tokens, session):
        match = self.cache.match_prefix(tokens[:-1])
        self.cache.lock(match.node)
        cached = len(match.blocks) + match.num_tier_blocks
        need_total = -(-len(tokens) // BS) - len(match.blocks)
        if need_total > self.pool.num_free + self.cache.num_evictable_blocks:
            self.cache.unlock(match.node)  # the pool cannot hold it even after eviction
            return
        blocks = self.cache.restore(match)
        self.run_copies()
        self.check_content(tokens, blocks)
        need = -(-len(tokens) // BS) - cached
        if need > self.pool.num_free:
            self.cache.evict(need - self.pool.num_free)
            self.run_copies()
        assert need <= self.pool.num_free, "admission control admitted what eviction cannot free"
        self.pool.share(blocks)
        new = self.pool.allocate(need)
        for i, b in enumerate(new, start=cached):
            self.pool_bytes[b] = tuple(tokens[: (i + 1) * BS])  # the forward pass writes them
        self.check_content(tokens, (blocks + new)[: len(tokens) // BS])
        self.running.append({"tokens": tokens, "blocks": blocks + new, "node": match.node, "session": session})

    @precondition(lambda self: self.running)
    @rule(index=st.integers(0, 100))
    def finish_request(self, index):
        r = self.running.pop(index % len(self.running))
        full = len(r["tokens"]) // BS
        node = self.cache.insert(r["tokens"], r["blocks"][:full])
        if r["session"] is not None and full:
            self.sessions.advance(None, r["session"], node)
        self.cache.unlock(r["node"])
        self.pool.free(reversed(r["blocks"]))
        self.run_copies()

    @precondition(lambda self: self.running)
    @rule(index=st.integers(0, 100))
    def abort_request(self, index):
        r = self.running.pop(index % len(self.running))
        self.cache.unlock(r["node"])
        self.pool.free(reversed(r["blocks"]))

    @rule(n=st.integers(0, NUM_BLOCKS))
    def evict(self, n):
        evictable = self.cache.num_evictable_blocks
        freed = self.cache.evict(n)
        assert freed == min(n, evictable)
        self.run_copies()

    @rule()
    def evict_everything_unlocked(self):
        self.cache.evict(self.cache.num_evictable_blocks)
        assert self.cache.num_evictable_blocks == 0
        self.run_copies()

    @rule()
    def flush(self):
        self.cache.flush()
        assert self.cache.num_evictable_blocks == 0
        self.run_copies()

    @rule(session=st.sampled_from(["a", "b", "c"]))
    def close_session(self, session):
        self.sessions.close(None, session)

    @rule(seconds=st.floats(0, 15))
    def time_passes(self, seconds):
        self.now += seconds
        self.sessions.expire()

    @rule(tokens=tokens_strategy)
    def pin(self, tokens):
        match = self.cache.match_prefix(tokens)
        if not match.node.is_root:
            self.sessions.pin(match.node, 5.0)

    @rule(tokens=tokens_strategy)
    def lookup(self, tokens):
        """A match never returns a block with the wrong content, in the pool or the tier."""
        match = self.cache.match_prefix(tokens)
        self.check_content(tokens, match.blocks)
        node, depth = match.node, len(match.blocks) + match.num_tier_blocks
        slots = []
        while not node.is_root:
            slots = node.slots + slots if not node.blocks else slots
            node = node.parent
        tier_part = slots[len(slots) - match.num_tier_blocks:] if match.num_tier_blocks else []
        for i, s in enumerate(tier_part, start=len(match.blocks)):
            assert self.tier_bytes[s] == tuple(tokens[: (i + 1) * BS]), f"slot {s} holds the wrong prefix"
        assert depth * BS <= len(tokens)

    # ---- invariants -------------------------------------------------------------------

    @invariant()
    def accounting_holds(self):
        self.cache.check_integrity()  # tier: every slot free xor held by exactly one node
        self.sessions.check_integrity()
        expected = [0] * NUM_BLOCKS
        for r in self.running:
            for b in r["blocks"]:
                expected[b] += 1
        for b in self.cache.held_blocks():
            expected[b] += 1
        self.pool.check_integrity(expected)
        for node in self.cache.nodes():  # both copies of a block hold the same content
            for b, s in zip(node.blocks, node.slots):
                assert self.pool_bytes[b] == self.tier_bytes[s]


TieredCacheMachine.TestCase.settings = settings(max_examples=250, stateful_step_count=40, deadline=None)
TestTieredCacheProperties = TieredCacheMachine.TestCase


class WriteThroughMachine(TieredCacheMachine):
    write_through = True


WriteThroughMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestWriteThroughProperties = WriteThroughMachine.TestCase


def test_sessions_order_eviction_but_never_reserve():
    """A session's context leaves after unreferenced entries, a superseded branch first, and
    still leaves when nothing else can."""
    pool = BlockPool(6)
    cache = RadixCache(pool, BS)
    sessions = SessionTable(cache, ttl_s=60.0)

    def cached(tokens):
        blocks = pool.allocate(len(tokens) // BS)
        node = cache.insert(tokens, blocks)
        pool.free(reversed(blocks))
        return node

    old_turn = cached([1, 1, 5, 5])
    sessions.advance(None, "agent", old_turn)
    new_turn = cached([1, 1, 7, 7])  # the session moved on: [5, 5] is superseded
    sessions.advance(None, "agent", new_turn)
    stranger = cached([2, 2])  # unreferenced, and the most recent
    assert cache.evict(1) == 1 and cache.match_prefix([1, 1, 5, 5]).blocks == cache.match_prefix([1, 1]).blocks
    assert cache.evict(1) == 1 and cache.match_prefix([2, 2]).blocks == []
    assert len(cache.match_prefix([1, 1, 7, 7]).blocks) == 2
    assert cache.evict(2) == 2  # a hint, not a reservation
    cache.check_integrity()
    sessions.check_integrity()
    assert stranger is not None
