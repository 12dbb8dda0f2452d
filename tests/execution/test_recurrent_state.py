"""RecurrentStatePool (execution/recurrent_state.py) with ShortConv (model/short_conv.py): a
sequence split into chunks, singles and segments gives the one-pass output and state; a
drafted segment settles to the state after its accepted rows; slots are taken and freed by
request; a chunk that starts where no state is kept is refused; the cache's snapshot operations
apply in order, and one that disagrees with where a state stands is refused."""

from __future__ import annotations

import pytest
import torch

from radixserve.core.plan import ScheduledChunk
from radixserve.core.recurrent_snapshots import DROP, RESTORE, SAVE, TIER_RESTORE, SnapshotOp
from radixserve.core.request import Request, RequestStatus
from radixserve.execution.recurrent_state import RecurrentStatePool
from radixserve.model.short_conv import ShortConv
from radixserve.sampling_params import SamplingParams

C, WIDTH = 8, 4


def conv_layer(seed=0):
    torch.manual_seed(seed)
    conv = ShortConv(C, WIDTH, bias=True, layer_index=3)
    for p in conv.parameters():
        p.data.normal_(0, 0.5)
    return conv


def request(rid, n=40):
    r = Request(rid, list(range(n)), SamplingParams(max_tokens=4), 64)
    r.status = RequestStatus.RUNNING
    return r


def reference(conv, inputs):
    """The convolution of a whole sequence at once from zeros, as transformers runs it."""
    padded = torch.nn.functional.pad(inputs.t(), (WIDTH - 1, 0))
    return torch.nn.functional.conv1d(padded[None], conv.conv.weight, conv.conv.bias, groups=C)[0].t()


def run(pool, conv, chunks, inputs_by_chunk):
    starts, rows = [], 0
    for c in chunks:
        starts.append(rows)
        rows += c.num_tokens
    step = pool.begin_step(chunks, starts)
    return step, conv.convolve(torch.cat(inputs_by_chunk), step)


def test_chunks_singles_and_segments_give_the_one_pass_output_and_state():
    conv = conv_layer()
    pool = RecurrentStatePool({3: conv.state_shapes()}, torch.float32, torch.device("cpu"))
    a, b = request("a"), request("b")
    xa, xb = torch.randn(10, C), torch.randn(7, C)
    out_a, out_b = [], []
    # a: 3 rows, then 1 (a single beside b's segment), then 6; b: 1 row, then 6
    for (na, sa), (nb, sb) in [((3, 0), (1, 0)), ((1, 3), (6, 1)), ((6, 4), (0, 7))]:
        chunks = [ScheduledChunk(a, sa, na)] + ([ScheduledChunk(b, sb, nb)] if nb else [])
        parts = [xa[sa:sa + na]] + ([xb[sb:sb + nb]] if nb else [])
        _, out = run(pool, conv, chunks, parts)
        out_a.append(out[:na])
        out_b.append(out[na:])
    torch.testing.assert_close(torch.cat(out_a), reference(conv, xa), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.cat(out_b), reference(conv, xb), rtol=1e-5, atol=1e-6)
    (state,) = pool.states[3]
    torch.testing.assert_close(state[pool.holders["a"].slot], xa[-(WIDTH - 1):].t())
    assert pool.holders["a"].position == 10 and pool.holders["b"].position == 7


@pytest.mark.parametrize("kept", [1, 3, 5])
def test_a_drafted_segment_settles_to_the_state_after_its_accepted_rows(kept):
    conv = conv_layer(1)
    pool = RecurrentStatePool({3: conv.state_shapes()}, torch.float32, torch.device("cpu"))
    r = request("r")
    x = torch.randn(9, C)
    run(pool, conv, [ScheduledChunk(r, 0, 4)], [x[:4]])
    draft = ScheduledChunk(r, 4, 5, draft=[1, 2, 3, 4])  # its decode token and 4 draft tokens
    run(pool, conv, [draft], [x[4:9]])
    pool.settle([(draft, [0] * kept)])  # `kept` tokens appended: kept - 1 drafts accepted
    assert pool.holders["r"].position == 4 + kept
    (state,) = pool.states[3]
    torch.testing.assert_close(state[pool.holders["r"].slot], x[4 + kept - (WIDTH - 1):4 + kept].t())
    # and the next chunk goes on from there as if the rejected rows never ran
    _, out = run(pool, conv, [ScheduledChunk(r, 4 + kept, 1)], [x[8:9]])
    expected = reference(conv, torch.cat((x[:4 + kept], x[8:9])))[-1:]
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def test_slots_are_freed_once_their_requests_stop_running_and_the_pool_grows_keeping_states():
    conv = conv_layer()
    pool = RecurrentStatePool({3: conv.state_shapes()}, torch.float32, torch.device("cpu"), initial_slots=2)
    reqs = [request(f"r{i}") for i in range(3)]
    x = torch.randn(3, 2, C)
    run(pool, conv, [ScheduledChunk(r, 0, 2) for r in reqs[:2]], [x[0], x[1]])
    kept = pool.states[3][0][pool.holders["r0"].slot].clone()
    run(pool, conv, [ScheduledChunk(reqs[2], 0, 2)], [x[2]])  # a third request: 2 -> 4 slots
    assert pool.capacity == 4 and pool.num_used == 3
    torch.testing.assert_close(pool.states[3][0][pool.holders["r0"].slot], kept)
    reqs[0].status = RequestStatus.FINISHED
    reqs[1].status = RequestStatus.WAITING  # preempted
    run(pool, conv, [ScheduledChunk(reqs[2], 2, 1)], [x[2, :1]])
    assert sorted(pool.holders) == ["r2"] and len(pool.free) == 3
    assert pool.nbytes == 4 * C * (WIDTH - 1) * 4


def test_a_chunk_starting_where_no_state_is_kept_is_refused():
    conv = conv_layer()
    pool = RecurrentStatePool({3: conv.state_shapes()}, torch.float32, torch.device("cpu"))
    r = request("r")
    with pytest.raises(RuntimeError, match="computes from token 8 but its recurrent layers hold no state"):
        pool.begin_step([ScheduledChunk(r, 8, 4)], [0])
    run(pool, conv, [ScheduledChunk(r, 0, 5)], [torch.randn(5, C)])
    with pytest.raises(RuntimeError, match="a state at token 5"):
        pool.begin_step([ScheduledChunk(r, 6, 1)], [0])


def test_a_snapshot_restored_into_another_request_continues_as_the_saved_one_would():
    conv = conv_layer(2)
    pool = RecurrentStatePool({3: conv.state_shapes()}, torch.float32, torch.device("cpu"))
    a, b = request("a"), request("b")
    x = torch.randn(14, C)
    run(pool, conv, [ScheduledChunk(a, 0, 8)], [x[:8]])
    assert pool.save_snapshot("a", 5) == 8 and pool.snapshot_capacity == 8
    run(pool, conv, [ScheduledChunk(a, 8, 3)], [x[8:11]])  # a moves on; the snapshot stays at 8
    assert pool.restore_snapshot(b, 5) == 8
    _, out = run(pool, conv, [ScheduledChunk(b, 8, 6)], [x[8:14]])  # b goes on from token 8
    torch.testing.assert_close(out, reference(conv, x)[8:], rtol=1e-5, atol=1e-6)
    assert pool.nbytes == (8 + 8) * C * (WIDTH - 1) * 4
    pool.drop_snapshot(5)
    with pytest.raises(ValueError, match="no recurrent-state snapshot 5"):
        pool.restore_snapshot(request("c"), 5)


def test_the_caches_operations_apply_in_order_and_a_save_off_its_position_is_refused():
    conv = conv_layer(3)
    pool = RecurrentStatePool({3: conv.state_shapes()}, torch.float32, torch.device("cpu"))
    pool.max_snapshots = 2  # the plan's share: the room never grows past it
    a, b = request("a"), request("b")
    x = torch.randn(12, C)
    run(pool, conv, [ScheduledChunk(a, 0, 8)], [x[:8]])
    # a's state at 8 saved into 1, b restored from it, then 1 dropped: the restore read it first
    pool.apply([SnapshotOp(SAVE, 1, a, 8), SnapshotOp(RESTORE, 1, b, 8), SnapshotOp(DROP, 1)])
    assert pool.snapshot_capacity == 2 and pool.snapshot_positions == {}
    _, out = run(pool, conv, [ScheduledChunk(b, 8, 4)], [x[8:12]])
    torch.testing.assert_close(out, reference(conv, x)[8:], rtol=1e-5, atol=1e-6)
    with pytest.raises(RuntimeError, match="at token 4: its recurrent layers hold a state at token 8"):
        pool.apply([SnapshotOp(SAVE, 0, a, 4)])
    pool.apply([SnapshotOp(SAVE, 0, a, 8)])
    with pytest.raises(RuntimeError, match="stands at token 8, request 'c' resumes at 12"):
        pool.apply([SnapshotOp(RESTORE, 0, request("c"), 12)])
    pool.tier_positions[3] = 8  # a tier slot the runner recorded at 8: a restore from it at 12 is refused
    with pytest.raises(RuntimeError, match="tier state slot 3 stands at 8, request 'c' resumes at 12"):
        pool.apply([SnapshotOp(TIER_RESTORE, -1, request("c"), 12, slot=3)])
