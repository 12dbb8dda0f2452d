"""Suffix drafting's corpora and scoring: the radix tree read per namespace (core/tree_drafts.py),
the per-request suffix index, the frequency trie, and the drafter that merges them."""

from __future__ import annotations

from radixserve import SamplingParams
from radixserve.core.block_pool import BlockPool
from radixserve.core.radix_cache import RadixCache
from radixserve.core.request import Request
from radixserve.core.suffix_drafts import SuffixDrafter, SuffixIndex, best_path, best_tree
from radixserve.core.tree_drafts import TreeIndex

BS = 4


def cache_with(sequences: list[tuple[list[int], str | None]], num_blocks: int = 64) -> tuple[BlockPool, RadixCache]:
    pool = BlockPool(num_blocks)
    cache = RadixCache(pool, BS)
    for tokens, salt in sequences:
        n = len(tokens) // BS
        blocks = pool.allocate(n)
        cache.insert(tokens, blocks, salt)
        pool.free(reversed(blocks))
    return pool, cache


def test_continuations_come_from_the_salts_own_tree_only():
    reply = [7, 8, 9, 10, 11, 12, 13, 14]
    prompt = [1, 2, 3, 4, 5, 6, 20, 21]
    _, cache = cache_with([(prompt + reply, "key:a"), ([1, 2, 3, 4, 5, 6, 30, 31, 32, 33, 34, 35], "key:b")])
    index = TreeIndex(cache)
    context = [99, 5, 6, 20, 21]
    assert index.continuations("key:a", context, 4) == [([7, 8, 9, 10], 16.0)]  # matched 5 6 20 21 backwards: 4 squared
    assert index.continuations("key:b", context, 4) == []  # b never saw 20 21
    assert index.continuations(None, context, 4) == []  # nor does the unsalted namespace
    assert index.continuations("key:a/sub", context, 4) == []  # a sub-salt is a namespace of its own
    # b's own continuation of 5 6 is its own reply; a's tree answers with a's
    assert index.continuations("key:b", [4, 5, 6], 3) == [([30, 31, 32], 9.0)]
    assert index.continuations("key:a", [4, 5, 6], 3) == [([20, 21, 7], 9.0)]


def test_branches_split_the_weight_and_new_nodes_are_indexed_after_a_split():
    _, cache = cache_with([([1, 2, 3, 4, 5, 6, 7, 8], None)])
    index = TreeIndex(cache)
    assert index.continuations(None, [2, 3, 4], 4) == [([5, 6, 7, 8], 9.0)]
    pool = cache.pool
    blocks = pool.allocate(2)
    cache.insert([1, 2, 3, 4, 40, 41, 42, 43], blocks)  # splits the first node after one block
    pool.free(reversed(blocks))
    got = sorted(index.continuations(None, [2, 3, 4], 4))
    assert got == [([5, 6, 7, 8], 4.5), ([40, 41, 42, 43], 4.5)]
    # the lower half of the split node still answers for its own keys, at its new offsets
    assert index.continuations(None, [5, 6, 7], 1) == [([8], 9.0)]
    cache.check_integrity()


def test_evicted_sequences_stop_feeding_drafts():
    _, cache = cache_with([([1, 2, 3, 4, 5, 6, 7, 8], None)])
    index = TreeIndex(cache)
    assert index.continuations(None, [1, 2, 3], 2) == [([4, 5], 9.0)]
    cache.evict(2)
    assert cache.num_cached_blocks == 0
    assert index.continuations(None, [1, 2, 3], 2) == []


def test_suffix_index_weighs_earlier_occurrences_by_the_square_of_their_match():
    index = SuffixIndex()
    tokens = [9, 1, 2, 3, 50, 8, 1, 2, 3, 60, 8, 1, 2, 3]
    # latest first: [8 1 2 3] matched 4 back before 60, and 4 back before 50 (9 != 8 stops the first at 3)
    assert index.continuations(tokens, 2) == [([60, 8], 16.0), ([50, 8], 9.0)]  # squared
    tokens += [60]
    assert index.continuations(tokens, 2) == [([8, 1], 25.0)]  # extended incrementally
    assert index.indexed == len(tokens)


def test_one_long_match_outvotes_two_that_match_only_the_key():
    index = SuffixIndex()
    # 7 8 9 1 2 3 was followed by 40 once; 1 2 3 alone (matched 3) by 50 twice: 6 * 6 > 2 * 3 * 3
    tokens = [7, 8, 9, 1, 2, 3, 40, 0, 1, 2, 3, 50, 0, 5, 1, 2, 3, 50, 0, 7, 8, 9, 1, 2, 3]
    candidates = index.continuations(tokens, 1)
    assert sorted(candidates) == [([40], 36.0), ([50], 9.0), ([50], 9.0)]
    assert best_path(candidates, 1) == [40]  # by the plain count (6 against 3 + 3) the tie would go to the latest, 50


def test_best_path_follows_the_heaviest_branch_while_it_is_likely():
    candidates = [([1, 2, 3, 4], 3.0), ([1, 2, 9, 9], 1.0), ([5, 6], 0.5)]
    # 1: 4/4.5, 2: 1, 3: 3/4 -> 0.67, 4: 1 -> 0.67
    assert best_path(candidates, 8) == [1, 2, 3, 4]
    assert best_path(candidates, 2) == [1, 2]
    assert best_path(candidates, 8, min_share=0.7) == [1, 2]
    assert best_path([([1, 2], 1.0), ([3, 4], 1.0), ([5], 1.0)], 8) == [1, 2]  # 1/3 >= 0.3
    assert best_path([([1, 2], 1.0), ([3, 4], 1.0), ([5], 1.0), ([6], 1.0)], 8) == []  # 1/4 < 0.3
    assert best_path([], 4) == []


def test_best_tree_adds_likely_side_branches_after_the_heaviest_path():
    # 1 takes 4 / 5.5 of the weight, then 2 and 5 half of that each (0.36); 4 takes 0.27 < 0.3
    candidates = [([1, 2, 3], 2.0), ([1, 5, 6], 2.0), ([4, 7], 1.5)]
    assert best_tree(candidates, 8, 1) == ([1, 2, 3], [-1, 0, 1])  # width 1: best_path's chain
    assert best_tree(candidates, 8, 2) == ([1, 2, 3, 5, 6], [-1, 0, 1, 0, 3])
    assert best_tree(candidates, 4, 2) == ([1, 2, 3, 5], [-1, 0, 1, 0])  # the node budget
    assert best_tree(candidates, 8, 2, min_share=0.25) == ([1, 2, 3, 5, 6, 4, 7], [-1, 0, 1, 0, 3, -1, 5])
    # width counts a node's children: 3 of the root's four (a quarter each) at min_share 0.2
    four = [([t], 1.0) for t in (9, 8, 7, 6)]
    assert best_tree(four, 8, 3, min_share=0.2) == ([9, 8, 7], [-1, -1, -1])


def _request(tokens, salt=None):
    return Request("r", list(tokens), SamplingParams(max_tokens=32, temperature=0.0), len(tokens) + 32, cache_salt=salt)


def test_drafter_drafts_another_requests_reply_in_the_same_namespace_only():
    earlier = [1, 2, 3, 4, 5, 6, 7, 8, 60, 61, 62, 63, 64, 65, 66, 67]
    _, cache = cache_with([(earlier, "key:a")])
    drafter = SuffixDrafter(8, 2, 4, default_on=True, cache=cache)
    assert drafter.propose(_request([1, 2, 3, 4, 5, 6, 7, 8], "key:a"), 8) == [60, 61, 62, 63]  # first length 4
    assert drafter.stats.tree_drafts == 1
    drafter.forget("r")
    # another namespace sees nothing of it; prompt lookup over the request's own tokens is all it has
    assert drafter.propose(_request([1, 2, 3, 4, 5, 6, 7, 8], "key:b"), 8) == []
    assert drafter.propose(_request([5, 6, 7, 1, 2, 5, 6, 7], "key:b"), 8) == [1, 2, 5, 6]
    assert drafter.stats.tree_drafts == 1
    drafter.forget("r")
    assert not drafter._indexes and not drafter._states
