"""Prefix hits on models with recurrent layers (LFM2, Qwen3.5, Granite 4.0-H): the cache keeps their states
at prompt ends, reply ends, chunk boundaries and branch points (core/recurrent_snapshots.py),
the runner restores them (execution/recurrent_state.py), and a second request that resumes
from one decodes greedy-equal to transformers token for token, with exact hit counts, through
chunked prefill and preemption; tenants never share states; a flush leaves nothing held."""

from __future__ import annotations

import random

import pytest

from radixserve import Engine
from tiny_models import hf_greedy, run_checked

KINDS = ["lfm2", "qwen3_5", "granite_hybrid"]


def tokens(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(97) for _ in range(n)]


def engine_for(directory, **options):
    # chunks of 9: snapshots every 8 tokens of a prompt (the chunk boundaries in whole blocks)
    defaults = dict(block_size=4, num_kv_blocks=256, chunked_prefill_size=9, max_num_batched_tokens=32)
    return Engine(str(directory), **{**defaults, **options})


@pytest.mark.parametrize("kind", KINDS)
def test_requests_resume_from_kept_states_greedy_equal_to_transformers(tiny_model_dir, kind):
    directory = tiny_model_dir(kind)
    engine = engine_for(directory)
    prompt = tokens(41, seed=3)
    (first,) = run_checked(engine, [prompt], 12)
    assert first.cached_tokens == 0 and first.token_ids == hf_greedy(directory, prompt, 12)
    second = [
        prompt,  # a retry: the prompt's last whole block before its last token ends at 40
        prompt + first.token_ids[:5],  # part way into the reply: back to the prompt's 40
        prompt + first.token_ids + tokens(5, seed=4),  # the next turn: the reply's end, 41 + 12 - 1 -> 52
        prompt[:22] + tokens(10, seed=5),  # leaves the prompt in its 6th block: back to the chunk boundary 16
    ]
    outs = run_checked(engine, second, 8)
    assert [o.cached_tokens for o in outs] == [40, 40, 52, 16]
    for p, o in zip(second, outs):
        assert o.token_ids == hf_greedy(directory, p, 8)
    branch = prompt[:22] + tokens(10, seed=6)
    (third,) = run_checked(engine, [branch], 8)
    assert third.cached_tokens == 20  # the branch point the 4th request's recomputation kept
    assert third.token_ids == hf_greedy(directory, branch, 8)
    stats = engine.stats()
    assert stats["recurrent_snapshot_restores"] == 5 and stats["cached_prompt_tokens"] == 40 + 40 + 52 + 16 + 20


@pytest.mark.parametrize("kind", KINDS)
def test_preempted_requests_sharing_a_prefix_resume_from_kept_states(tiny_model_dir, kind):
    directory = tiny_model_dir(kind)
    engine = engine_for(directory, num_kv_blocks=24)
    base = tokens(20, seed=7)
    prompts = [base + tokens(10, seed=10 + i) for i in range(4)]
    outs = run_checked(engine, prompts, 16)
    stats = engine.stats()
    assert stats["preemptions"] > 0 and stats["recurrent_snapshot_restores"] > 0
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(directory, p, 16)


def test_tenants_never_resume_from_each_others_states_and_a_flush_leaves_none(tiny_model_dir):
    directory = tiny_model_dir("qwen3_5")
    engine = engine_for(directory)
    prompt = tokens(41, seed=3)
    (a,) = run_checked(engine, [prompt], 6, cache_salt="tenant-a")
    (b,) = run_checked(engine, [prompt], 6, cache_salt="tenant-b")
    (again,) = run_checked(engine, [prompt], 6, cache_salt="tenant-a")
    assert [a.cached_tokens, b.cached_tokens, again.cached_tokens] == [0, 0, 40]
    assert a.token_ids == b.token_ids == again.token_ids == hf_greedy(directory, prompt, 6)
    assert engine.stats()["recurrent_snapshots_kept"] > 0
    rows = engine.runner.states.snapshot_positions
    kept = next(iter(engine.kv.snapshot_positions()))
    rows[kept] += 4  # the runner's row no longer stands where the cache says
    with pytest.raises(AssertionError, match="recurrent-state snapshots stand at"):
        engine.check_integrity()
    rows[kept] -= 4
    engine.flush_cache()
    engine.check_integrity()
    stats = engine.stats()
    assert stats["recurrent_snapshots_kept"] == 0 and stats["blocks_free"] == stats["blocks_total"]
    snapshots = engine.kv.components[0]
    assert snapshots.num_used == 0
    (after,) = run_checked(engine, [prompt], 6, cache_salt="tenant-a")  # the drops run before this one's step
    assert after.cached_tokens == 0 and after.token_ids == a.token_ids
    assert set(engine.runner.states.snapshot_positions) == set(snapshots._node) | {
        op.snapshot for op in snapshots._ops if op.kind == "save"}


@pytest.mark.parametrize("kind", KINDS)
def test_a_reply_whose_drafts_ran_past_block_boundaries_is_kept_at_its_end(tiny_model_dir, kind):
    """Prompt lookup drafts a reply that repeats the prompt: accepted drafts run past block
    boundaries, and the state at the last one is kept all the same (RecurrentStatePool.settle)."""
    directory = tiny_model_dir(kind)
    engine = engine_for(directory, chunked_prefill_size=16, max_num_batched_tokens=64, speculative="prompt-lookup")
    rng = random.Random(1)  # test_recurrent_models.py's drafted prompts
    prompts = []
    for seed in ([rng.randrange(97) for _ in range(n)] for n in (5, 8)):
        reply = hf_greedy(directory, seed, 16)
        prompts += [seed + reply + seed, (seed + reply) * 2 + seed]
    outs = run_checked(engine, prompts, 16)
    stats = engine.stats()
    assert stats["spec_accepted_tokens"] > 0
    turns = [p + o.token_ids + tokens(3, seed=9 + i) for i, (p, o) in enumerate(zip(prompts, outs))]
    nexts = run_checked(engine, turns, 6)
    assert [o.cached_tokens for o in nexts] == [(len(p) + 16 - 1) // 4 * 4 for p in prompts]  # each reply's end
    for p, o in zip(prompts + turns, outs + nexts):
        assert o.token_ids == hf_greedy(directory, p, len(o.token_ids))
