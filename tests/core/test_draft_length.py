"""The draft length from measured step costs and a request's acceptance (core/draft_length.py),
and the drafter pausing where no length pays."""

from __future__ import annotations

from radixserve import SamplingParams
from radixserve.core.draft_length import StepCosts, best_length
from radixserve.core.prompt_lookup import PromptLookupDrafter
from radixserve.core.request import Request


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


def test_the_drafter_pauses_where_no_length_pays_and_drafts_the_best_length_where_one_does():
    drafter = PromptLookupDrafter(8, 1, 3, default_on=True)
    request = Request("r", [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2], SamplingParams(max_tokens=32, temperature=0.0), 64)
    for rows, ms in AVX2.items():
        drafter.observe_step(1, rows, ms)
    assert drafter.propose(request, 8) == [3, 4, 5]  # three draft tokens: four rows
    drafter.observe_step(16, 16, 121.0)  # sixteen requests decoding
    assert drafter.propose(request, 8) == [] and drafter.stats.pauses == 1
