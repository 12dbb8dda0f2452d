"""The second KV tier in the radix cache (plain Python): demotion, restore, the copies the
runner is asked to make, tier eviction order, flush, and integrity."""

from __future__ import annotations

import pytest

from radixserve.core.block_pool import BlockPool
from radixserve.kv_tier.index import KVCopy, KVTier
from radixserve.core.radix_cache import RadixCache

BS = 2


def make(num_blocks=8, num_slots=8, **kw):
    pool = BlockPool(num_blocks)
    cache = RadixCache(pool, BS, KVTier(num_slots), **kw)
    return pool, cache


def cache_prompt(pool, cache, tokens):
    """What a finished request leaves behind: its blocks in the tree, its references dropped."""
    blocks = pool.allocate(len(tokens) // BS)
    node = cache.insert(tokens, blocks)
    pool.free(reversed(blocks))
    return node, blocks


def test_evicted_blocks_move_to_the_tier_and_a_match_restores_them():
    pool, cache = make()
    _, blocks = cache_prompt(pool, cache, [1, 2, 3, 4, 5, 6])
    assert cache.evict(3) == 3
    assert pool.num_free == 8 and cache.num_cached_blocks == 0 and cache.num_tier_blocks == 3
    saves = cache.take_copies()
    assert saves == [KVCopy(True, b, s) for b, s in zip(blocks, [0, 1, 2])]
    slot_of = {c.block: c.slot for c in saves}
    m = cache.match_prefix([1, 2, 3, 4, 5, 6, 7])
    assert m.blocks == [] and m.num_tier_blocks == 3
    cache.lock(m.node)
    restored = cache.restore(m)
    assert len(restored) == 3 and pool.num_free == 5
    restores = cache.take_copies()
    assert [(c.to_tier, c.slot) for c in restores] == [(False, slot_of[b]) for b in blocks]
    assert [c.block for c in restores] == restored
    assert cache.restored_blocks == 3 and cache.tier_hits == 1
    cache.check_integrity()
    cache.unlock(m.node)
    # the restored node keeps its tier copy: evicting it again copies nothing
    assert cache.evict(3) == 3 and cache.take_copies() == []
    cache.check_integrity()


def test_partial_eviction_moves_the_deepest_blocks_and_restore_is_top_down():
    pool, cache = make()
    cache_prompt(pool, cache, [1, 2, 3, 4, 5, 6, 7, 8])
    assert cache.evict(1) == 1
    m = cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert len(m.blocks) == 3 and m.num_tier_blocks == 1
    cache.check_integrity()
    cache.evict(3)
    m = cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert m.blocks == [] and m.num_tier_blocks == 4
    cache.lock(m.node)
    cache.take_copies()
    cache.restore(m)
    assert [c.to_tier for c in cache.take_copies()] == [False] * 4
    cache.unlock(m.node)
    cache.check_integrity()


def test_a_full_tier_gives_up_its_least_recent_entries_and_never_more_valuable_ones():
    pool, cache = make(num_blocks=4, num_slots=2)
    cache_prompt(pool, cache, [1, 1, 1, 2])  # older
    cache_prompt(pool, cache, [2, 1, 2, 2])  # newer
    cache.evict(4)  # both leave the pool; the tier holds 2 of their 4 blocks
    cache.check_integrity()
    assert cache.num_tier_blocks == 2
    # the newer prompt's blocks are the ones kept
    assert cache.match_prefix([2, 1, 2, 2, 0]).num_tier_blocks == 2
    assert cache.match_prefix([1, 1, 1, 2, 0]).num_tier_blocks == 0
    assert cache.evictions["dropped"] + cache.evictions["tier_dropped"] == 2


def test_restore_that_cannot_fit_raises_and_changes_nothing():
    pool, cache = make(num_blocks=3, num_slots=8)
    cache_prompt(pool, cache, [1, 2, 3, 4, 5, 6])
    cache.evict(3)
    held = pool.allocate(1)
    m = cache.match_prefix([1, 2, 3, 4, 5, 6, 7])
    cache.lock(m.node)
    with pytest.raises(MemoryError):
        cache.restore(m)
    cache.unlock(m.node)
    pool.free(held)
    cache.check_integrity()
    assert cache.num_tier_blocks == 3


def test_insert_adopts_a_requests_blocks_for_tokens_only_in_the_tier():
    pool, cache = make()
    cache_prompt(pool, cache, [1, 2, 3, 4])
    cache.evict(2)
    blocks = pool.allocate(3)
    node = cache.insert([1, 2, 3, 4, 5, 6], blocks)
    pool.free(reversed(blocks))
    cache.check_integrity()
    m = cache.match_prefix([1, 2, 3, 4, 5, 6, 7])
    assert m.blocks == blocks and m.num_tier_blocks == 0 and m.node is node


def test_flush_empties_both_tiers():
    pool, cache = make()
    cache_prompt(pool, cache, [1, 2, 3, 4])
    cache.evict(1)
    cache_prompt(pool, cache, [5, 6, 7, 8])
    cache.flush()
    cache.check_integrity()
    assert cache.num_tier_blocks == 0 and cache.num_cached_blocks == 0 and pool.num_free == 8
    assert cache.tier.num_free == 8


def test_write_through_keeps_every_new_block_in_both_tiers():
    pool, cache = make(write_through=True, record_entries=True)
    cache_prompt(pool, cache, [1, 2, 3, 4])
    assert [c.to_tier for c in cache.take_copies()] == [True, True]
    events = cache.take_tier_events()
    assert [kind for kind, _ in events] == ["set", "set"]
    assert [e.tokens for _, e in events] == [(1, 2), (3, 4)]
    assert events[1][1].parent == events[0][1].digest
    assert cache.evict(2) == 2 and cache.take_copies() == []  # already in the tier
    cache.check_integrity()


def test_integrity_catches_a_slot_held_twice():
    pool, cache = make()
    node, _ = cache_prompt(pool, cache, [1, 2, 3, 4])
    cache.evict(2)
    node.slots[1] = node.slots[0]
    with pytest.raises(AssertionError):
        cache.check_integrity()
