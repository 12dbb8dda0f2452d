"""RecurrentSnapshots (core/recurrent_snapshots.py): which tree nodes keep a recurrent-state
snapshot, where a match is cut, the budget, tenants, and no leaks, on the scheduler with no
model. The runner's side is played by `TokenStates`: a request's "state" is the tuple of
tokens it consumed, so a restored snapshot must be exactly the prefix the request resumes
after, and every chunk must start where its request's state stands."""

from __future__ import annotations

import itertools

import pytest

from radixserve.config import EngineConfig
from radixserve.core.block_pool import BlockPool
from radixserve.core.kv_events import POOL, RECURRENT, BlockRemoved, BlockStored, KVEventLog
from radixserve.core.radix_cache import RadixCache
from radixserve.core.recurrent_snapshots import DROP, RESTORE, SAVE, TIER_RESTORE, TO_TIER, RecurrentSnapshots
from radixserve.core.request import Request, RequestStatus
from radixserve.core.scheduler import Scheduler
from radixserve.kv_tier.index import KVTier
from radixserve.sampling_params import SamplingParams

BS = 4
_ids = itertools.count()


class TokenStates:
    """The runner's RecurrentStatePool in plain Python: a state is the tokens consumed."""

    def __init__(self):
        self.states: dict[str, tuple[int, ...]] = {}
        self.snapshots: dict[int, tuple[int, ...]] = {}
        self.tier: dict[int, tuple[int, ...]] = {}  # the second tier's state slots

    def apply(self, ops):
        for op in ops:
            if op.kind == TO_TIER:
                assert len(self.snapshots[op.snapshot]) == op.position
                self.tier[op.slot] = self.snapshots[op.snapshot]
            elif op.kind == TIER_RESTORE:
                self.states[op.request.request_id] = self.tier[op.slot]
                assert len(self.tier[op.slot]) == op.position
            elif op.kind == SAVE:
                state = self.states[op.request.request_id]
                assert len(state) == op.position, (op, len(state))
                self.snapshots[op.snapshot] = state
            elif op.kind == RESTORE:
                self.states[op.request.request_id] = self.snapshots[op.snapshot]
                assert len(self.snapshots[op.snapshot]) == op.position
            else:
                assert op.kind == DROP
                self.snapshots.pop(op.snapshot, None)

    def run(self, chunk):
        request = chunk.request
        state = () if chunk.start == 0 else self.states[request.request_id]
        assert state == tuple(request.token_ids[: chunk.start]), f"{request} resumes from another prefix"
        self.states[request.request_id] = tuple(request.token_ids[: chunk.start + chunk.num_tokens])


def make(num_blocks=64, snapshots=8, chunk=8, tier=None, events=None):
    config = EngineConfig(block_size=BS, chunked_prefill_size=chunk, max_num_batched_tokens=max(32, chunk))
    pool = BlockPool(num_blocks, snapshots=snapshots)
    s = Scheduler(config, pool, RadixCache(pool, BS, tier, events=events))
    return s, s.kv.components[0], TokenStates()


def add(s, tokens, max_tokens=4, salt=None):
    r = Request(f"r{next(_ids)}", list(tokens), SamplingParams(max_tokens=max_tokens), len(tokens) + max_tokens, salt)
    s.add(r)
    return r


def step(s, states, token=7):
    plan = s.schedule()
    ops = s.kv.take_snapshot_ops()
    states.apply(ops)
    for c in plan.chunks:
        states.run(c)
    s.commit(plan)
    for c in plan.chunks:
        if c.samples:
            c.request.token_ids.append(token + c.request.num_tokens)
            if c.request.num_tokens >= c.request.max_total_tokens:
                s.finish(c.request, "length")
    s.check_integrity()
    return plan, ops


def run(s, states, *requests):
    """Steps until the requests finish; the last entry's ops are those queued at their finish
    (applied before whatever step comes next)."""
    log = []
    while any(r.status is not RequestStatus.FINISHED for r in requests):
        log.append(step(s, states))
    ops = s.kv.take_snapshot_ops()
    states.apply(ops)
    log.append((None, ops))
    return log


def kept(snaps):
    """The token positions where the tree keeps a snapshot, sorted."""
    out = []
    for node in snaps._node.values():
        end, n = 0, node
        while not n.is_root:
            end += len(n.tokens)
            n = n.parent
        out.append(end)
    return sorted(out)


def test_a_prompt_keeps_its_chunk_boundaries_its_end_and_its_replys_end():
    s, snaps, states = make()
    assert isinstance(snaps, RecurrentSnapshots)
    a = add(s, range(100, 121), max_tokens=8)  # 21 tokens: last whole block before the last token ends at 20
    log = run(s, states, a)
    starts = [[(c.start, c.num_tokens) for c in plan.chunks] for plan, _ in log[:-1]]
    assert starts[:3] == [[(0, 8)], [(8, 8)], [(16, 4)]]  # chunks stop at 8 (interval) and 16, then 20
    assert starts[3] == [(20, 1)]  # the prompt's last token samples
    saves = [(op.position, op.snapshot) for _, ops in log for op in ops if op.kind == SAVE]
    assert saves[:3] == [(8, 0), (16, 1), (20, 2)]
    assert [p for p, snap in saves[3:]] == [24, 28]  # one rolling snapshot while it decodes (28 = 21 + 8 - 1)
    assert len({snap for _, snap in saves[3:]}) == 1
    assert kept(snaps) == [8, 16, 20, 28]
    s.kv.check_integrity([], [])


def test_a_match_is_cut_to_the_deepest_kept_state_and_starts_from_it():
    s, snaps, states = make()
    prompt = list(range(100, 121))
    first = add(s, prompt, max_tokens=8)
    run(s, states, first)
    again = add(s, prompt)  # a retry: its match (20 tokens) ends where the prompt's state is kept
    log = run(s, states, again)
    assert again.cached_tokens == 20
    assert [(op.kind, op.position) for op in log[0][1]] == [(RESTORE, 20)]
    turn = add(s, first.token_ids + [1, 2, 3, 4, 5])  # the next turn: prompt + reply + new
    log = run(s, states, turn)
    assert turn.cached_tokens == 28  # the reply's end
    branch = add(s, prompt[:14] + [9] * 10)  # leaves the prompt inside its 4th block: the tree matches 12
    log = run(s, states, branch)
    assert branch.cached_tokens == 8  # cut back to the chunk boundary's state
    # stops at the branch point (12), the chunk boundary (16), the last whole block's end (20)
    assert [(c.start, c.num_tokens) for plan, _ in log[:-1] for c in plan.chunks][:4] == [(8, 4), (12, 4), (16, 4),
                                                                                          (20, 4)]
    assert 12 in kept(snaps)
    third = add(s, prompt[:14] + [8] * 10)
    run(s, states, third)
    assert third.cached_tokens == 12  # the branch point's state: the next one resumes there
    assert snaps.restored == 4
    s.kv.check_integrity([], [])


def test_tenants_never_resume_from_each_others_states():
    s, snaps, states = make()
    prompt = list(range(100, 121))
    run(s, states, add(s, prompt, salt="tenant-a"))
    b = add(s, prompt, salt="tenant-b")
    run(s, states, b)
    assert b.cached_tokens == 0
    a = add(s, prompt, salt="tenant-a")
    run(s, states, a)
    assert a.cached_tokens == 20
    assert all(node.salt in ("tenant-a", "tenant-b") for node in snaps._node.values())


def test_a_full_budget_gives_the_least_valuable_state_room_even_on_a_path_in_use():
    s, snaps, states = make(snapshots=3, chunk=32)
    run(s, states, add(s, range(100, 113), max_tokens=1))  # keeps 12
    run(s, states, add(s, range(200, 233), max_tokens=1))  # keeps 32: 32 tokens saved, the more valuable
    run(s, states, add(s, range(300, 309), max_tokens=1))  # keeps 8
    assert kept(snaps) == [8, 12, 32]
    run(s, states, add(s, range(400, 417), max_tokens=1))  # 16: the 12 goes (tokens saved / ticks since used:
    assert kept(snaps) == [8, 16, 32] and snaps.evicted_snapshots == 1  # 12 of the oldest, below 8 of the newest)
    resumed = add(s, list(range(200, 232)) + [1] * 9, max_tokens=20)  # runs from the 32 state, locking its path
    log = run(s, states, resumed)
    assert resumed.cached_tokens == 32 and snaps.refused == 0
    assert [(op.kind, op.position) for op in log[0][1]] == [(RESTORE, 32)]  # queued at adoption, before any drop
    assert kept(snaps) == [32, 40, 60]  # its prompt's end and its reply's took the others' room
    assert snaps.evicted_snapshots == 3
    s.kv.check_integrity([], [])


def test_a_state_in_use_gives_its_room_once_its_request_resumed_from_it():
    """Running requests lock their paths; the state a request resumed from may still make room
    (its RESTORE is queued first, so it reads the state before a DROP and SAVE reuse the id)."""
    s, snaps, states = make(snapshots=1, chunk=32)
    first = add(s, range(100, 113), max_tokens=1)
    run(s, states, first)
    assert kept(snaps) == [12]
    resumed = add(s, list(range(100, 112)) + [1] * 9, max_tokens=6)
    log = run(s, states, resumed)
    ops = [(op.kind, op.snapshot, op.position) for _, step_ops in log for op in step_ops]
    assert ops[:3] == [(RESTORE, 0, 12), (DROP, 0, 0), (SAVE, 0, 20)]  # its prompt's end takes the room
    assert resumed.cached_tokens == 12 and snaps.refused == 0
    assert kept(snaps) == [24]  # then its reply's end (the last block boundary it computed)
    reply = resumed.token_ids[21:]
    turn = add(s, list(range(100, 112)) + [1] * 9 + reply + [5, 5], max_tokens=1)
    run(s, states, turn)
    assert turn.cached_tokens == 24  # the next turn resumes there
    s.kv.check_integrity([], [])


@pytest.mark.parametrize("agents, room", [(2, 6), (3, 9)])
def test_agents_resume_every_turn_from_their_last_prompts_end(agents, room):
    """Agents on a shared 200-token prefix, 6 turns, all agents of a turn at once; a reply comes
    back as other ids (re-rendered), so each turn resumes from the end of the agent's last prompt.
    Room for 3 states an agent: while they run, their paths are locked; the states above the one
    an agent resumed from are passed and give their room first."""
    s, snaps, states = make(num_blocks=1024, snapshots=room, chunk=128)
    ids = itertools.count(1000)
    histories = [list(range(100, 300)) + [next(ids) for _ in range(10)] for _ in range(agents)]
    for turn in range(6):
        requests = [add(s, h, max_tokens=8) for h in histories]
        run(s, states, *requests)
        if turn:
            assert [r.cached_tokens for r in requests] == ideal, f"turn {turn + 1}"
        ideal = [(len(h) - 1) // BS * BS for h in histories]  # the last block boundary before each prompt's end
        for h in histories:
            h += [next(ids) for _ in range(8 + 16)]
    assert snaps.evicted_snapshots > 0
    s.kv.check_integrity([], [])


def test_preemption_keeps_the_states_reached_and_the_request_resumes_from_them():
    s, snaps, states = make(num_blocks=12, snapshots=8, chunk=8)
    a = add(s, range(100, 121), max_tokens=12)
    b = add(s, range(200, 221), max_tokens=12)
    run(s, states, a, b)
    assert s.stats.preemptions > 0
    assert s.stats.cached_prompt_tokens == 0 and snaps.restored > 0  # a preempted one resumed from a kept state
    s.kv.check_integrity([], [])


def test_eviction_and_flush_leave_no_snapshot_held():
    s, snaps, states = make()
    for base in (100, 200, 300):
        run(s, states, add(s, range(base, base + 21), max_tokens=4))
    assert kept(snaps) == [8, 8, 16, 16, 16, 20, 24, 24] and snaps.evicted_snapshots == 4  # 12 taken, room for 8
    assert snaps.num_kept == snaps.num_used == 8
    assert s.kv.cache.evict(4) == 4  # the least recently used path's last 4 blocks leave the pool
    assert kept(snaps) == [8, 8, 16, 16, 20, 24, 24]  # ... and the state kept at 16 with them
    s.kv.check_integrity([], [])
    s.flush_cache()
    assert snaps.num_used == snaps.num_kept == 0
    s.kv.check_integrity([], [])
    ops = s.kv.take_snapshot_ops()
    states.apply(ops)
    assert states.snapshots == {}


def test_a_node_moved_to_the_second_tier_keeps_its_state_and_a_match_resumes_there_after_restoring():
    s, snaps, states = make(tier=KVTier(64))
    prompt = list(range(100, 121))
    run(s, states, add(s, prompt, max_tokens=4))
    assert kept(snaps) == [8, 16, 20, 24]
    assert s.kv.cache.evict(6) == 6  # every block of the path moves to the tier
    s.kv.take_copies()
    assert s.kv.cache.num_cached_blocks == 0 and kept(snaps) == [8, 16, 20, 24]
    s.kv.check_integrity([], [])
    again = add(s, prompt)
    run(s, states, again)
    assert again.cached_tokens == 20 and again.restored_tokens == 20  # blocks from the tier, the state kept
    s.flush_cache()
    assert snaps.num_used == 0
    s.kv.check_integrity([], [])


def test_aborts_mid_prompt_and_mid_reply_leave_their_saved_states_in_the_tree_and_hold_none():
    s, snaps, states = make()
    a = add(s, range(100, 121), max_tokens=12)
    b = add(s, range(200, 221), max_tokens=12)
    step(s, states)  # a: 0..8, b waits (the budget: 32 tokens, chunks of 8 stop at 8)
    step(s, states)
    s.finish(a, "abort")  # mid-prompt: what it saved (8) stays, nothing is held
    s.check_integrity()
    while b.num_output_tokens < 6:
        step(s, states)
    s.finish(b, "abort")  # mid-reply: its reply so far is kept at its last boundary (21 + 6 - 1 -> 24)
    s.check_integrity()
    assert not snaps._held and 24 in kept(snaps) and 8 in kept(snaps)
    states.apply(s.kv.take_snapshot_ops())
    resumed = add(s, list(range(200, 221)) + [7 + n for n in range(21, 27)] + [1, 2])
    run(s, states, resumed)
    assert resumed.cached_tokens == 24
    s.flush_cache()
    assert snaps.num_used == 0
    s.kv.check_integrity([], [])


def test_kept_states_are_kv_events_of_their_own_group_named_by_their_nodes_last_block():
    from radixserve.engine.kv_events import WireFormat

    s, snaps, states = make(events=KVEventLog())
    run(s, states, add(s, range(100, 121), max_tokens=4))
    events = s.kv.take_events()
    stored = [e for e in events if isinstance(e, BlockStored) and e.group == RECURRENT]
    assert [e.token_ids for e in stored] == [list(range(104, 108)), list(range(112, 116)), list(range(116, 120)),
                                             [120, 28, 29, 30]]  # the last block before 8, 16, 20, 24
    full = {h for e in events if isinstance(e, BlockStored) and e.group != RECURRENT for h in e.block_hashes}
    assert all(e.medium == POOL and len(e.block_hashes) == 1 and e.block_hashes[0] in full for e in stored)
    s.flush_cache()
    removed = [e for e in s.kv.take_events() if isinstance(e, BlockRemoved) and e.group == RECURRENT]
    assert sorted(h for e in removed for h in e.block_hashes) == sorted(e.block_hashes[0] for e in stored)
    wire = WireFormat("map").stored([1], None, [1, 2, 3, 4], BS, "GPU", RECURRENT, None, None)
    assert (wire.group_idx, wire.kv_cache_spec_kind) == (RECURRENT, "mamba")


def test_the_integrity_check_catches_a_leaked_or_doubly_kept_snapshot():
    s, snaps, states = make()
    run(s, states, add(s, range(100, 121)))
    snaps._free.pop()  # an id that is neither free nor kept nor held
    with pytest.raises(AssertionError, match="not each of"):
        s.kv.check_integrity([], [])


def test_states_of_nodes_moved_to_the_tier_go_to_its_state_slots_and_free_their_rows():
    s, snaps, states = make(tier=KVTier(64))
    snaps.use_tier(KVTier(2))
    a, b = list(range(100, 121)), list(range(200, 221))
    for prompt in (a, b):
        run(s, states, add(s, prompt, max_tokens=4))
    assert kept(snaps) == [8, 8, 16, 16, 20, 20, 24, 24]
    assert s.kv.cache.evict(6) == 6  # a's path moves to the tier: two of its states go with it
    states.apply(s.kv.take_snapshot_ops())
    assert snaps.num_in_tier == 2 and kept(snaps) == [8, 16, 20, 24]  # rows: b's four, none of a's
    # the two worth most (8 and 16 spare 8 tokens each, 20 and 24 four): its leaves went first, then gave way
    assert in_tier(snaps) == [8, 16] and sorted(len(states.tier[s]) for s in snaps._tier_node) == [8, 16]
    s.kv.check_integrity([], [])
    assert s.kv.cache.evict(6) == 6  # then b's: its states worth more take the tier's two slots
    states.apply(s.kv.take_snapshot_ops())
    assert in_tier(snaps) == [8, 16] and kept(snaps) == []  # b's (as recent as a's were and worth as much)
    s.kv.check_integrity([], [])
    cached = []
    for prompt in (a, b):
        again = add(s, prompt + [1, 2, 3])
        run(s, states, again)  # from the deepest state kept: b's in the tier, none of a's
        cached.append((again.cached_tokens, again.restored_tokens))
    assert cached == [(0, 0), (16, 16)] and snaps.tier_restores == 1
    s.flush_cache()
    assert snaps.num_used == snaps.num_in_tier == 0 and snaps.tier.num_free == 2
    s.kv.check_integrity([], [])


def in_tier(snaps):
    return sorted(_path_len(node) for node in snaps._tier_node.values())


def _path_len(node):
    n = 0
    while not node.is_root:
        n += len(node.tokens)
        node = node.parent
    return n
