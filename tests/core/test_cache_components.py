"""The KV cache's seams (core/cache_component.py): each kind of cached state has its own
integrity check, which catches a corrupted state of its own; a disabled prefix cache is
NoPrefixCache, the same interface holding nothing: requests run with zero hits and leave
no block, page or lock behind."""

from __future__ import annotations

import pytest

from radixserve.config import EngineConfig
from radixserve.core.block_pool import BlockPool
from radixserve.core.no_prefix_cache import NoPrefixCache
from radixserve.core.radix_cache import RadixCache
from radixserve.core.request import RequestStatus
from radixserve.core.scheduler import Scheduler
from radixserve.core.sliding_window import SlidingWindow
from radixserve.core.tier_slots import NoTierSlots, TierSlots
from radixserve.core.window_pages import WindowPages
from radixserve.kv_tier.index import KVTier
from scheduler_helpers import add, make_scheduler, step

BS = 4


def _cached(cache, pool, tokens):
    blocks = pool.allocate(len(tokens) // BS)
    node = cache.insert(tokens, blocks)
    pool.free(reversed(blocks))
    return node


def _run_all(s, requests, token=7):
    while any(r.status is not RequestStatus.FINISHED for r in requests):
        step(s, token)  # every step checks every invariant


def test_full_blocks_check_catches_a_block_freed_behind_the_trees_back():
    pool = BlockPool(8)
    cache = RadixCache(pool, BS)
    node = _cached(cache, pool, list(range(8)))
    cache.check_integrity()
    pool.free([node.blocks[1]])  # the tree's own reference, dropped by someone else
    with pytest.raises(AssertionError, match="free pool block"):
        cache.full.check_integrity(list(cache.nodes()))
    with pytest.raises(AssertionError):
        cache.check_integrity()


def test_tier_slots_check_catches_a_slot_held_twice():
    pool = BlockPool(4)
    cache = RadixCache(pool, BS, KVTier(8), write_through=True)
    assert isinstance(cache.tier_slots, TierSlots)
    a = _cached(cache, pool, [1] * 8)
    b = _cached(cache, pool, [2] * 8)
    cache.check_integrity()
    assert a.slots == [0, 1] and b.slots == [2, 3]
    b.slots = [2, 1]  # b claims a's second slot (and leaks its own)
    with pytest.raises(AssertionError, match="held twice"):
        cache.tier_slots.check_integrity(list(cache.nodes()))


def test_without_a_tier_no_node_may_hold_a_slot():
    pool = BlockPool(4)
    cache = RadixCache(pool, BS)
    assert isinstance(cache.tier_slots, NoTierSlots) and cache.tier is None
    node = _cached(cache, pool, [1] * 4)
    cache.check_integrity()
    node.slots = [0]
    with pytest.raises(AssertionError, match="without a tier"):
        cache.tier_slots.check_integrity(list(cache.nodes()))


def test_sliding_window_check_catches_a_running_blocks_lost_page_and_a_wrong_user_count():
    config = EngineConfig(block_size=BS, chunked_prefill_size=64, max_num_batched_tokens=64)
    pool = BlockPool(32, WindowPages(32, 32, 8, BS))
    s = Scheduler(config, pool, RadixCache(pool, BS))
    [window] = s.kv.components
    assert isinstance(window, SlidingWindow)
    r = add(s, list(range(20)), 8)
    step(s)
    table = list(r.block_table)
    window.window.users[table[-1]] += 1
    with pytest.raises(AssertionError, match="window users differ"):
        s.check_integrity()
    window.window.users[table[-1]] -= 1
    s.check_integrity()
    window.window.trim(table[-1])  # a block in the request's window loses its page
    with pytest.raises(AssertionError, match="has no window page"):
        window.check_integrity(pool.ref_counts, [r])


def test_the_disabled_cache_serves_repeated_prompts_with_zero_hits_and_no_leaks():
    s = make_scheduler(num_blocks=16, cache=False)
    assert isinstance(s.kv.cache, NoPrefixCache) and not s.kv.caching
    shared = list(range(100, 112))
    first = [add(s, shared + [1, 2], 4), add(s, shared + [3, 4], 4)]
    _run_all(s, first)
    again = [add(s, shared + [1, 2], 4)]  # the same prompt: nothing of it is cached
    _run_all(s, again)
    assert [r.cached_tokens for r in first + again] == [0, 0, 0]
    assert s.stats.cached_prompt_tokens == 0 and s.stats.computed_tokens == 3 * 14 + 3 * 3
    assert s.kv.pool.num_free == 16 and s.kv.pool.ref_counts == [0] * 16
    assert list(s.kv.cache.nodes()) == [] and s.kv.flush() == 0 and s.kv.take_copies() == []


def test_the_disabled_cache_on_a_hybrid_pool_gives_every_window_page_back():
    config = EngineConfig(block_size=BS, chunked_prefill_size=64, max_num_batched_tokens=64)
    pool = BlockPool(32, WindowPages(32, 32, 8, BS))
    s = Scheduler(config, pool, None)
    requests = [add(s, list(range(30)) + [i], 6) for i in range(3)]
    _run_all(s, requests)
    assert [r.cached_tokens for r in requests] == [0, 0, 0]
    assert pool.num_free_blocks == 32 and pool.window.num_attached == 0 and pool.window.users == [0] * 32
