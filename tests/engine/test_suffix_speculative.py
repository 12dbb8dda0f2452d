"""Suffix drafting end to end on tiny models: greedy output token for token the same as without
speculation, a repeated turn drafting from the cached reply (many more tokens accepted than
on the first turn), over float32 and int8 KV and a hybrid-window model (Gemma 3), with the
engine intact after every round."""

from __future__ import annotations

import random

import pytest

from radixserve import Engine, SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True)


def _prompts(lengths, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(97) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize("kind,options", [
    ("llama", {}),
    ("llama", {"kv_cache_dtype": "int8"}),
    ("gemma3", {}),
])
def test_suffix_drafts_are_greedy_exact_and_reuse_cached_replies(tiny_model_dir, kind, options):
    directory = str(tiny_model_dir(kind))
    prompts = _prompts([21, 34, 13])
    params = SamplingParams(max_tokens=40, **GREEDY)
    base = dict(block_size=4, num_kv_blocks=256, **options)
    plain = Engine(directory, **base)
    expected = [o.token_ids for o in plain.generate(prompts, params)]
    engine = Engine(directory, speculative="suffix", speculative_max_batch=64, speculative_adaptive=False, **base)
    if kind == "gemma3":
        assert engine.runner.pool.hybrid
    first = [o.token_ids for o in engine.generate(prompts, params)]
    assert first == expected
    engine.check_integrity()
    after_first = engine.stats()
    again = [o.token_ids for o in engine.generate(prompts, params)]  # the same turns again: the tree holds them
    assert again == expected
    engine.check_integrity()
    stats = engine.stats()
    accepted = stats["spec_accepted_tokens"] - after_first["spec_accepted_tokens"]
    assert stats["spec_tree_drafts"] > after_first["spec_tree_drafts"]
    assert accepted >= 0.8 * sum(len(e) for e in expected) - 3 * len(prompts)  # whole replies, but the first token
    assert accepted > 2 * after_first["spec_accepted_tokens"]
    assert stats["spec_accepted_length"] > 1.0
    engine.flush_cache()
    plain.flush_cache()
    assert engine.pool.num_free == plain.pool.num_free  # no draft left a block behind


def test_a_namespace_never_drafts_from_another(tiny_model_dir):
    """The same prompt under another salt drafts as on a fresh engine, token for token the same counters."""
    directory = str(tiny_model_dir("llama"))
    prompt = _prompts([30], seed=3)[0]
    params = SamplingParams(max_tokens=40, **GREEDY)

    def run(engine, salt):
        before = engine.stats()
        rid = engine.add_request(prompt, params, cache_salt=salt)
        out = None
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.request_id == rid and o.finished:
                    out = o.token_ids
        after = engine.stats()
        return out, tuple(after[k] - before[k] for k in ("spec_drafts", "spec_draft_tokens", "spec_accepted_tokens"))

    options = dict(block_size=4, num_kv_blocks=256, speculative="suffix", speculative_max_batch=64,
                   speculative_adaptive=False)  # drafts that do not depend on step times: exact counts
    fresh_out, fresh = run(Engine(directory, **options), "key:b")
    engine = Engine(directory, **options)
    out_a, _ = run(engine, "key:a")
    out_b, other = run(engine, "key:b")
    out_a2, same = run(engine, "key:a")
    assert out_a == out_b == out_a2 == fresh_out
    assert other == fresh  # a's reply fed none of b's drafts
    assert same[2] > fresh[2]  # within a's namespace it does
    engine.check_integrity()


def test_adaptive_lengths_keep_greedy_output_and_the_engine_intact(tiny_model_dir):
    """With lengths from measured step times (the default), drafts come and go with timing;
    the output never does."""
    directory = str(tiny_model_dir("llama"))
    prompts = _prompts([21, 34, 13], seed=5)
    params = SamplingParams(max_tokens=40, **GREEDY)
    expected = [o.token_ids for o in Engine(directory, block_size=4, num_kv_blocks=256).generate(prompts, params)]
    engine = Engine(directory, block_size=4, num_kv_blocks=256, speculative="suffix")
    for _ in range(2):
        assert [o.token_ids for o in engine.generate(prompts, params)] == expected
        engine.check_integrity()
    assert engine.drafter.costs.ms  # decode steps were measured
