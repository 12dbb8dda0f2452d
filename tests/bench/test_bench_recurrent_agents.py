"""bench_recurrent_agents' workload on a tiny random-weight Qwen3.5 (and Granite 4.0-H) with the default model's
tokenizer and chat template: from the second turn on, every re-rendered conversation hits all
that an earlier request computed (its ideal), and the cache-off engine gives the same tokens."""

from __future__ import annotations

import pytest

from bench.lib.recurrent_agents import AgentLoops, build_tiny_model, run_loops
from radixserve import Engine


@pytest.mark.real_model
@pytest.mark.parametrize("kind", ["qwen3_5", "granite_hybrid"])
def test_later_turns_hit_their_ideal_and_the_tokens_equal_cache_off(real_model_dir, tmp_path, kind):
    directory = build_tiny_model(kind, tmp_path / kind, real_model_dir)
    workload = AgentLoops(agents=2, turns=3, tool_prompt=96, task=8, tool_result=8, answer=8)
    records = {}
    for cache in (True, False):
        engine = Engine(str(directory), block_size=16, num_kv_blocks=256, enable_prefix_cache=cache)
        records[cache] = run_loops(engine, workload, 16, progress=lambda line: None)
        engine.check_integrity()
    later = [r for r in records[True] if r.turn > 0]
    assert len(later) == 4 and all(r.ideal_tokens > 0 for r in later)
    assert [r.cached_tokens for r in later] == [r.ideal_tokens for r in later]
    assert [r.output for r in records[True]] == [r.output for r in records[False]]
    assert all(r.cached_tokens == 0 for r in records[False])
