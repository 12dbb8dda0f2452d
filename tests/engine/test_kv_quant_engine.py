"""Engines on int8 KV pages (kv_cache_dtype int8), on a tiny random model: sizing and stats,
prefix sharing, preemption, speculative rollbacks, sessions, the second tier and restarts,
each ending in check_integrity. (RADIXSERVE_TEST_KV_CACHE_DTYPE=int8 runs the whole engine
suite on int8 pages; these are the few that always run.)"""

from __future__ import annotations

import logging
import random

import pytest
import torch

from radixserve import Engine, SamplingParams
from radixserve.core.prompt_lookup import PromptLookupDrafter
from radixserve.kernels.key_basis import hadamard_matrix
from radixserve.server.metrics import ServerMetrics
from scheduler_helpers import drafts_one_by_one

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def prompts_of(lengths, seed=0, vocab=97):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def int8_engine(directory, **options):
    defaults = dict(block_size=4, num_kv_blocks=256, chunked_prefill_size=7, max_num_batched_tokens=16,
                    kv_cache_dtype="int8")
    return Engine(str(directory), **{**defaults, **options})


def tokens(outs):
    return [o.token_ids for o in outs]


def test_int8_sizes_the_pool_by_page_bytes_and_reports_it(tiny_model_dir):
    directory = tiny_model_dir("llama")
    full = Engine(str(directory), block_size=16, kv_cache_memory=4 << 20)
    quant = Engine(str(directory), block_size=16, kv_cache_memory=4 << 20, kv_cache_dtype="int8")
    # head_dim 16: a scale per 16 codes, so 64 / 20 = 3.2x the blocks (3.76x at the default model's 64)
    assert quant.pool.num_blocks == int(full.pool.num_blocks * 64 / 20)
    s = quant.stats()
    # 2 layers x (K, V) x 2 KV heads x (16 codes + one float32 scale) per token
    assert s["kv_cache_dtype"] == "int8" and s["kv_bytes_per_token"] == 2 * 2 * 2 * (16 + 4)
    assert full.stats()["kv_cache_dtype"] == "float32" and full.stats()["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 4
    text = ServerMetrics(quant.snapshot, dict).render().decode()
    assert 'radixserve_kv_cache_dtype{dtype="int8"} 1.0' in text
    assert "radixserve_kv_bytes_per_token 160.0" in text


@pytest.mark.parametrize("native_decoder", [True, False])
def test_int8_shares_prefixes_and_preempts_with_the_same_tokens(tiny_model_dir, native_decoder):
    directory = tiny_model_dir("llama")
    shared = prompts_of([24], seed=3)[0]
    prompts = [shared + p for p in prompts_of([5, 9, 2, 13], seed=4)]
    alone = [tokens(int8_engine(directory, native_decoder=native_decoder).generate([p], GREEDY))[0] for p in prompts]
    engine = int8_engine(directory, native_decoder=native_decoder)
    assert tokens(engine.generate(prompts, GREEDY)) == alone
    assert engine.stats()["cached_prompt_tokens"] >= 24
    engine.check_integrity()
    tight = int8_engine(directory, num_kv_blocks=14, native_decoder=native_decoder)  # too few for all at once
    assert tokens(tight.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))) == [
        tokens(int8_engine(directory, native_decoder=native_decoder).generate(
            [p], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)))[0] for p in prompts]
    assert tight.stats()["preemptions"] > 0
    tight.check_integrity()


class OracleDrafter(PromptLookupDrafter):
    """Drafts each prompt's reference continuation, one token wrong in every third draft."""

    def __init__(self, references: dict[tuple, list[int]]):
        super().__init__(8, 1, 3, default_on=True)
        self.references = references

    def propose_step(self, asks, decodes, budget):
        return drafts_one_by_one(self, asks, budget)

    def propose(self, request, max_tokens):
        if max_tokens <= 0 or not self.eligible(request):
            return []
        done = request.num_output_tokens
        draft = list(self.references[tuple(request.prompt_token_ids)][done:done + 5])[:max_tokens]
        if draft and done % 3 == 1:
            draft[done % len(draft)] = (draft[done % len(draft)] + 1) % 97
        return draft


def test_int8_speculative_rollbacks_keep_greedy_tokens(tiny_model_dir):
    directory = tiny_model_dir("llama")
    prompts = prompts_of([3, 17, 40], seed=8)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    plain = tokens(int8_engine(directory).generate(prompts, params))
    spec = int8_engine(directory, speculative="prompt-lookup", speculative_max_batch=64, max_num_batched_tokens=64,
                       chunked_prefill_size=16)
    spec.drafter = spec.scheduler.drafter = OracleDrafter({tuple(p): e for p, e in zip(prompts, plain)})
    assert tokens(spec.generate(prompts, params)) == plain
    stats = spec.stats()
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]  # accepts and rollbacks both
    spec.check_integrity()


def test_int8_sessions_keep_their_context(tiny_model_dir):
    engine = int8_engine(tiny_model_dir("llama"), num_kv_blocks=24)
    first = prompts_of([30], seed=5)[0]
    out = engine.generate([first], GREEDY)[0]
    engine.add_request(first + out.token_ids + [3, 4], GREEDY, session_id="agent")
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats()["cached_prompt_tokens"] >= 32
    assert engine.close_session("agent") in (True, False)
    engine.check_integrity()


def test_int8_tier_restores_pages_and_a_restart_with_another_dtype_starts_cold(tiny_model_dir, tmp_path, caplog):
    directory = tiny_model_dir("llama")
    prompt = prompts_of([40], seed=6)[0]
    options = dict(num_kv_blocks=16, kv_persist_dir=str(tmp_path), kv_offload_memory=1 << 20)
    first = int8_engine(directory, **options)
    cold = first.generate([prompt], GREEDY)[0]
    assert first.tiering.store.slot_bytes == first.runner.pool.block_bytes  # the tier holds pages as they are
    first.generate(prompts_of([30, 30], seed=7), GREEDY)  # evicts the prompt's blocks to the tier
    first.check_integrity()
    assert first.flush_tier()
    first.close()
    again = int8_engine(directory, **options)
    assert again.tiering.loaded_blocks >= 9
    warm = again.generate([prompt], GREEDY)[0]
    assert warm.token_ids == cold.token_ids and warm.cached_tokens >= 36
    again.check_integrity()
    assert again.flush_tier()
    again.close()
    caplog.set_level(logging.WARNING)
    other = Engine(str(directory), block_size=4, **options)  # float32 pages now
    assert other.tiering.loaded_blocks == 0
    assert "kv_cache_dtype" in caplog.text and "ignored" in caplog.text
    assert other.generate([prompt], GREEDY)[0].cached_tokens == 0
    other.check_integrity()
    other.close()


def test_int8_pages_hold_keys_in_the_hadamard_basis(tiny_model_dir):
    """The first token's layer-0 key (position 0: RoPE is the identity) as the pages hold it:
    H k, quantized; the raw k would be far from it."""
    engine = int8_engine(tiny_model_dir("llama"), num_kv_blocks=16)
    prompt = [7, 3, 9, 4, 1]
    engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    model, spec, pool = engine.runner.model, engine.loaded.spec, engine.runner.pool
    layer = model.layers[0]
    with torch.inference_mode():
        qkv = layer.self_attn.qkv_proj(layer.input_layernorm(model.embed_tokens(torch.tensor(prompt[:1]))))
    q_size, kv_size = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    k = qkv[:, q_size : q_size + kv_size].reshape(1, spec.num_kv_heads, spec.head_dim)
    block = engine.cache.match_prefix(prompt).blocks[0]
    stored = pool.pages.read(pool.layer(0)[0][block : block + 1], torch.float32)[0, 0]
    rotated = (k @ hadamard_matrix(spec.head_dim, k.dtype, k.device))[0]
    step = pool.pages.scales(pool.layer(0)[0][block : block + 1])[0, 0]
    assert ((stored - rotated).abs() <= step[:, None] * 0.5 + 1e-6).all()
    assert (stored - k[0]).abs().max() > 10 * step.max()
    engine.check_integrity()
