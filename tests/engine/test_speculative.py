"""Prompt-lookup speculative decoding without the real model: the n-gram lookup, the drafter's
eligibility and pauses, the scheduler's draft blocks and their release, the engine's
accept/rollback (greedy equality, stop conditions, preemption, integrity) with a scripted
drafter, and the rejection rule's exactness in distribution on a tiny model."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch

from radixserve import Engine, SamplingParams
from radixserve.core.prompt_lookup import FIRST_LENGTH, MIN_TRIES, PAUSE_STEPS, PromptLookupDrafter, lookup
from radixserve.core.request import Request
from scheduler_helpers import add, chunks, drafts_one_by_one, make_scheduler

GREEDY = dict(temperature=0.0, ignore_eos=True)


# ---- lookup and the drafter -------------------------------------------------------------


def test_lookup_takes_the_latest_occurrence_of_the_longest_ngram():
    tokens = [1, 2, 3, 4, 5, 9, 2, 3, 4, 6, 7, 2, 3, 4]
    # [2, 3, 4] occurred twice before the suffix; the latest is followed by 6, 7
    assert lookup(tokens, 3, 2, 3) == [6, 7, 2]
    assert lookup(tokens, 1, 2, 3) == [6]
    assert lookup([5, 6, 7, 8], 4, 1, 3) == []  # no earlier occurrence at all
    assert lookup([1, 2, 7, 1, 2], 4, 2, 3) == [7, 1, 2]  # 3-gram misses, 2-gram [1, 2] hits
    assert lookup([1, 2, 7, 1, 2], 4, 3, 3) == []
    assert lookup([4, 4, 4], 2, 2, 2) == [4]  # overlapping occurrence: stops at the end


def _request(tokens, **params):
    return Request("r", list(tokens), SamplingParams(**{"max_tokens": 32, **params}), len(tokens) + 32)


def test_drafter_eligibility():
    drafter = PromptLookupDrafter(4, 1, 3, default_on=True)
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2]
    first = [3, 4, 5, 6, 7, 8, 9, 1][:FIRST_LENGTH]
    assert 0 < FIRST_LENGTH < 8
    assert drafter.propose(_request(tokens, temperature=0.0), 8) == first  # a first draft is short
    assert drafter.propose(_request(tokens, temperature=0.0), 1) == [3]
    assert drafter.propose(_request(tokens, temperature=0.0, speculative=False), 8) == []
    assert drafter.propose(_request(tokens, temperature=0.0, logprobs=1), 8) == []
    assert drafter.propose(_request(tokens, temperature=0.0, repetition_penalty=1.2), 8) == []
    assert drafter.propose(_request(tokens, temperature=0.7, seed=3), 8) == []
    assert drafter.propose(_request(tokens, temperature=0.7), 8) == first
    assert drafter.propose(_request(tokens, temperature=0.0, min_tokens=2), 8) == []
    constrained = _request(tokens, temperature=0.0)
    constrained.grammar = object()
    assert drafter.propose(constrained, 8) == []
    off_by_default = PromptLookupDrafter(4, 1, 3, default_on=False)
    assert off_by_default.propose(_request(tokens, temperature=0.0), 8) == []
    assert off_by_default.propose(_request(tokens, temperature=0.0, speculative=True), 8) == first
    with pytest.raises(ValueError, match="speculative"):
        SamplingParams(speculative="yes")


def test_drafter_pauses_a_request_whose_drafts_do_not_pay():
    drafter = PromptLookupDrafter(4, 1, 3, default_on=True)
    request = _request([1, 2, 3, 1, 2], temperature=0.0)
    for _ in range(MIN_TRIES):
        assert drafter.propose(request, 8)
        drafter.record(request, 3, 0)
    assert drafter.stats.pauses == 1
    assert all(drafter.propose(request, 8) == [] for _ in range(PAUSE_STEPS))
    assert drafter.propose(request, 8) == [3]  # tries again after the pause, one token past what was accepted
    for _ in range(MIN_TRIES):
        drafter.record(request, 3, 3)  # now it pays: no pause; whole drafts accepted: it grows
    assert drafter.stats.pauses == 1 and drafter.propose(request, 8) == [3, 1, 2]
    assert drafter.stats.draft_tokens == 6 * MIN_TRIES and drafter.stats.accepted_tokens == 3 * MIN_TRIES


def test_draft_length_follows_what_was_accepted():
    drafter = PromptLookupDrafter(6, 1, 3, default_on=True)
    request = _request([1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2], temperature=0.0)
    follows = [3, 4, 5, 6, 7, 8, 9, 1]
    assert drafter.propose(request, 8) == follows[:FIRST_LENGTH]  # starts short
    drafter.record(request, FIRST_LENGTH, FIRST_LENGTH)
    assert drafter.propose(request, 8) == follows[:min(6, 2 * FIRST_LENGTH)]  # all accepted: double
    drafter.record(request, min(6, 2 * FIRST_LENGTH), 1)
    assert drafter.propose(request, 8) == [3, 4]  # accepted 1: one past it
    drafter.record(request, 2, 0)
    assert drafter.propose(request, 8) == [3]
    drafter.record(request, 1, 1)
    drafter.record(request, 2, 2)
    drafter.record(request, 4, 4)
    assert drafter.propose(request, 8) == [3, 4, 5, 6, 7, 8]  # never past num_tokens
    assert drafter.propose(request, 3) == [3, 4, 5]  # nor past what the caller has room for
    drafter.forget("r")
    assert not drafter._states


# ---- scheduler: draft blocks ------------------------------------------------------------


class ScriptedDrafter(PromptLookupDrafter):
    """Proposes what `script(request)` returns (a deterministic function of the context)."""

    def __init__(self, script, max_batch_ok=True):
        super().__init__(8, 1, 3, default_on=True)
        self.script = script

    def propose_step(self, asks, decodes, budget):
        return drafts_one_by_one(self, asks, budget)

    def propose(self, request, max_tokens):
        if max_tokens <= 0 or not self.eligible(request):
            return []
        return list(self.script(request))[:max_tokens]


def test_scheduler_allocates_draft_blocks_and_releases_rejected_ones():
    s = make_scheduler(num_blocks=16, cache=True, max_num_batched_tokens=64, chunked_prefill_size=32)
    s.drafter = ScriptedDrafter(lambda r: [50, 51, 52, 53, 54, 55])
    r = Request("a", list(range(7)), SamplingParams(max_tokens=20, temperature=0.0), 27)
    s.add(r)
    plan = s.schedule()
    assert chunks(plan) == [("a", 0, 7)] and not plan.chunks[0].draft
    s.commit(plan)
    r.token_ids.append(8)  # sampled; 8 tokens, 7 computed, 2 blocks of 4
    plan = s.schedule()
    (chunk,) = plan.chunks
    assert (chunk.start, chunk.num_tokens, chunk.draft) == (7, 7, [50, 51, 52, 53, 54, 55])
    assert chunk.samples and chunk.decodes
    assert len(r.block_table) == 4  # positions 0..13
    s.commit(plan)
    assert r.num_computed_tokens == 8  # only the real token counts before verification
    # verification accepted 50 and 51, then sampled 60: three tokens appended
    r.token_ids.append(50)
    s.accept_draft_token(r)
    r.token_ids.append(51)
    s.accept_draft_token(r)
    r.token_ids.append(60)
    s.release_unverified(r)
    assert r.num_computed_tokens == 10 and r.num_tokens == 11
    assert len(r.block_table) == 3  # the block of positions 12..13 held only rejected tokens
    s.check_integrity()
    s.finish(r, "stop")
    s.check_integrity()
    # the cache holds verified full blocks only: positions 0..7 (two blocks)
    assert s.kv.cache.num_cached_blocks == 2


def test_scheduler_drafts_only_up_to_max_tokens_and_batch():
    s = make_scheduler(num_blocks=64, cache=False, max_num_batched_tokens=64, chunked_prefill_size=32,
                       speculative="prompt-lookup", speculative_max_batch=1)
    s.drafter = ScriptedDrafter(lambda r: [50, 51, 52, 53, 54, 55])
    a = Request("a", [1, 2, 3], SamplingParams(max_tokens=3, temperature=0.0), 6)
    s.add(a)
    s.commit(s.schedule())
    a.token_ids.append(9)
    plan = s.schedule()
    assert plan.chunks[0].draft == [50]  # 4 tokens of 6: two more may come, one of them drafted
    s.commit(plan)
    a.token_ids.append(50)
    s.release_unverified(a)
    b = add(s, [7, 8], max_tokens=5)
    s.commit(s.schedule())
    b.token_ids.append(3)
    plan = s.schedule()  # two requests decode: over speculative_max_batch, no drafts
    assert [c.draft for c in plan.chunks] == [[], []]
    s.commit(plan)


# ---- engine: accept and roll back -------------------------------------------------------


def prompts_of(lengths, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(97) for _ in range(n)] for n in lengths]


def _engine(directory, drafter=None, **options):
    defaults = dict(block_size=4, num_kv_blocks=256, chunked_prefill_size=16, max_num_batched_tokens=64,
                    speculative="prompt-lookup", speculative_max_batch=64)
    engine = Engine(str(directory), **{**defaults, **options})
    if drafter is not None:
        engine.drafter = engine.scheduler.drafter = drafter
    return engine


def oracle(references: dict[tuple, list[int]], wrong_every: int = 3):
    """Drafts the reference continuation, with one token made wrong in every `wrong_every`-th
    draft (at a position that cycles), so verification both accepts and rejects."""

    def script(request):
        prompt = tuple(request.prompt_token_ids)
        done = request.num_output_tokens
        draft = list(references[prompt][done:done + 5])
        if draft and done % wrong_every == 1:
            j = done % len(draft)
            draft[j] = (draft[j] + 1) % 97
        return draft

    return ScriptedDrafter(script)


def test_engine_greedy_equal_with_accepts_and_rejections(tiny_model_dir):
    directory = tiny_model_dir("llama")
    prompts = prompts_of([3, 17, 40, 9, 25])
    params = SamplingParams(max_tokens=24, **GREEDY)
    plain = Engine(str(directory), block_size=4, num_kv_blocks=256)
    expected = [o.token_ids for o in plain.generate(prompts, params)]
    engine = _engine(directory, oracle({tuple(p): e for p, e in zip(prompts, expected)}))
    outs = engine.generate(prompts, params)
    assert [o.token_ids for o in outs] == expected
    stats = engine.stats()
    assert stats["spec_accepted_tokens"] > 0 and stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]
    assert stats["steps"] < plain.stats()["steps"]  # fewer steps than one token each
    assert engine.stats()["generated_tokens"] == sum(len(e) for e in expected)
    engine.check_integrity()
    engine.flush_cache()
    assert engine.pool.num_free == engine.pool.num_blocks


def test_engine_greedy_equal_under_preemption(tiny_model_dir):
    directory = tiny_model_dir("llama")
    prompts = prompts_of([30, 41, 22, 35, 28, 33], seed=4)
    params = SamplingParams(max_tokens=30, **GREEDY)
    plain = Engine(str(directory), block_size=4, num_kv_blocks=256)
    expected = [o.token_ids for o in plain.generate(prompts, params)]
    engine = _engine(directory, oracle({tuple(p): e for p, e in zip(prompts, expected)}), num_kv_blocks=40)
    outs = engine.generate(prompts, params)
    assert engine.stats()["preemptions"] > 0 and engine.stats()["spec_accepted_tokens"] > 0
    assert [o.token_ids for o in outs] == expected
    engine.check_integrity()


def test_stop_conditions_apply_token_by_token_inside_accepted_tokens(tiny_model_dir):
    directory = tiny_model_dir("llama")
    prompts = prompts_of([12, 20], seed=2)
    plain = Engine(str(directory), block_size=4, num_kv_blocks=256)
    ref = [o.token_ids for o in plain.generate(prompts, SamplingParams(max_tokens=24, **GREEDY))]
    # stop at the third generated token of the first prompt (a stop id the drafts run past)
    stop_id = ref[0][2]
    first = ref[0].index(stop_id)
    params = [SamplingParams(max_tokens=24, stop_token_ids=[stop_id], **GREEDY), SamplingParams(max_tokens=7, **GREEDY)]
    engine = _engine(directory, oracle({tuple(p): e for p, e in zip(prompts, ref)}, wrong_every=1000))
    outs = engine.generate(prompts, params)
    assert outs[0].token_ids == ref[0][: first + 1] and outs[0].finish_reason == "stop"
    assert outs[0].stop_reason == stop_id
    assert outs[1].token_ids == ref[1][:7] and outs[1].finish_reason == "length"
    assert engine.stats()["spec_accepted_tokens"] >= 2
    engine.check_integrity()
    engine.flush_cache()
    assert engine.pool.num_free == engine.pool.num_blocks


def test_prompt_lookup_end_to_end_on_a_looping_continuation(tiny_model_dir):
    """The real drafter: a tiny random model falls into loops that lookup predicts."""
    directory = tiny_model_dir("llama")
    prompts = prompts_of([5, 11, 30, 7], seed=0)
    params = SamplingParams(max_tokens=60, **GREEDY)
    plain = Engine(str(directory), block_size=4, num_kv_blocks=256)
    expected = [o.token_ids for o in plain.generate(prompts, params)]
    engine = _engine(directory, prompt_lookup_min=1)
    assert [o.token_ids for o in engine.generate(prompts, params)] == expected
    assert engine.stats()["spec_drafts"] > 0
    engine.check_integrity()


# ---- sampling: exact in distribution ----------------------------------------------------


def _chi2_critical(df: int, z: float = 3.09) -> float:
    """Wilson-Hilferty upper quantile of chi-square with df degrees of freedom (z=3.09: p=0.001)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _chi2(counts: Counter, probs: list[float], n: int) -> tuple[float, int]:
    """Chi-square statistic of counts against probs, cells with expectation < 5 pooled."""
    stat, df, pooled_obs, pooled_exp = 0.0, -1, 0, 0.0
    for token, p in enumerate(probs):
        expected = p * n
        if expected < 5:
            pooled_obs += counts.get(token, 0)
            pooled_exp += expected
            continue
        stat += (counts.get(token, 0) - expected) ** 2 / expected
        df += 1
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / max(pooled_exp, 1e-9)
        df += 1
    return stat, df


def test_sampling_with_speculation_is_exact_in_distribution(tiny_model_dir):
    """2000 samples of three tokens with a fixed draft for the second (accepted with
    probability p, else the residual is drawn; a bonus third token when accepted): the
    second and third tokens' frequencies against their exact marginals (chi-square, p=0.001)."""
    from transformers import AutoModelForCausalLM

    directory = tiny_model_dir("llama")
    prompt = prompts_of([10], seed=7)[0]
    temperature = 1.5
    hf = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float64)
    with torch.no_grad():
        p1 = torch.softmax(hf(torch.tensor([prompt])).logits[0, -1] / temperature, -1)
        one = torch.tensor([prompt + [t] for t in range(97)])
        p2_given = torch.softmax(hf(one).logits[:, -1] / temperature, -1)  # [t1, t2]
        two = torch.tensor([prompt + [a, b] for a in range(97) for b in range(97)])
        p3_given = torch.cat([torch.softmax(hf(part).logits[:, -1] / temperature, -1) for part in two.split(2048)])
    joint12 = p1[:, None] * p2_given
    p2 = joint12.sum(0)
    p3 = (joint12.reshape(-1, 1) * p3_given).sum(0)
    g1 = int(p1.argmax())
    draft = int(p2_given[g1].argmax())

    n = 2000
    engine = _engine(directory, ScriptedDrafter(lambda r: [draft] if r.num_output_tokens == 1 else []),
                     max_num_seqs=256, max_num_batched_tokens=2048, chunked_prefill_size=512,
                     speculative_max_batch=256, num_kv_blocks=2048, seed=11)
    outs = engine.generate([prompt] * n, SamplingParams(max_tokens=3, temperature=temperature, ignore_eos=True))
    stats = engine.stats()
    assert stats["spec_drafts"] == n  # every request verified its draft once
    assert 0.05 * n < stats["spec_accepted_tokens"] < 0.95 * n  # accepted sometimes, rejected sometimes
    for position, probs in ((1, p2), (2, p3)):
        counts = Counter(o.token_ids[position] for o in outs)
        stat, df = _chi2(counts, probs.tolist(), n)
        assert stat < _chi2_critical(df), (position, stat, df)
    engine.check_integrity()


def test_metrics_export_the_acceptance_counters():
    import dataclasses

    from radixserve.engine.stats import EngineStats
    from radixserve.server.metrics import ServerMetrics

    zeros = {f.name: 0 for f in dataclasses.fields(EngineStats) if f.name not in ("cpu", "cache", "tier", "transfer", "hints")}
    stats = EngineStats(**{**zeros, "kv_cache_dtype": "float32", "weight_dtype": "float32", "spec_drafts": 3, "spec_draft_tokens": 12,
                           "spec_accepted_tokens": 9,
                           "spec_acceptance_rate": 0.75})
    text = ServerMetrics(lambda: stats, lambda: {}).render().decode()
    assert "radixserve_spec_drafts_total 3.0" in text
    assert "radixserve_spec_draft_tokens_total 12.0" in text
    assert "radixserve_spec_accepted_tokens_total 9.0" in text
    assert "radixserve_spec_acceptance_rate 0.75" in text
