"""The draft length from measured step costs and a request's acceptance (core/draft_length.py),
and the drafter pausing where no length pays."""

from __future__ import annotations

from radixserve import SamplingParams
from radixserve.core.draft_length import STALE_STEPS, StepCosts, best_length, draft_lengths
from radixserve.core.prompt_lookup import PromptLookupDrafter
from radixserve.core.request import Request
from scheduler_helpers import add, make_scheduler


def costs(table: dict[int, float]) -> StepCosts:
    c = StepCosts()
    for rows, ms in table.items():
        c.observe(rows, ms)
    return c


# this project's AVX2 machine, default model (2026-12-07): rows come in tiles of 4
AVX2 = {1: 13.3, 2: 20.0, 4: 28.2, 5: 49.8, 8: 78.9, 9: 88.0, 12: 92.0, 16: 121.0}


def test_lengths_follow_what_rows_cost_and_what_is_accepted():
    assert best_length(0.9, 1, 8, StepCosts()) == 8  # nothing measured: the caller's cap
    assert best_length(0.9, 1, 8, costs(AVX2)) == 3  # one tile of 4 rows
    assert best_length(0.6, 1, 8, costs(AVX2)) == 2  # 1.96 tokens for 1.8x the time (3 rows, between 2 and 4)
    assert best_length(0.5, 1, 8, costs(AVX2)) == 0  # 1.5 tokens for 1.5x the time: not past the margin
    cheap = {1: 10.0, 2: 10.5, 4: 11.0, 8: 12.0, 9: 12.5, 16: 20.0}  # rows nearly free (AVX512-VNNI, GPU)
    assert best_length(0.9, 1, 8, costs(cheap)) == 8
    assert best_length(0.9, 16, 8, costs(AVX2)) == 0  # a batch of 16 pays for every row: no draft
    assert best_length(0.9, 1, 2, costs(AVX2)) == 2  # never past the cap


def test_estimates_between_and_past_measured_rows():
    c = costs({1: 10.0, 4: 16.0})
    assert c.estimate(4) == 16.0 and c.estimate(2) == 12.0
    assert c.estimate(8) == 16.0 + 4 * 2.0  # past the largest: the last slope
    assert costs({1: 10.0}).estimate(5) == 10.0 + 4 * 0.15 * 10.0  # one count seen: optimistic, tried, then judged
    assert costs({4: 20.0}).estimate(2) == 10.0
    c.observe(4, 26.0)
    assert c.estimate(4) == 0.8 * 16.0 + 0.2 * 26.0


def test_a_row_count_not_measured_for_a_while_is_estimated_afresh():
    c = costs({1: 10.0, 4: 40.0})  # 4 rows measured once while the machine was busy: no draft pays
    assert best_length(0.9, 1, 3, c) == 0
    for _ in range(STALE_STEPS):
        c.observe(1, 10.0)
    assert c.estimate(4) == 40.0  # not yet
    c.observe(1, 10.0)
    assert 4 not in c.ms and c.estimate(4) == 10.0 + 3 * 0.15 * 10.0  # forgotten: guessed again, so tried
    assert best_length(0.9, 1, 3, c) == 3
    for _ in range(STALE_STEPS + 1):
        c.observe(4, 16.0)
    assert c.estimate(1) == 10.0  # the count below the ones drafts use is kept: no draft's cost stays known


def test_the_drafter_pauses_where_no_length_pays_and_drafts_the_best_length_where_one_does():
    drafter = PromptLookupDrafter(8, 1, 3, default_on=True)
    request = Request("r", [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2], SamplingParams(max_tokens=32, temperature=0.0), 64)
    for rows, ms in AVX2.items():
        drafter.observe_step(1, rows, ms)
    assert drafter.propose(request, 8) == [3, 4, 5]  # three draft tokens: four rows
    drafter.observe_step(16, 16, 121.0)  # sixteen requests decoding: no draft pays
    assert drafter.propose(request, 8) == [] and drafter.stats.pauses == 0  # the batch's fault, not the request's
    drafter.observe_step(1, 1, 13.3)  # alone again: it drafts at once
    assert drafter.propose(request, 8) == [3, 4, 5]
    low = Request("low", [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2], SamplingParams(max_tokens=32, temperature=0.0), 64)
    for _ in range(2):
        drafter.propose(low, 8)
        drafter.record(low, 3, 0)  # acceptance (0 + 1.5) / (2 + 2) = 0.375: not even alone
    assert drafter.propose(low, 8) == [] and drafter.stats.pauses == 1


def test_a_step_splits_its_draft_rows_among_the_batch():
    c = costs(AVX2)
    # eight requests decoding: each alone would draft (a 4-row tile past the 8 rows looks cheap),
    # together they share one tile's worth of rows, the likeliest first
    assert best_length(0.9, 8, 8, c) == 4
    assert draft_lengths([0.9] * 8, [8] * 8, 8, c) == [1, 1, 1, 1, 0, 0, 0, 0]
    assert draft_lengths([0.95, 0.9], [4, 4], 2, c) == [2, 0]  # 0.95 ** 2 > 0.9: the tile's two spare rows
    assert draft_lengths([0.9] * 4, [4] * 4, 4, c) == [0] * 4  # a fifth row starts a tile: 1.8x the step
    assert draft_lengths([0.3] * 8, [4] * 8, 8, c) == [0] * 8  # low acceptance: rows cost more than they add
    assert draft_lengths([0.9] * 16, [4] * 16, 16, c) == [0] * 16  # a full batch: speculation off
    assert draft_lengths([0.9, 0.9], [3, 3], 2, StepCosts(), budget=4) == [3, 1]  # unmeasured: caps within the budget
    flat = costs({1: 10.0, 8: 12.0, 16: 14.0, 24: 16.0, 40: 20.0})  # rows nearly free: everyone drafts fully
    assert draft_lengths([0.9] * 8, [4] * 8, 8, flat) == [4] * 8
    assert draft_lengths([0.9] * 8, [4] * 8, 8, flat, budget=10) == [2, 2, 1, 1, 1, 1, 1, 1]


def test_the_scheduler_drafts_nothing_where_the_step_costs_say_a_draft_does_not_pay():
    s = make_scheduler(num_blocks=256, cache=False, max_num_batched_tokens=512, chunked_prefill_size=64,
                       max_num_seqs=16, speculative="prompt-lookup", speculative_max_batch=16)
    s.drafter = PromptLookupDrafter(8, 1, 3, default_on=True)
    for rows, ms in AVX2.items():
        s.drafter.observe_step(1, rows, ms)
    looping = [1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 6, 1, 2]  # every request has a draft to give
    requests = [add(s, looping, max_tokens=16) for _ in range(16)]
    s.commit(s.schedule())
    for r in requests:
        r.token_ids.append(3)
    by_batch = {}
    for batch in (16, 2, 1):
        while len(s.running) > batch:
            s.finish(s.running[-1], "stop")
        plan = s.schedule()
        by_batch[batch] = [len(c.draft) for c in plan.chunks]
        s.commit(plan)
        for c in plan.chunks:  # every draft rejected, the loop's next token sampled
            c.request.token_ids.append(c.request.token_ids[-6])
            s.release_unverified(c.request)
        s.check_integrity()
    assert by_batch[16] == [0] * 16  # every row costs nearly a request's share of the step: off
    assert by_batch[2] == [1, 1]  # two decoding: the tile's two spare rows, one each
    assert by_batch[1] == [3]
    assert s.drafter.stats.pauses == 0
