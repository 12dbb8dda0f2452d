"""A prompt whose last whole block ends before its last token costs no extra step: the prompt
chunk runs to the end, and the recurrent layers keep the state at that block's end inside the
chunk (Segment.keep_after, RecurrentStatePool KEEP), where a retry resumes greedy-equal to
transformers."""

from __future__ import annotations

import random

import pytest

from radixserve import Engine
from tiny_models import hf_greedy, run_checked


def tokens(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(97) for _ in range(n)]


@pytest.mark.parametrize("kind", ["lfm2", "qwen3_5", "granite_hybrid"])
def test_the_state_inside_the_last_chunk_is_kept_without_a_step_more(tiny_model_dir, kind):
    directory = tiny_model_dir(kind)
    engine = Engine(str(directory), block_size=4, num_kv_blocks=128, chunked_prefill_size=24,
                    max_num_batched_tokens=64)
    assert engine.kv.snapshots.inner_saves
    prompt = tokens(43, seed=11)  # chunks [0, 24) and [24, 43): the state at 40 is kept inside the second
    (first,) = run_checked(engine, [prompt], 4)
    assert engine.stats()["steps"] == 2 + 3  # two prompt chunks (the first token with the last), three decodes
    assert first.token_ids == hf_greedy(directory, prompt, 4)
    assert sorted(engine.kv.snapshot_positions().values()) == [24, 40, 44]  # chunk end, prompt, reply end
    retry = prompt[:41] + tokens(3, seed=12)  # leaves the prompt in its last block: resumes at 40
    (second,) = run_checked(engine, [retry], 4)
    assert second.cached_tokens == 40 and second.token_ids == hf_greedy(directory, retry, 4)
    assert engine.stats()["recurrent_snapshot_restores"] == 1
