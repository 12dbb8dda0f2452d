"""Agent hints on the scheduling side (no model): exact admission order by priority, TTL
holds past the LRU horizon (exact cached tokens), expiry and refresh, release, osl in
admission, validation of the hints themselves."""

from __future__ import annotations

import itertools

import pytest

from radixserve.config import EngineConfig
from radixserve.core.agent_hints import AgentHints
from radixserve.core.block_pool import BlockPool
from radixserve.core.radix_cache import RadixCache
from radixserve.core.request import Request, RequestStatus
from radixserve.core.scheduler import Scheduler
from radixserve.core.sessions import SessionTable
from radixserve.sampling_params import SamplingParams
from scheduler_helpers import step

_ids = itertools.count()


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make(num_blocks=32, clock=None, **options):
    config = EngineConfig(**{"block_size": 4, "starvation_steps": 1000, **options})
    pool = BlockPool(num_blocks)
    cache = RadixCache(pool, config.block_size)
    sessions = SessionTable(cache, 600, clock=clock or Clock(), max_hold_s=config.hint_max_ttl_s)
    return Scheduler(config, pool, cache, sessions=sessions)


def add(s, tokens, max_tokens=1, arrival=None, **hints):
    tokens = list(tokens)
    r = Request(f"h{next(_ids)}", tokens, SamplingParams(max_tokens=max_tokens), len(tokens) + max_tokens)
    r.hints = AgentHints(**hints)
    if arrival is not None:
        r.arrival_time = arrival
    s.add(r)
    return r


def run(s):
    order = []
    while s.has_unfinished():
        plan = step(s)
        order += [c.request.request_id for c in plan.chunks if c.start == 0]
    return order


@pytest.mark.parametrize("policy", ["fcfs", "lpm", "dfs-weight"])
def test_priority_orders_admission_exactly(policy):
    s = make(max_num_seqs=1, schedule_policy=policy)
    reqs = [add(s, range(100 * i, 100 * i + 6), priority=p) for i, p in enumerate([0, 5, -3, 5, 1])]
    a, b, c, d, e = (r.request_id for r in reqs)
    assert run(s) == [b, d, e, a, c]  # higher first; arrival order within a priority


def test_latency_sensitivity_moves_arrival_earlier_within_a_priority():
    s = make(max_num_seqs=1, schedule_policy="fcfs")
    a = add(s, range(6), arrival=10.0)
    b = add(s, range(10, 16), arrival=12.0, latency_sensitivity_s=5.0)  # as if it arrived at 7.0
    c = add(s, range(20, 26), arrival=11.0, priority=1)
    assert run(s) == [c.request_id, b.request_id, a.request_id]


def test_starving_requests_still_go_first():
    s = make(max_num_seqs=1, starvation_steps=2)
    low = add(s, range(6), priority=-5, max_tokens=1)
    highs = [add(s, range(10 * i + 10, 10 * i + 16), priority=5, max_tokens=3) for i in range(3)]
    order = run(s)
    assert order.index(low.request_id) < order.index(highs[-1].request_id)


AGENT = list(range(200, 216))  # 16 tokens: 4 blocks


def _flood(s, n=4):
    for i in range(n):
        add(s, range(1000 + 100 * i, 1000 + 100 * i + 16))
        run(s)


def _next_turn_cached(s):
    r = add(s, AGENT + [7, 300, 301, 302, 303])
    run(s)
    return r.cached_tokens


@pytest.mark.parametrize("ttl_s, cached", [(None, 0), (30.0, 16)])
def test_ttl_keeps_a_prefix_past_the_lru_horizon(ttl_s, cached):
    s = make(num_blocks=12)
    add(s, AGENT, ttl_s=ttl_s)
    run(s)
    _flood(s)  # 4 x 4 blocks through a 12-block pool: LRU alone evicts the agent's prefix
    assert _next_turn_cached(s) == cached
    assert s.kv.cache.evicted_blocks > 0


def test_a_hold_expires_and_a_hit_refreshes_it():
    clock = Clock()
    s = make(num_blocks=12, clock=clock)
    add(s, AGENT, ttl_s=10.0)
    run(s)
    holds = s.kv.sessions.holds
    assert len(holds) == 1 and holds.held_blocks() == 4
    clock.now = 8.0
    add(s, AGENT + [1, 2, 3, 4], max_tokens=1)  # a hit on the held prefix: its 10 s start again
    run(s)
    clock.now = 15.0
    s.schedule()  # each step expires what is due
    assert len(holds) >= 1 and holds.expired == 0
    clock.now = 40.0
    s.schedule()
    assert len(holds) == 0 and holds.expired >= 1
    _flood(s)
    assert _next_turn_cached(s) == 0
    s.check_integrity()


def test_ttl_is_capped_by_the_server_max():
    clock = Clock()
    s = make(num_blocks=12, clock=clock, hint_max_ttl_s=5)
    add(s, AGENT, ttl_s=1000.0)
    run(s)
    clock.now = 6.0
    s.schedule()
    assert len(s.kv.sessions.holds) == 0


def test_release_drops_the_holds_of_a_prefix():
    s = make(num_blocks=12)
    add(s, AGENT, ttl_s=30.0)
    run(s)
    add(s, AGENT + [5, 6, 7, 8], release=True)  # the agent's last turn: let go
    run(s)
    assert len(s.kv.sessions.holds) == 0 and s.kv.sessions.holds.released == 1
    s.check_integrity()


def test_positive_priority_holds_and_negative_priority_leaves_first():
    s = make(num_blocks=12, hint_priority_ttl_s=30)
    add(s, AGENT, priority=3)
    run(s)
    assert len(s.kv.sessions.holds) == 1
    low = add(s, range(500, 516), priority=-1)
    run(s)
    assert low.cache_node is None
    _, leaf = s.kv.cache.peek_prefix(list(range(500, 516)))
    assert leaf.demoted and leaf.rank == 0  # first to leave


def test_osl_reserves_the_expected_output_at_admission():
    s = make(num_blocks=8)
    long = add(s, range(8), max_tokens=16, osl=16)  # expects ceil(24 / 4) = 6 blocks
    step(s)
    assert long.status is RequestStatus.RUNNING and len(long.block_table) == 2
    other = add(s, range(50, 58), max_tokens=1)  # 3 blocks: 6 are free, but 4 are long's expected growth
    step(s)
    assert other.status is RequestStatus.WAITING
    s2 = make(num_blocks=8)
    plain = add(s2, range(8), max_tokens=16)
    step(s2)
    other2 = add(s2, range(50, 58), max_tokens=1)
    step(s2)
    assert plain.status is RequestStatus.RUNNING and other2.status is not RequestStatus.WAITING


@pytest.mark.parametrize("bad", [
    {"priority": 1001}, {"priority": 1.5}, {"priority": True}, {"osl": -1}, {"ttl_s": 0}, {"ttl_s": float("inf")},
    {"latency_sensitivity_s": -1.0}, {"release": True, "ttl_s": 5.0},
])
def test_bad_hints_are_refused(bad):
    with pytest.raises(ValueError):
        AgentHints(**bad)


def test_kinds_name_what_a_request_gave():
    assert AgentHints(priority=2, ttl_s=5.0, speculative_prefill=True).kinds() == ["priority", "ttl",
                                                                                  "speculative_prefill"]
    assert AgentHints().kinds() == []
