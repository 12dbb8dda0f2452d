"""Prompt-lookup speculative decoding on the default model: greedy outputs equal to
non-speculative decoding token for token (copy-the-context prompts and ordinary ones, batched,
with preemption forced by a tiny pool, with stop strings), drafts accepted, integrity after."""

from __future__ import annotations

import json

import pytest

from radixserve import Engine, SamplingParams
from real_prompts import encode_all

pytestmark = pytest.mark.real_model

COPY_TASKS = [
    "Here is a JSON record:\n" + json.dumps({"id": 7, "name": "Ada", "city": "Oslo", "status": "open", "tags": ["vip", "beta"]})
    + "\nReturn exactly the same JSON record with \"status\" changed to \"closed\". Output only the JSON.",
    "This function has a bug:\n```python\ndef clamp(x, low, high):\n    if x < low:\n        return low\n"
    "    if x > high:\n        return low\n    return x\n```\nRepeat the whole function with the bug fixed.",
    "Copy this list exactly, then add 'kiwi' at the end: apple, banana, cherry, damson, elderberry, fig, grape.",
]


@pytest.fixture(scope="module")
def prompts(real_engine):
    chat = [real_engine.apply_chat_template([{"role": "user", "content": t}]) for t in COPY_TASKS]
    return chat + encode_all(real_engine)[:4]


def _params(speculative: bool, **extra) -> SamplingParams:
    return SamplingParams(max_tokens=40, temperature=0.0, speculative=speculative, **extra)


@pytest.fixture(scope="module")
def expected(real_engine, prompts):
    before = real_engine.stats()["spec_drafts"]  # the engine is shared with other test modules
    outs = real_engine.generate(prompts, _params(False))
    assert real_engine.stats()["spec_drafts"] == before
    return [o.token_ids for o in outs]


def test_greedy_equal_with_speculation_per_request(real_engine, prompts, expected):
    before = real_engine.stats()
    real_engine.drafter.adaptive = False  # drafts by acceptance alone: at batch 7 the measured row costs may turn them off
    try:
        outs = real_engine.generate(prompts, _params(True))
    finally:
        real_engine.drafter.adaptive = True
    assert [o.token_ids for o in outs] == expected
    after = real_engine.stats()
    accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    assert accepted > 20  # the copy tasks copy
    assert after["steps"] - before["steps"] < max(len(e) for e in expected) * 2
    real_engine.check_integrity()
    assert not real_engine.has_unfinished_requests()


def test_greedy_equal_one_at_a_time(real_engine, prompts, expected):
    for prompt, want in zip(prompts[:3], expected[:3]):
        (out,) = real_engine.generate([prompt], _params(True))
        assert out.token_ids == want
    real_engine.check_integrity()


def test_greedy_equal_with_preemption(real_model_dir, prompts, expected):
    engine = Engine(str(real_model_dir), num_kv_blocks=24, max_num_batched_tokens=256, chunked_prefill_size=128,
                    speculative="prompt-lookup")
    outs = engine.generate(prompts, SamplingParams(max_tokens=40, temperature=0.0))
    stats = engine.stats()
    assert stats["preemptions"] > 0 and stats["spec_accepted_tokens"] > 0
    assert [o.token_ids for o in outs] == expected
    engine.check_integrity()
    engine.flush_cache()
    assert engine.pool.num_free == engine.pool.num_blocks


def test_stop_string_inside_accepted_tokens(real_engine, prompts, expected):
    text = real_engine.tokenizer.decode(expected[0], skip_special_tokens=True)
    stop = '"closed"' if '"closed"' in text else text[10:14]
    plain = real_engine.generate([prompts[0]], _params(False, stop=[stop]))[0]
    spec = real_engine.generate([prompts[0]], _params(True, stop=[stop]))[0]
    assert plain.finish_reason == "stop" and plain.stop_reason == stop
    assert (spec.token_ids, spec.text, spec.finish_reason) == (plain.token_ids, plain.text, plain.finish_reason)
    real_engine.check_integrity()
