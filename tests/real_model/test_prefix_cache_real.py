"""The radix cache on the real model: outputs identical with the cache on and off, and
hit counts against what an unbounded cache could reuse."""

from __future__ import annotations

import random

import pytest

from radixserve import Engine, SamplingParams
from radixserve.core.hashing import extend_block_hashes

pytestmark = pytest.mark.real_model

GREEDY = dict(temperature=0.0)


def conversation_workload(engine):
    """Shared system prompts (two groups of three questions) and second turns that append
    the first answer and a new question."""
    systems = [
        "You are a careful assistant for a bicycle shop. Answer briefly, mention prices in euros, "
        "and always suggest checking the tyre pressure before a long ride.",
        "You are a tutor for primary school arithmetic. Explain each step, use small numbers, "
        "and finish every answer with a short encouraging sentence for the pupil.",
    ]
    questions = [
        ["How often should I oil my chain?", "What does a new saddle cost?", "Do I need lights at night?"],
        ["What is 7 + 5?", "How do I subtract 9 from 15?", "Why is 3 x 4 the same as 4 x 3?"],
    ]
    return [
        [{"role": "system", "content": system}, {"role": "user", "content": q}]
        for system, group in zip(systems, questions)
        for q in group
    ]


def run_turns(engine, conversations, max_tokens=20):
    """Two turns per conversation; the second appends the first answer and a follow-up."""
    first = engine.generate([engine.apply_chat_template(c) for c in conversations],
                            SamplingParams(max_tokens=max_tokens, **GREEDY))
    follow_ups = []
    for c, out in zip(conversations, first):
        follow_ups.append(c + [{"role": "assistant", "content": out.text}, {"role": "user", "content": "Tell me more."}])
    second = engine.generate([engine.apply_chat_template(c) for c in follow_ups],
                             SamplingParams(max_tokens=max_tokens, **GREEDY))
    return [o.token_ids for o in first + second], [o.cached_tokens for o in first + second]


def test_greedy_outputs_identical_with_cache_on_and_off(real_model_dir):
    off = Engine(str(real_model_dir), enable_prefix_cache=False)
    conversations = conversation_workload(off)
    expected, cached_off = run_turns(off, conversations)
    assert sum(cached_off) == 0
    on = Engine(str(real_model_dir))
    got, cached_on = run_turns(on, conversations)
    assert got == expected
    assert sum(cached_on) > 0 and all(c > 0 for c in cached_on[len(conversations):])  # turn 2 hits its history
    # A pool too small for all of them at once: eviction and preemption, same tokens.
    tight = Engine(str(real_model_dir), num_kv_blocks=24, max_num_batched_tokens=256, chunked_prefill_size=128)
    got_tight, _ = run_turns(tight, conversations)
    stats = tight.stats()
    assert stats["preemptions"] > 0 and stats["evicted_blocks"] > 0
    assert got_tight == expected
    for engine in (off, on, tight):
        engine.check_integrity()
        engine.flush_cache()
        assert engine.pool.num_free == engine.pool.num_blocks


def ideal_cached(prompts, block_size):
    """Each prompt's longest block-aligned common prefix with any earlier prompt (at least
    its last token is computed)."""
    known, total = set(), 0
    for p in prompts:
        hashes = extend_block_hashes([], p[:-1], block_size, None)
        hit = 0
        while hit < len(hashes) and hashes[hit] in known:
            hit += 1
        total += hit * block_size
        known.update(extend_block_hashes([], p, block_size, None))
    return total


@pytest.mark.parametrize("policy", ["lpm", "dfs-weight"])
def test_shared_prefix_workload_reaches_95_percent_of_ideal_reuse(real_model_dir, policy):
    rng = random.Random(0)
    # 288-token prompts: a step's 2,048-token budget admits seven at once, room for a policy to take
    # two of a group before their shared prefix is cached
    groups = [[rng.randrange(100, 49000) for _ in range(256)] for _ in range(4)]
    prompts = [g + [rng.randrange(100, 49000) for _ in range(32)] for g in groups for _ in range(8)]
    rng.shuffle(prompts)  # groups interleaved in arrival order
    engine = Engine(str(real_model_dir), schedule_policy=policy)
    engine.generate(prompts, SamplingParams(max_tokens=1, **GREEDY))
    ideal = ideal_cached(prompts, engine.config.block_size)
    cached = engine.stats()["cached_prompt_tokens"]
    assert ideal == 28 * 256
    assert cached >= 0.95 * ideal
    engine.check_integrity()
