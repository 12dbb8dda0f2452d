"""Hybrid KV survives an engine restart on the real Gemma 3 270M (the packaged Q4_K_M GGUF):
a first turn longer than two 512-token windows is persisted (full layers and the window
before its end); a restarted engine restores it whole for the follow-up, a hit on every
computed block of the first turn, and its greedy tokens equal an engine that computes the
follow-up from scratch. (The tier holds a window for every block of the first turn, one saved
at each chunk's end; a restore used to want pages for all of them, more than the pool has.)"""

from __future__ import annotations

import inspect
import json.decoder

import pytest

from radixserve import Engine, SamplingParams

pytestmark = [pytest.mark.real_model, pytest.mark.slow]

WINDOW = 512
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _engine(kv_dir=None, **options) -> Engine:
    if kv_dir is not None:
        options.update(kv_persist_dir=str(kv_dir), kv_offload_memory=128 << 20)
    return Engine("gemma3-270m", max_model_len=4096, num_kv_blocks=256, **options)


def _finish(engine: Engine, prompt: list[int], max_steps: int = 100):
    """The prompt's greedy output, failing (not hanging) if it does not finish in max_steps."""
    engine.add_request(prompt, GREEDY)
    for _ in range(max_steps):
        done = [o for o in engine.step() if o.finished]
        if done:
            return done[0]
    raise AssertionError(f"not finished after {max_steps} steps")


def test_a_restarted_engine_restores_a_turn_past_the_window_exactly(tmp_path):
    engine = _engine(tmp_path / "kv")
    assert engine.runner.pool.hybrid
    first = engine.tokenizer.encode(inspect.getsource(json.decoder)[:4400])  # ~1,100 tokens of real text
    out = engine.generate([first], GREEDY)[0]
    block = engine.config.block_size
    hit = (len(first) + len(out.token_ids) - 1) // block * block  # every computed full block
    assert hit > 2 * WINDOW
    assert engine.flush_tier()
    engine.check_integrity()
    engine.close()

    restarted = _engine(tmp_path / "kv")
    assert restarted.tiering.loaded_blocks == hit // block
    follow = first + out.token_ids + restarted.tokenizer.encode("\n# And then:", add_special_tokens=False)
    second = _finish(restarted, follow)
    assert second.cached_tokens == second.restored_tokens == hit
    restarted.check_integrity()
    restarted.close()

    plain = _engine(enable_prefix_cache=False)
    assert second.token_ids == plain.generate([follow], GREEDY)[0].token_ids
    plain.close()
