"""Step-time budget: the scheduler's prefill token budget (exact chunks), the online cost
model (exact fits, budgets), and the engine (greedy outputs unchanged with the budget on)."""

from __future__ import annotations

import math
import random
import time

import pytest

from radixserve import Engine, SamplingParams
from radixserve.config import EngineConfig
from radixserve.core.step_cost import MIN_PREFILL_TOKENS, StepCostModel
from scheduler_helpers import add, chunks, make_scheduler, step


def budget_step(s, budget, token=7):
    """A scheduler round trip under a prefill budget (the 'model' samples `token`)."""
    plan = s.schedule(prefill_token_budget=budget)
    s.commit(plan)
    for c in plan.chunks:
        if c.samples:
            c.request.token_ids.append(token)
    s.check_integrity()
    return plan


def test_prefill_budget_caps_prefill_chunks_while_requests_decode():
    s = make_scheduler(max_num_batched_tokens=64, chunked_prefill_size=32, cache=False)
    a = add(s, range(3), max_tokens=8)
    step(s)  # a's prompt: no decodes yet, so the budget does not apply
    assert a.num_output_tokens == 1
    b, c = add(s, range(100, 140)), add(s, range(200, 210))
    plan = budget_step(s, 12)
    assert chunks(plan) == [(a.request_id, 3, 1), (b.request_id, 0, 12)]
    plan = budget_step(s, 30)
    # b continues first (running prefills before admissions), c gets what is left
    assert chunks(plan) == [(a.request_id, 4, 1), (b.request_id, 12, 28), (c.request_id, 0, 2)]


def test_no_decodes_means_the_whole_token_budget():
    s = make_scheduler(max_num_batched_tokens=40, chunked_prefill_size=32, cache=False)
    a, b = add(s, range(50)), add(s, range(100, 120))
    plan = s.schedule(prefill_token_budget=5)
    assert chunks(plan) == [(a.request_id, 0, 32), (b.request_id, 0, 8)]


def test_spent_prefill_budget_skips_running_prefills_without_preempting():
    s = make_scheduler(max_num_batched_tokens=64, chunked_prefill_size=16, cache=False)
    a = add(s, range(2), max_tokens=8)
    step(s)
    b, c = add(s, range(100, 130)), add(s, range(200, 230))
    plan = budget_step(s, 20)
    assert chunks(plan) == [(a.request_id, 2, 1), (b.request_id, 0, 16), (c.request_id, 0, 4)]
    plan = budget_step(s, 10)
    assert chunks(plan) == [(a.request_id, 3, 1), (b.request_id, 16, 10)]
    assert not plan.preempted and c.num_computed_tokens == 4


def test_budget_of_zero_still_runs_the_decodes():
    s = make_scheduler(max_num_batched_tokens=64, chunked_prefill_size=32, cache=False)
    a = add(s, range(2), max_tokens=8)
    step(s)
    b = add(s, range(100, 120))
    plan = s.schedule(prefill_token_budget=0)
    assert chunks(plan) == [(a.request_id, 2, 1)] and b in s.waiting


def test_cost_model_recovers_an_exact_linear_cost():
    model = StepCostModel(decay=1.0, prior_weight=1e-9)
    rng = random.Random(0)
    for _ in range(50):
        d, p = rng.randrange(0, 33), rng.randrange(0, 513)
        model.observe(d, p, 40.0 + 2.5 * d + 0.75 * p)
    a, b, c = model.coefficients
    assert a == pytest.approx(40.0, abs=1e-3) and b == pytest.approx(2.5, abs=1e-4) and c == pytest.approx(0.75, abs=1e-5)
    model.coefficients = (40.0, 2.5, 0.75)  # exactly, for exact budgets
    # (120 - 40 - 2.5 * 8) / 0.75 = 80 tokens
    assert model.prefill_budget(8, 120, 2048) == 80
    assert model.prefill_budget(0, 10_000, 2048) == 2048
    # decodes alone take 120 ms, over the 50 ms target: prefill gets as much again, 160 tokens
    assert model.prefill_budget(32, 50, 2048) == 160
    assert model.prefill_budget(0, 1, 2048) == 53  # (2 * 40 - 40) / 0.75
    assert StepCostModel(prior=(0.0, 0.0, 100.0)).prefill_budget(1, 50, 2048) == MIN_PREFILL_TOKENS


def test_cost_model_follows_a_slower_machine():
    model = StepCostModel(decay=0.9)
    for i in range(200):
        d, p = i % 9, (i * 37) % 300
        model.observe(d, p, 2 * (40.0 + 2.5 * d + 0.75 * p))  # twice the prior's scale
    assert model.predict_ms(8, 100) == pytest.approx(2 * (40 + 20 + 75), rel=0.02)


def test_cost_model_fits_when_read_the_fit_it_made_after_every_step():
    read_each, read_last = StepCostModel(decay=0.95), StepCostModel(decay=0.95)
    fits = []
    for i in range(60):
        d, p = i % 7, (i * 53) % 400
        for model in (read_each, read_last):
            model.observe(d, p, 30.0 + 2.0 * d + 0.5 * p + (i % 5))
        fits.append(read_each.coefficients)
        if i == 29:
            assert read_last.coefficients == fits[-1]
    assert read_last.coefficients == fits[-1] and fits[-1] != fits[-2]
    read_last.coefficients = (1.0, 2.0, 3.0)  # set: kept until the next observation
    assert read_last.predict_ms(1, 1) == 6.0
    read_last.observe(1, 1, 6.0)
    assert read_last.coefficients != (1.0, 2.0, 3.0)


def test_cost_model_prior_before_any_observation():
    model = StepCostModel()
    a, b, c = model.coefficients
    assert model.prefill_budget(4, 200, 2048) == int((200 - a - 4 * b) / c)


def test_max_step_ms_is_validated():
    with pytest.raises(ValueError, match="max_step_ms"):
        EngineConfig(max_step_ms=-1)
    assert EngineConfig(max_step_ms=120).max_step_ms == 120


class FixedBudget:
    """A fake cost model: every step with decodes may prefill `tokens` tokens."""

    def __init__(self, tokens: int):
        self.tokens = tokens
        self.asked: list[int] = []

    def prefill_budget(self, decodes: int, target_ms: float, max_tokens: int) -> int:
        self.asked.append(decodes)
        return self.tokens

    def observe(self, decodes: int, prefill_tokens: int, step_ms: float) -> None:
        pass


def test_engine_greedy_outputs_unchanged_with_the_budget_on(tiny_model_dir):
    directory = tiny_model_dir("llama")
    rng = random.Random(3)
    prompts = [[rng.randrange(97) for _ in range(n)] for n in (40, 3, 57, 9, 30, 2)]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    options = dict(block_size=4, num_kv_blocks=256, chunked_prefill_size=16, max_num_batched_tokens=32)
    plain = Engine(str(directory), **options)
    budgeted = Engine(str(directory), max_step_ms=50, **options)
    budgeted.step_cost = FixedBudget(5)
    seen = record_prefill_with_decodes(budgeted)
    expected = [o.token_ids for o in plain.generate(prompts, params)]
    got = [o.token_ids for o in _run_staggered(budgeted, prompts, params)]
    assert got == expected
    assert budgeted.step_cost.asked and max(seen) <= 5 and any(n == 5 for n in seen)
    budgeted.check_integrity()
    assert not budgeted.has_unfinished_requests()


def record_prefill_with_decodes(engine) -> list[int]:
    """The prompt tokens of every step that also decoded, as the engine runs them."""
    seen: list[int] = []
    original = engine._observe_step

    def record(decode_tokens, prefill_tokens, step_ms):
        if decode_tokens:
            seen.append(prefill_tokens)
        original(decode_tokens, prefill_tokens, step_ms)

    engine._observe_step = record
    return seen


def _run_staggered(engine, prompts, params):
    ids, done, queue = {}, {}, list(enumerate(prompts))
    while queue or engine.has_unfinished_requests():
        if queue:
            i, p = queue.pop(0)
            ids[engine.add_request(p, params)] = i
        for out in engine.step():
            if out.finished:
                done[ids[out.request_id]] = out
    return [done[i] for i in range(len(prompts))]


def test_engine_fits_its_cost_model_from_real_steps(tiny_model_dir):
    engine = Engine(str(tiny_model_dir("llama")), block_size=4, num_kv_blocks=128, max_step_ms=1000)
    engine.generate([[1, 2, 3] * 10, [5, 6]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert engine.step_cost.observations == engine.stats()["steps"]
    engine.check_integrity()


def test_max_prefill_tokens_decoding_spreads_a_burst_over_steps():
    """With the cap, while requests decode a burst of prompts is prefilled over several steps
    instead of all in one long step; with nothing decoding they share a step; without the cap
    the burst shares the step."""
    s = make_scheduler(max_num_batched_tokens=64, chunked_prefill_size=16, max_prefill_tokens_decoding=16, cache=False)
    burst = [add(s, range(100 * i, 100 * i + 12)) for i in range(3)]
    plan = step(s)  # nothing decodes yet: the whole burst in one step
    assert chunks(plan) == [(r.request_id, 0, 12) for r in burst]
    late = [add(s, range(1000 + 100 * i, 1000 + 100 * i + 12)) for i in range(2)]
    plan = step(s)  # three decodes: 16 prompt tokens beside them
    assert chunks(plan) == [(r.request_id, 12, 1) for r in burst] + [(late[0].request_id, 0, 12), (late[1].request_id, 0, 4)]
    wide = make_scheduler(max_num_batched_tokens=64, chunked_prefill_size=16, cache=False)
    first = add(wide, range(5))
    step(wide)
    others = [add(wide, range(100 * i, 100 * i + 12)) for i in range(1, 4)]
    assert chunks(step(wide)) == [(first.request_id, 5, 1)] + [(r.request_id, 0, 12) for r in others]


def exact_cost(a=20.0, b=5.0, c=1.0) -> StepCostModel:
    model = StepCostModel()
    model.coefficients = (a, b, c)
    return model


def test_deadline_budget_keeps_the_step_target_while_every_prompt_makes_its_deadline():
    model = exact_cost()  # 2 decodes and 20 prompt tokens: 20 + 10 + 20 = 50 ms a step
    # 300 tokens in 20-token steps: 15 steps, 750 ms; due in 900 ms: the step target holds.
    assert model.deadline_budget([(900.0, 300)], decodes=2, step_tokens=20, max_tokens=2048) == 20
    assert model.deadline_budget([], decodes=2, step_tokens=20, max_tokens=2048) == 20
    # A second prompt counts with everything before it: 400 tokens, 20 steps, 1,000 ms <= 1,100.
    assert model.deadline_budget([(900.0, 300), (1100.0, 100)], decodes=2, step_tokens=20, max_tokens=2048) == 20


def test_deadline_budget_computes_a_prompt_that_would_be_late_at_once():
    model = exact_cost()
    assert model.deadline_budget([(700.0, 300)], decodes=2, step_tokens=20, max_tokens=2048) == 300
    assert model.deadline_budget([(700.0, 600)], decodes=2, step_tokens=20, max_tokens=512) == 512
    assert model.deadline_budget([(-50.0, 10)], decodes=2, step_tokens=20, max_tokens=512) == 10  # late already
    # The prompt behind it makes the deadline: 300 + 100 tokens in 20 steps = 1,000 ms <= 1,100.
    assert model.deadline_budget([(700.0, 300), (1100.0, 100)], decodes=2, step_tokens=20, max_tokens=2048) == 300
    # The late one (second) takes the first with it, not the third (due in 5 s).
    pending = [(5000.0, 100), (100.0, 10), (5000.0, 400)]
    assert model.deadline_budget(pending, decodes=2, step_tokens=20, max_tokens=2048) == 110


def test_pending_prefills_lists_running_prefills_then_the_waiting_by_arrival():
    s = make_scheduler(max_num_batched_tokens=8, chunked_prefill_size=8, cache=False)
    a = add(s, range(20), max_tokens=4)
    b = add(s, range(30, 35), max_tokens=4)
    c = add(s, range(40, 46), max_tokens=4)
    c.arrival_time, b.arrival_time = b.arrival_time, c.arrival_time  # c arrived before b
    step(s)  # a computes 8 of its 20 prompt tokens
    assert s.pending_prefills() == [(a.arrival_time, 12), (c.arrival_time, 6), (b.arrival_time, 5)]


@pytest.mark.serial  # a 100 ms window between two clock reads
def test_ttft_target_raises_the_prefill_budget_only_where_a_deadline_needs_it(tiny_model_dir):
    options = dict(block_size=4, num_kv_blocks=256, chunked_prefill_size=64, max_num_batched_tokens=128)
    engine = Engine(str(tiny_model_dir("llama")), max_step_ms=50, ttft_target_ms=10_000, **options)
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    for p in ([1, 2, 3], [4, 5, 6]):
        engine.add_request(p, params)
    engine.step()
    engine.step_cost = exact_cost(a=10.0, b=5.0, c=1.0)  # 2 decodes: 20 ms, so 50 ms leaves 30 tokens
    engine.add_request([t % 97 for t in range(7, 107)], params)  # 100 tokens, due in 10 s: the step target rules
    assert engine.scheduler.num_decoding() == 2
    assert engine._prefill_token_budget() == 30
    waiting = engine.scheduler.waiting[0]
    # 30-token steps take 50 ms: 100 tokens need 4 of them, 200 ms. Due in 250 ms: still the target.
    waiting.arrival_time = time.monotonic() - 9.75
    assert engine._prefill_token_budget() == 30
    waiting.arrival_time = time.monotonic() - 9.85  # due in 150 ms: all of it now
    assert engine._prefill_token_budget() == 100
    engine.step()
    assert engine.last_step_tokens == (2, 64)  # one request's chunk is capped at chunked_prefill_size
    engine.abort(waiting.request_id)
    engine.check_integrity()


def test_ttft_target_ms_is_validated():
    with pytest.raises(ValueError, match="ttft_target_ms"):
        EngineConfig(ttft_target_ms=-5)
    assert EngineConfig(max_step_ms=100, ttft_target_ms=1500).ttft_target_ms == 1500
    with pytest.raises(ValueError, match="set max_step_ms too"):
        EngineConfig(ttft_target_ms=1500)  # would do nothing without the step budget


@pytest.mark.parametrize("ttft_target_ms", [1, 600_000])  # every prompt late / none ever late
def test_engine_greedy_outputs_unchanged_with_a_ttft_target(tiny_model_dir, ttft_target_ms):
    directory = tiny_model_dir("llama")
    rng = random.Random(5)
    prompts = [[rng.randrange(97) for _ in range(n)] for n in (45, 4, 60, 11, 33)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    options = dict(block_size=4, num_kv_blocks=256, chunked_prefill_size=32, max_num_batched_tokens=64)
    expected = [o.token_ids for o in Engine(str(directory), **options).generate(prompts, params)]
    engine = Engine(str(directory), max_step_ms=1, ttft_target_ms=ttft_target_ms, **options)
    engine.step_cost = FrozenCost()
    prefill_with_decodes = record_prefill_with_decodes(engine)
    assert [o.token_ids for o in _run_staggered(engine, prompts, params)] == expected
    if ttft_target_ms > 1000:
        assert max(prefill_with_decodes) == 4  # the step target's budget, every step
    else:
        assert max(prefill_with_decodes) > 32  # late prompts: whole chunks, several in one step
    engine.check_integrity()


class FrozenCost(StepCostModel):
    """A cost model that does not learn (10 + 5 per decode + 1 per prompt token, in ms) and
    whose step-target budget is always 4 tokens."""

    def __init__(self):
        super().__init__()
        self.coefficients = (10.0, 5.0, 1.0)

    def observe(self, decodes: int, prefill_tokens: int, step_ms: float) -> None:
        pass

    def prefill_budget(self, decodes: int, target_ms: float, max_tokens: int) -> int:
        return 4


def test_pending_prefills_give_no_deadline_to_a_request_past_its_first_token():
    s = make_scheduler(max_num_batched_tokens=64, chunked_prefill_size=64, cache=False)
    a = add(s, range(10), max_tokens=4)
    a.first_token_time = a.arrival_time + 0.5  # as if preempted after its first token, now recomputed
    b = add(s, range(20, 26), max_tokens=4)
    assert s.pending_prefills() == [(None, 10), (b.arrival_time, 6)]
    model = exact_cost()
    # a's 10 tokens go before b's 6 (16 in 20-token steps: one 50 ms step), however late a is.
    assert model.deadline_budget([(math.inf, 10), (60.0, 6)], decodes=2, step_tokens=20, max_tokens=512) == 20
    assert model.deadline_budget([(math.inf, 30), (60.0, 6)], decodes=2, step_tokens=20, max_tokens=512) == 36

