"""The default SmolLM2-135M-Instruct against transformers, token for token (greedy)."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache

from greedy_reference import transformers_greedy
from radixserve import Engine, SamplingParams
from real_prompts import encode_all

pytestmark = pytest.mark.real_model

MAX_NEW = 24
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)


@pytest.fixture(scope="module")
def prompts(real_engine):
    return encode_all(real_engine)


@pytest.fixture(scope="module")
def references(prompts, hf_real_model, real_engine):
    """transformers' greedy continuation of each prompt, cut after the first EOS (the shared
    engine's output is the guess each is checked against in one forward pass: greedy_reference.py)."""
    guesses = real_engine.generate(prompts, GREEDY)
    return [transformers_greedy(hf_real_model, p, MAX_NEW, real_engine.eos_token_ids, guess.token_ids)
            for p, guess in zip(prompts, guesses)]


def idle_and_intact(engine):
    engine.check_integrity()
    assert not engine.has_unfinished_requests()
    assert engine.pool.num_free + engine.cache.num_evictable_blocks == engine.pool.num_blocks


def test_prompt_lengths_vary(prompts):
    lengths = sorted(len(p) for p in prompts)
    assert len(prompts) == 8 and lengths[0] < 10 and lengths[-1] > 100


def test_greedy_equals_transformers(real_engine, prompts, references):
    outs = real_engine.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == references
    for out, ref in zip(outs, references):
        assert out.finish_reason == ("stop" if ref[-1] in real_engine.eos_token_ids else "length")
        assert out.text == real_engine.tokenizer.decode(out.token_ids, skip_special_tokens=True)
    idle_and_intact(real_engine)


def test_staggered_arrivals_with_tiny_chunks_equal_transformers(real_model_dir, prompts, references):
    engine = Engine(str(real_model_dir), chunked_prefill_size=7, max_num_batched_tokens=24)
    ids = {}
    results = {}
    queue = list(enumerate(prompts))
    while queue or engine.has_unfinished_requests():
        if queue:
            i, p = queue.pop(0)
            ids[engine.add_request(p, GREEDY)] = i
        for out in engine.step():
            if out.finished:
                results[ids[out.request_id]] = out.token_ids
    assert [results[i] for i in range(len(prompts))] == references
    idle_and_intact(engine)


def test_forced_preemption_equals_transformers(real_model_dir, prompts, references):
    engine = Engine(str(real_model_dir), num_kv_blocks=30, max_num_batched_tokens=256, chunked_prefill_size=128)
    outs = engine.generate(prompts, GREEDY)
    assert engine.stats()["preemptions"] > 0
    assert [o.token_ids for o in outs] == references
    idle_and_intact(engine)


def test_a_long_prompt_equals_transformers(real_engine, hf_real_model):
    """Hundreds of prompt tokens in one step: its matmuls run on oneDNN (past the skinny
    kernel's rows), its attention on SDPA; the greedy continuation still matches."""
    from real_prompts import CHAT, RAW

    text = "Summarize the following notes in one sentence.\n\n" + "\n\n".join(RAW + CHAT) * 2
    ids = real_engine.apply_chat_template([{"role": "user", "content": text}])
    assert 400 < len(ids) < 1000
    out = real_engine.generate([ids], GREEDY)[0]
    assert out.token_ids == transformers_greedy(hf_real_model, ids, MAX_NEW, real_engine.eos_token_ids, out.token_ids)
    idle_and_intact(real_engine)


@pytest.mark.slow
def test_prompts_of_thousands_of_tokens_equal_transformers(real_model_dir, hf_real_model):
    """A ~3k-token prompt in chunks of 1000 (chunk boundaries inside blocks, each chunk an
    extend over the ones before), then a second prompt that shares most of it and extends
    the cached prefix: prompt attention runs the tiled kernel over the paged pool; both
    greedy continuations match transformers' (which computes the shared 2,500 tokens once and
    continues each prompt from a copy of their cache)."""
    from real_prompts import CHAT, RAW

    engine = Engine(str(real_model_dir), chunked_prefill_size=1000, max_num_batched_tokens=2048)
    text = "Summarize the following notes in one sentence.\n\n" + "\n\n".join(RAW + CHAT) * 14
    first = engine.apply_chat_template([{"role": "user", "content": text}])
    second = first[:2500] + engine.tokenizer.encode("\n\nWhich of these notes mentions a clock?")
    assert 2000 < len(first) < 6000
    with torch.no_grad():  # transformers computes the 2,500 shared tokens once; each prompt continues from a copy
        shared = DynamicCache(config=hf_real_model.config)
        hf_real_model(torch.tensor([first[:2500]]), cache=shared, use_cache=True, logits_to_keep=1)
    for ids in (first, second):
        out = engine.generate([ids], GREEDY)[0]
        assert out.token_ids == transformers_greedy(hf_real_model, ids, MAX_NEW, engine.eos_token_ids, out.token_ids,
                                                    cache=copy.deepcopy(shared))
    assert out.cached_tokens >= 2400, "the second prompt extends the first one's cached prefix"
    idle_and_intact(engine)
