"""The second KV tier on the real model: a prefix restored from the tier gives exactly the
tokens and logprobs a pool hit gives, and the tokens a cold run gives."""

from __future__ import annotations

import pytest

from radixserve import Engine, SamplingParams

pytestmark = pytest.mark.real_model

PARAMS = SamplingParams(max_tokens=12, temperature=0.0, logprobs=2)


def prompt(topic: str, n: int) -> str:
    return " ".join(f"{topic} fact number {i} is worth remembering." for i in range(n))


def test_restored_prefix_matches_pool_hit_and_recompute(real_model_dir):
    engine = Engine(str(real_model_dir), num_kv_blocks=24, kv_offload_memory=96 << 20,
                    max_num_batched_tokens=512, chunked_prefill_size=512)
    a, b = prompt("Cats", 30), prompt("Rivers", 30)
    cold = engine.generate(a, PARAMS)[0]
    hit = engine.generate(a, PARAMS)[0]
    assert hit.cached_tokens > 0 and hit.restored_tokens == 0
    assert engine.generate(b, PARAMS)[0].finished  # pushes a out of the pool, into the tier
    engine.check_integrity()
    assert engine.stats()["tier_blocks_used"] > 0
    restored = engine.generate(a, PARAMS)[0]
    assert restored.restored_tokens > 0
    assert restored.cached_tokens == hit.cached_tokens
    assert restored.token_ids == hit.token_ids == cold.token_ids
    assert [lp.logprob for lp in restored.logprobs] == [lp.logprob for lp in hit.logprobs]
    stats = engine.stats()
    assert stats["restored_prompt_tokens"] == restored.restored_tokens and stats["tier_hits"] >= 1
    engine.check_integrity()
    # the same with the tier's blocks paged through a file
    engine.flush_cache()
    engine.check_integrity()
    assert engine.stats()["tier_blocks_used"] == 0


def test_file_backed_tier_restores_the_same_tokens(real_model_dir, tmp_path):
    engine = Engine(str(real_model_dir), num_kv_blocks=24, kv_offload_memory=64 << 20,
                    kv_offload_dir=str(tmp_path), max_num_batched_tokens=512, chunked_prefill_size=512)
    assert (tmp_path / "kv_tier.bin").stat().st_size > 0
    a, b = prompt("Owls", 30), prompt("Stones", 30)
    cold = engine.generate(a, PARAMS)[0]
    engine.generate(b, PARAMS)
    restored = engine.generate(a, PARAMS)[0]
    assert restored.restored_tokens > 0 and restored.token_ids == cold.token_ids
    engine.check_integrity()
