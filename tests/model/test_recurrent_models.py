"""Models with recurrent layers served by the engine: LFM2 (model/lfm2.py: short convolutions
beside full attention), Qwen3.5 (model/qwen3_5.py: Gated DeltaNet beside gated attention) and
Granite 4.0-H (model/granite_hybrid.py: Mamba2 beside attention, with experts).
Greedy output equal to transformers token for token on tiny random-weight configs, through
chunked prefill, steps mixing prefill chunks and decodes, preemption (recompute), drafts
verified and rolled back. Prefix hits (their states kept by the cache): test_recurrent_prefix_hits.py."""

from __future__ import annotations

import json
import random
import time

import pytest

from radixserve import Engine, SamplingParams
from tiny_models import hf_greedy

GREEDY = dict(temperature=0.0, ignore_eos=True)


def prompts_of(lengths, seed=0, vocab=97):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def engine_for(directory, **options):
    defaults = dict(block_size=4, num_kv_blocks=256, chunked_prefill_size=7, max_num_batched_tokens=16)
    return Engine(str(directory), **{**defaults, **options})


def run_checked(engine, prompts, max_tokens):
    """Generate step by step, checking every invariant after each step; returns the outputs and
    how many steps mixed decodes with prefill chunks."""
    ids = [engine.add_request(p, SamplingParams(max_tokens=max_tokens, **GREEDY)) for p in prompts]
    done, mixed = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        engine.check_integrity()
        mixed += all(engine.last_step_tokens)
        assert engine.runner.states.num_used <= len(engine.scheduler.running) + len(done)
    return [done[i] for i in ids], mixed


KINDS = ["lfm2", "qwen3_5", "granite_hybrid"]
# per request: LFM2's three conv layers keep 2 inputs of 64 channels; Qwen3.5's three DeltaNet
# layers keep 3 inputs of 64 channels (q, k, v) and S of 4 heads x 8 x 8; Granite's three Mamba2
# layers keep 3 inputs of 192 channels (x 128, B and C 2 groups x 16) and S of 8 heads x 16 x 16
STATE_BYTES = {"lfm2": 3 * 64 * 2 * 4, "lfm2_bias": 3 * 64 * 2 * 4, "qwen3_5": 3 * (64 * 3 + 4 * 8 * 8) * 4,
               "granite_hybrid": 3 * (192 * 3 + 8 * 16 * 16) * 4, "granite_hybrid_rope": 3 * (160 * 3 + 8 * 16 * 16) * 4}


@pytest.mark.parametrize("kind", ["lfm2", "lfm2_bias", "qwen3_5", "granite_hybrid", "granite_hybrid_rope"])
def test_greedy_equals_transformers_chunked_and_batched(tiny_model_dir, kind):
    directory = tiny_model_dir(kind)
    engine = engine_for(directory)
    assert engine.runner.states is not None and engine.loaded.model.native is None
    prompts = prompts_of([3, 9, 23, 41, 60], seed=1)  # 23..60: several chunks of 7
    outs, mixed = run_checked(engine, prompts, 12)
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(directory, prompt, 12)
    assert mixed > 0
    assert engine.runner.states.slot_bytes == STATE_BYTES[kind]
    stats = engine.stats()  # room for 8 requests' states (5 ran at once) and the snapshots taken so far
    assert stats["recurrent_request_bytes"] == STATE_BYTES[kind]
    # num_kv_blocks 256 // 8, unless that is more bytes than a quarter of blocks and snapshots (never under 16)
    block_bytes = engine.memory_plan.shares["full"].bytes
    snapshots = max(16, min(32, block_bytes // 3 // STATE_BYTES[kind]))
    assert stats["recurrent_snapshots_total"] == snapshots
    assert engine.runner.states.snapshot_capacity == snapshots  # grown by doubling, never past the plan's share
    assert stats["recurrent_state_bytes"] == (8 + snapshots) * STATE_BYTES[kind]


@pytest.mark.parametrize("kind", ["qwen3_5", "granite_hybrid"])
def test_prompt_chunks_longer_than_a_scan_block_equal_transformers(tiny_model_dir, kind):
    """Qwen3.5's chunked delta rule and Mamba2's chunked scan over 100-token chunks: blocks of
    64 and 36 carried in one chunk, and the state carried from chunk to chunk."""
    directory = tiny_model_dir(kind)
    engine = engine_for(directory, chunked_prefill_size=100, max_num_batched_tokens=128)
    prompts = prompts_of([150, 70], seed=4)
    outs, _ = run_checked(engine, prompts, 8)
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(directory, prompt, 8)


@pytest.mark.parametrize("kind", KINDS)
def test_preempted_requests_recompute_their_state(tiny_model_dir, kind):
    directory = tiny_model_dir(kind)
    engine = engine_for(directory, num_kv_blocks=24, max_num_batched_tokens=32)
    prompts = prompts_of([30, 33, 29, 35], seed=2)
    outs, _ = run_checked(engine, prompts, 16)
    assert engine.scheduler.stats.preemptions > 0
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(directory, prompt, 16)


@pytest.mark.parametrize("kind", KINDS)
def test_drafts_keep_only_the_accepted_tokens_state(tiny_model_dir, kind):
    """Prompts that repeat their own greedy continuation: prompt lookup drafts it, draft tokens
    are accepted and rejected, and the state is rolled back to the accepted ones."""
    directory = tiny_model_dir(kind)
    engine = engine_for(directory, chunked_prefill_size=16, max_num_batched_tokens=64, speculative="prompt-lookup")
    prompts = []
    for p in prompts_of([5, 8], seed=1):
        reply = hf_greedy(directory, p, 16)
        prompts += [p + reply + p, (p + reply) * 2 + p]
    outs, _ = run_checked(engine, prompts, 16)
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(directory, prompt, 16)
    stats = engine.stats()
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]


def test_a_config_with_other_layer_types_is_refused(tiny_model_dir, tmp_path):
    source = tiny_model_dir("lfm2")
    for f in source.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    config = json.loads((tmp_path / "config.json").read_text())
    config["layer_types"] = ["conv", "mamba", "full_attention", "conv"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"unsupported layer types"):
        Engine(str(tmp_path))


@pytest.mark.parametrize("model_type", ["nemotron_h", "qwen3_next", "mamba2", "falcon_h1"])
def test_other_recurrent_families_are_refused_fast_naming_what_runs(tmp_path, model_type):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type, "architectures": ["X"]}))
    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"unsupported model type .*lfm2.*qwen3_5.*granitemoehybrid"):
        Engine(str(tmp_path))
    assert time.perf_counter() - start < 1.0
