"""RadixCache: exact block ids, split points and eviction order on small trees."""

import pytest

from radixserve.core.block_pool import BlockPool
from radixserve.core.radix_cache import RadixCache

BS = 2


def make(num_blocks=16):
    pool = BlockPool(num_blocks)
    return pool, RadixCache(pool, BS)


def finish(pool, cache, tokens, blocks):
    """What a finished request does: hand its full blocks to the tree, drop its refs."""
    cache.insert(tokens, blocks)
    pool.free(reversed(blocks))


def shape(cache):
    """{path of first-block keys: block ids} for every node, to assert split points."""
    out = {}

    def walk(node, path):
        for key, child in sorted(node.children.items()):
            out[path + (key,)] = child.blocks
            walk(child, path + (key,))

    for root in cache._roots.values():
        walk(root, ())
    return out


def test_insert_then_match_returns_block_ids_and_splits_at_the_match():
    pool, cache = make()
    blocks = pool.allocate(3)  # [0, 1, 2]
    finish(pool, cache, [1, 2, 3, 4, 5, 6], blocks)
    assert pool.ref_counts[:3] == [1, 1, 1]  # the tree's references only
    assert shape(cache) == {((1, 2),): [0, 1, 2]}

    match = cache.match_prefix([1, 2, 3, 4, 9, 9])
    assert match.blocks == [0, 1]
    assert shape(cache) == {((1, 2),): [0, 1], ((1, 2), (5, 6)): [2]}
    assert match.node.blocks == [0, 1]
    cache.check_integrity()


def test_match_is_block_aligned_and_never_longer_than_the_tokens():
    pool, cache = make()
    finish(pool, cache, [1, 2, 3, 4], pool.allocate(2))
    assert cache.match_prefix([1, 2, 3]).blocks == [0]
    assert cache.match_prefix([1]).blocks == []
    assert cache.match_prefix([7, 7, 1, 2]).blocks == []
    assert cache.match_prefix([1, 2, 3, 4, 5, 6]).blocks == [0, 1]


def test_branch_insert_adopts_only_new_blocks_and_duplicates_are_not_adopted():
    pool, cache = make()
    finish(pool, cache, [1, 2, 3, 4, 5, 6], pool.allocate(3))  # blocks 0 1 2
    # A request that reused [0, 1] and computed block 3 for its own third block.
    match = cache.match_prefix([1, 2, 3, 4, 7, 8])
    pool.share(match.blocks)
    own = pool.allocate(1)
    assert own == [3]
    finish(pool, cache, [1, 2, 3, 4, 7, 8], match.blocks + own)
    assert shape(cache) == {
        ((1, 2),): [0, 1],
        ((1, 2), (5, 6)): [2],
        ((1, 2), (7, 8)): [3],
    }
    # A request that computed the same prefix itself (blocks 4, 5): the tree keeps 0, 1.
    dup = pool.allocate(2)
    cache.insert([1, 2, 3, 4], dup)
    assert pool.ref_counts[4:6] == [1, 1]  # not adopted; the request still holds them
    pool.free(reversed(dup))
    assert pool.ref_counts[4:6] == [0, 0]
    assert cache.num_cached_blocks == 4
    cache.check_integrity()


def test_evicts_least_recently_used_leaf_first_and_deepest_blocks_first():
    pool, cache = make()
    finish(pool, cache, [1, 2, 3, 4, 5, 6], pool.allocate(3))  # 0 1 2
    m = cache.match_prefix([1, 2, 3, 4, 7, 8])
    pool.share(m.blocks)
    finish(pool, cache, [1, 2, 3, 4, 7, 8], m.blocks + pool.allocate(1))  # leaf [3] is newest
    cache.match_prefix([1, 2, 3, 4, 5, 6])  # now leaf [2] is newest
    order = []
    for _ in range(4):
        free_before = set(range(16)) - set(cache.held_blocks())
        assert cache.evict(1) == 1
        order += sorted(set(range(16)) - set(cache.held_blocks()) - free_before)
    assert order == [3, 2, 1, 0]
    assert cache.evict(1) == 0
    assert pool.num_free == 16 and cache.num_nodes == 0
    cache.check_integrity()


def test_evict_takes_whole_leaves_until_enough():
    pool, cache = make()
    finish(pool, cache, [1, 1, 2, 2], pool.allocate(2))  # 0 1, older
    finish(pool, cache, [3, 3, 4, 4, 5, 5], pool.allocate(3))  # 2 3 4
    assert cache.evict(3) == 3
    # The older leaf (blocks 0, 1) went entirely, then the newer leaf's deepest block.
    assert sorted(cache.held_blocks()) == [2, 3]
    cache.check_integrity()


def test_locked_prefix_is_never_evicted_and_unlock_makes_it_evictable():
    pool, cache = make()
    finish(pool, cache, [1, 2, 3, 4], pool.allocate(2))
    m = cache.match_prefix([1, 2, 3, 4, 5])
    cache.lock(m.node)
    assert cache.num_evictable_blocks == 0
    assert cache.evict(10) == 0
    assert cache.held_blocks() == [0, 1]
    cache.unlock(m.node)
    assert cache.num_evictable_blocks == 2
    assert cache.evict(10) == 2
    with pytest.raises(RuntimeError, match="unlock of unlocked"):
        cache.unlock(m.node)


def test_lock_on_split_child_protects_the_new_parent():
    pool, cache = make()
    finish(pool, cache, [1, 2, 3, 4, 5, 6], pool.allocate(3))
    whole = cache.match_prefix([1, 2, 3, 4, 5, 6, 0])
    cache.lock(whole.node)
    cache.match_prefix([1, 2, 9, 9])  # splits the locked node after block 0
    assert shape(cache) == {((1, 2),): [0], ((1, 2), (3, 4)): [1, 2]}
    assert cache.evict(5) == 0
    cache.check_integrity()
    cache.unlock(whole.node)
    cache.check_integrity()
    assert cache.evict(5) == 3


def test_salts_keep_namespaces_apart():
    pool, cache = make()
    blocks = pool.allocate(2)
    cache.insert([1, 2, 3, 4], blocks, salt="tenant-a")
    pool.free(blocks)
    assert cache.match_prefix([1, 2, 3, 4, 5], salt="tenant-b").blocks == []
    assert cache.match_prefix([1, 2, 3, 4, 5]).blocks == []
    assert cache.match_prefix([1, 2, 3, 4, 5], salt="tenant-a").blocks == [0, 1]


def test_peek_prefix_changes_nothing():
    pool, cache = make()
    finish(pool, cache, [1, 2, 3, 4, 5, 6], pool.allocate(3))
    before = shape(cache)
    assert cache.peek_prefix([1, 2, 3, 4, 9, 9])[0] == 4
    assert shape(cache) == before


def test_flush_drops_every_unlocked_entry():
    pool, cache = make()
    finish(pool, cache, [1, 2, 3, 4], pool.allocate(2))
    finish(pool, cache, [5, 6], pool.allocate(1))
    m = cache.match_prefix([5, 6, 0])
    cache.lock(m.node)
    assert cache.flush() == 2
    assert cache.held_blocks() == [2]
    cache.unlock(m.node)
    assert cache.flush() == 1
    assert pool.num_free == 16


def test_flush_of_a_namespace_drops_it_and_its_sub_salts_only():
    pool, cache = make()
    finish(pool, cache, [1, 2, 3, 4], pool.allocate(2))  # blocks 0, 1: no salt
    cache.insert([1, 2], blocks := pool.allocate(1), "key:a")  # block 2
    pool.free(blocks)
    cache.insert([1, 2, 3, 4], blocks := pool.allocate(2), "key:a/s")  # blocks 3, 4
    pool.free(reversed(blocks))
    cache.insert([1, 2], blocks := pool.allocate(1), "key:ab")  # block 5: a name that only begins like it
    pool.free(blocks)
    assert cache.flush("key:a") == 3
    assert sorted(cache.held_blocks()) == [0, 1, 5]
    assert cache.match_prefix([1, 2], "key:ab").blocks == [5]
    assert cache.match_prefix([1, 2, 3, 4]).blocks == [0, 1]
    assert cache.match_prefix([1, 2], "key:a").blocks == []
    cache.check_integrity()
    assert cache.flush() == 3 and pool.num_free == 16
