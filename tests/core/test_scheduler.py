"""Scheduler on plain requests (no model): exact chunks, block ids, preemption and sharing."""

from __future__ import annotations

from radixserve.core.request import RequestStatus
from scheduler_helpers import add, chunks, make_scheduler, step

def test_chunked_prefill_under_the_token_budget_with_exact_blocks():
    s = make_scheduler(max_num_batched_tokens=10, chunked_prefill_size=7, cache=False)
    a, b = add(s, range(20)), add(s, range(100, 105))
    plan = step(s)
    assert chunks(plan) == [(a.request_id, 0, 7), (b.request_id, 0, 3)]
    assert a.block_table == [0, 1] and b.block_table == [2]
    plan = step(s)
    assert chunks(plan) == [(a.request_id, 7, 7), (b.request_id, 3, 2)]
    assert b.num_output_tokens == 1  # b's prompt is done: it sampled
    plan = step(s)
    # b decodes first (1 token), then a's next chunk takes the rest of the budget.
    assert chunks(plan) == [(b.request_id, 5, 1), (a.request_id, 14, 6)]
    assert b.block_table == [2, 5]  # b's decode reached its second block first
    assert a.block_table == [0, 1, 3, 4, 6]


def test_max_num_seqs_caps_admission():
    s = make_scheduler(max_num_seqs=2, cache=False)
    reqs = [add(s, range(i * 10, i * 10 + 3)) for i in range(3)]
    plan = step(s)
    assert [c.request for c in plan.chunks] == reqs[:2]
    assert reqs[2].status is RequestStatus.WAITING


def test_admission_waits_until_the_whole_sequence_fits():
    s = make_scheduler(num_blocks=6, cache=False)
    big = add(s, range(15), max_tokens=4)  # needs ceil(16/4) = 4 blocks to admit
    other = add(s, range(100, 111), max_tokens=1)  # needs 3 blocks
    plan = step(s)
    assert [c.request for c in plan.chunks] == [big]
    assert other.status is RequestStatus.WAITING and s.kv.pool.num_free == 2
    while big.status is not RequestStatus.FINISHED:
        step(s)
    plan = step(s)
    assert [c.request for c in plan.chunks] == [other]


def test_preemption_releases_the_newest_and_it_resumes_from_the_cache():
    s = make_scheduler(num_blocks=5, max_num_batched_tokens=64, chunked_prefill_size=64)
    a = add(s, range(7), max_tokens=6)  # 7 + 1 tokens -> 2 blocks at admission
    b = add(s, range(100, 107), max_tokens=6)
    step(s)  # both prefilled, each holds 2 blocks
    assert s.kv.pool.num_free == 1
    step(s)  # both decode into their second block (positions 7)
    plan = step(s)  # position 8 needs a third block each: a takes the last, b (newest) is preempted
    assert plan.preempted == [b] and b.status is RequestStatus.WAITING
    assert s.waiting[0] is b and s.stats.preemptions == 1
    assert b.num_computed_tokens == 0 and b.block_table == []
    # b's computed full blocks went to the cache: 8 computed tokens = 2 blocks.
    assert s.kv.cache.peek_prefix(b.token_ids)[0] == 8
    while a.status is not RequestStatus.FINISHED:
        step(s)
    plan = step(s)
    assert [c.request for c in plan.chunks] == [b]
    resumed = plan.chunks[0]
    assert resumed.start == 8  # its whole computed history came back from the cache
    assert b.num_preemptions == 1


def test_in_batch_sharing_computes_a_new_shared_prefix_once():
    s = make_scheduler(max_num_batched_tokens=256, chunked_prefill_size=256)
    prefix = list(range(16))
    reqs = [add(s, prefix + [100 + i, 200 + i]) for i in range(3)]
    plan = step(s)
    assert [c.request for c in plan.chunks] == [reqs[0]]
    assert s.stats.deferred_for_sharing == 2
    plan = step(s)
    assert [(c.request, c.start, c.num_tokens) for c in plan.chunks[1:]] == [(reqs[1], 16, 2), (reqs[2], 16, 2)]
    assert [r.cached_tokens for r in reqs] == [0, 16, 16]
    assert s.stats.cached_prompt_tokens == 32


def test_prefix_cache_off_shares_nothing():
    s = make_scheduler(cache=False)
    prefix = list(range(16))
    reqs = [add(s, prefix + [100 + i]) for i in range(2)]
    plan = step(s)
    assert [c.request for c in plan.chunks] == reqs
    assert s.stats.cached_prompt_tokens == 0


def test_last_prompt_token_is_always_computed_even_when_all_is_cached():
    s = make_scheduler()
    first = add(s, range(8), max_tokens=1)
    while first.status is not RequestStatus.FINISHED:
        step(s)
    again = add(s, range(8), max_tokens=1)
    plan = step(s)
    assert chunks(plan) == [(again.request_id, 4, 4)]  # block-aligned: the last block recomputed
    assert again.cached_tokens == 4


def test_chunked_prefill_publishes_completed_chunks_for_others():
    s = make_scheduler(max_num_batched_tokens=16, chunked_prefill_size=8)
    long = add(s, range(40), max_tokens=1)
    step(s)  # 8 tokens computed and inserted
    assert s.kv.cache.num_cached_blocks == 2
    twin = add(s, list(range(40)), max_tokens=1)
    steps = 0
    while twin.status is RequestStatus.WAITING:
        step(s)  # long's next chunk; twin waits while its next block is in flight
        steps += 1
    assert steps == 5 and long.finished  # 4 more chunks of long, then twin's turn
    assert twin.cached_tokens == 36  # all but the block holding its last token


def test_lpm_orders_by_cached_prefix_and_starvation_guard_wins():
    s = make_scheduler(schedule_policy="lpm", max_num_seqs=1, starvation_steps=3)
    warm = add(s, range(12), max_tokens=1)
    while warm.status is not RequestStatus.FINISHED:
        step(s)
    miss = add(s, range(500, 512), max_tokens=1)
    hits = [add(s, list(range(12)) + [900 + i], max_tokens=1) for i in range(4)]
    admitted = []
    while s.has_unfinished():
        plan = step(s)
        admitted += [c.request for c in plan.chunks]
    # Hits first (12 cached tokens each); the miss, passed over 3 times, then goes first.
    assert admitted == hits[:3] + [miss, hits[3]]
    assert [h.cached_tokens for h in hits] == [12, 12, 12, 12]


def test_dfs_weight_groups_requests_under_shared_prefixes():
    s = make_scheduler(schedule_policy="dfs-weight")
    a = add(s, list(range(8)), max_tokens=1)
    b = add(s, list(range(50, 58)), max_tokens=1)
    while s.has_unfinished():
        step(s)
    queue = [
        add(s, list(range(50, 58)) + [1]),
        add(s, list(range(8)) + [2]),
        add(s, list(range(8)) + [3]),
        add(s, list(range(300, 310))),
        add(s, list(range(50, 58)) + [4]),
        add(s, list(range(8)) + [5]),
    ]
    ordered = s.policy.order(s.waiting)
    heavy = [queue[1], queue[2], queue[5]]  # three share range(8)
    assert ordered[:3] == heavy
    assert ordered[3:5] == [queue[0], queue[4]]
    assert ordered[5] is queue[3]  # the miss comes last
    assert a.finished and b.finished


def test_abort_of_running_and_waiting_frees_everything():
    s = make_scheduler(max_num_seqs=1)
    r1, r2 = add(s, range(10)), add(s, range(30, 40))
    step(s)
    s.finish(r1, "abort")
    s.finish(r2, "abort")
    s.check_integrity()
    assert not s.has_unfinished()
    assert s.kv.pool.num_free + s.kv.cache.num_evictable_blocks == s.kv.pool.num_blocks


def test_growing_from_free_blocks_takes_exactly_what_is_missing():
    """grow_from_free never evicts and keeps keep_free blocks free, but room a request's own
    blocks already have is granted whatever is free (nothing taken)."""
    s = make_scheduler(num_blocks=6, cache=False)
    r = add(s, range(6), max_tokens=4)  # 10 tokens: 3 blocks of 4, its first step takes 2
    step(s)
    held, free = list(r.block_table), s.kv.pool.num_free
    assert s.kv.grow_from_free(r, len(held) * 4, keep_free=free + 1)  # fits its blocks: granted
    assert r.block_table == held and s.kv.pool.num_free == free
    assert not s.kv.grow_from_free(r, len(held) * 4 + 1, keep_free=free)  # one more block would break keep_free
    assert r.block_table == held
    assert s.kv.grow_from_free(r, len(held) * 4 + 1, keep_free=free - 1)
    assert len(r.block_table) == len(held) + 1 and s.kv.pool.num_free == free - 1
    s.check_integrity()
