"""KV events from the radix cache (plain Python): a subscriber that applies every event in
order holds exactly the blocks the cache holds, medium by medium, after insertions, splits,
eviction to the tier, restores, tier eviction, drops, flushes and a reload of a persisted
tier; the hashes are the chained hashes an indexer recomputes from the token ids."""

from __future__ import annotations

import random

from radixserve.core.block_pool import BlockPool
from radixserve.core.hashing import chain_hashes, root_hash
from radixserve.core.kv_events import POOL, TIER, AllBlocksCleared, BlockRemoved, BlockStored, KVEventLog
from radixserve.core.radix_cache import RadixCache
from radixserve.kv_tier.index import KVTier

BS = 2


class Subscriber:
    """What an external indexer keeps: the blocks of each medium, and each block's tokens."""

    def __init__(self) -> None:
        self.blocks: dict[str, set[int]] = {POOL: set(), TIER: set()}
        self.tokens: dict[int, tuple[int, ...]] = {}
        self.parent: dict[int, int | None] = {}

    def apply(self, events) -> None:
        for e in events:
            if isinstance(e, AllBlocksCleared):
                for held in self.blocks.values():
                    held.clear()
            elif isinstance(e, BlockStored):
                assert len(e.token_ids) == BS * len(e.block_hashes)
                for i, h in enumerate(e.block_hashes):
                    assert h not in self.blocks[e.medium], "stored twice in one medium"
                    self.blocks[e.medium].add(h)
                    self.tokens[h] = tuple(e.token_ids[i * BS:(i + 1) * BS])
                    self.parent[h] = e.parent_block_hash if i == 0 else e.block_hashes[i - 1]
            else:
                for h in e.block_hashes:
                    self.blocks[e.medium].remove(h)  # a removal of what was never stored fails


def cache_view(cache: RadixCache) -> dict[str, set[int]]:
    view: dict[str, set[int]] = {POOL: set(), TIER: set()}
    for node in cache.nodes():
        if node.blocks:
            view[POOL].update(node.digests)
        if node.slots:
            view[TIER].update(node.digests)
    return view


def cache_prompt(pool, cache, tokens, salt=None):
    blocks = pool.allocate(len(tokens) // BS)
    cache.insert(tokens, blocks, salt)
    pool.free(reversed(blocks))


def test_a_subscriber_rebuilds_the_cache_through_every_kind_of_change():
    pool, log = BlockPool(12), KVEventLog()
    cache = RadixCache(pool, BS, KVTier(6), events=log)
    sub = Subscriber()
    rng = random.Random(7)
    kinds: set[tuple[str, str]] = set()
    for step in range(60):
        action = rng.choice(["insert", "insert", "evict", "restore", "flush"] + (["flush_all"] if step % 20 == 19 else []))
        if action == "insert" and pool.num_free >= 5:
            prefix = rng.choice([[1, 2, 3, 4], [5, 6], [1, 2, 9, 9]])
            cache_prompt(pool, cache, prefix + [rng.randrange(20) for _ in range(2 * rng.randrange(1, 3))],
                         rng.choice([None, "tenant-a"]))
        elif action == "evict":
            cache.evict(rng.randrange(1, 4))
        elif action == "restore":
            m = cache.match_prefix([1, 2, 3, 4, 7, 7])
            if m.num_tier_blocks:
                cache.lock(m.node)
                try:
                    cache.restore(m)
                except MemoryError:
                    pass
                cache.unlock(m.node)
        elif action == "flush":
            cache.flush("tenant-a")
        elif action == "flush_all":
            cache.flush()
        cache.take_copies()
        events = log.take()
        kinds.update((type(e).__name__, getattr(e, "medium", "")) for e in events)
        sub.apply(events)
        assert sub.blocks == cache_view(cache), f"step {step}: {action}"
        cache.check_integrity()
    assert kinds >= {("BlockStored", POOL), ("BlockStored", TIER), ("BlockRemoved", POOL), ("BlockRemoved", TIER)}


def test_hashes_are_the_chained_hashes_of_the_token_ids():
    pool, log = BlockPool(16), KVEventLog()
    cache = RadixCache(pool, BS, events=log)
    cache_prompt(pool, cache, [1, 2, 3, 4, 5, 6])
    cache_prompt(pool, cache, [1, 2, 3, 4, 8, 8], "t")
    first, second = log.take()
    assert first == BlockStored(chain_hashes(root_hash(None), [1, 2, 3, 4, 5, 6], BS), None, [1, 2, 3, 4, 5, 6], POOL)
    assert second.block_hashes == chain_hashes(root_hash("t"), [1, 2, 3, 4, 8, 8], BS)  # its namespace's chain
    cache_prompt(pool, cache, [1, 2, 3, 4, 7, 7])  # the tree splits after 2 blocks: only the new block is stored
    split, = log.take()
    assert split.parent_block_hash == first.block_hashes[1] and split.token_ids == [7, 7]
    assert cache.evict(1) == 1
    removed, = log.take()
    assert isinstance(removed, BlockRemoved) and removed.medium == POOL and len(removed.block_hashes) == 1


def test_a_reloaded_tier_is_announced_and_no_events_cost_nothing_when_off():
    pool = BlockPool(8)
    plain = RadixCache(pool, BS, KVTier(4))
    assert plain.events is None
    cache_prompt(pool, plain, [1, 2, 3, 4])
    log = KVEventLog()
    recording = RadixCache(BlockPool(8), BS, KVTier(4), record_entries=True, write_through=True, events=log)
    cache_prompt(recording.pool, recording, [1, 2, 3, 4])
    entries = [e for kind, e in recording.take_tier_events() if kind == "set"]
    restarted_log = KVEventLog()
    restarted = RadixCache(BlockPool(8), BS, KVTier(4), events=restarted_log)
    assert len(restarted.load_tier_entries(entries)) == 2
    sub = Subscriber()
    sub.apply(restarted_log.take())
    assert sub.blocks == cache_view(restarted) and sub.blocks[TIER] and not sub.blocks[POOL]
