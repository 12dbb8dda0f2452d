"""KV handoffs of models with recurrent layers (LFM2, Qwen3.5, Granite 4.0-H; engine/kv_transfer.py): the prefill side sends,
beside the blocks, the recurrent state kept at the deepest point of the sent prefix; the decode
side keeps it at that node of its own (salted) tree, so its request resumes there and computes
only the prompt's tail and the first token, greedy-equal to transformers; a state of another
size is refused whole; a state the prefill side keeps in its tier only is sent from there; the
decode side asks again for blocks it holds past its deepest state (they come with a state); a
tenant never resumes from another's state; integrity on both sides."""

from __future__ import annotations

import pickle
import random

import numpy as np
import pytest

from radixserve import Engine, SamplingParams
from tiny_models import hf_greedy

GREEDY = dict(temperature=0.0, ignore_eos=True)


def engine_of(directory, **options) -> Engine:
    defaults = dict(block_size=4, num_kv_blocks=128, chunked_prefill_size=16, max_num_batched_tokens=32)
    return Engine(str(directory), **{**defaults, **options})


def tokens(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(3, 97) for _ in range(n)]


def finish(engine: Engine, request_id: str):
    out = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.request_id == request_id and o.finished:
                out = o
        engine.check_integrity()
    return out


def prefill(engine: Engine, prompt, salt=None, skip=0):
    rid = engine.add_request(prompt, SamplingParams(**GREEDY, max_tokens=1), cache_salt=salt)
    (first,) = finish(engine, rid).token_ids
    return engine.kv_transfer.export(prompt, salt, skip, first)


def decode(engine: Engine, prompt, handoff, salt=None, max_tokens=8):
    handoff = pickle.loads(pickle.dumps(handoff))  # what a transport carries
    prepared = engine.prepare(prompt, SamplingParams(**GREEDY, max_tokens=max_tokens), salt)
    rid, _ = engine.admit_handoff(prepared, handoff)
    return finish(engine, rid)


@pytest.mark.parametrize("kind", ["lfm2", "qwen3_5", "granite_hybrid"])
def test_the_decode_side_resumes_from_the_sent_state(tiny_model_dir, kind):
    directory = tiny_model_dir(kind)
    p, d = engine_of(directory), engine_of(directory)
    for n, seed in [(41, 1), (40, 2)]:  # a tail of one token; none (the state at the prompt's end)
        prompt = tokens(n, seed)
        handoff = prefill(p, prompt)
        assert handoff.state_position == 40 and handoff.state_data.size == d.runner.states.slot_bytes
        out = decode(d, prompt, handoff)
        assert p.kv_transfer.release(handoff.handoff_id)
        assert out.cached_tokens == 40  # only the tail and the first token computed
        assert out.token_ids == hf_greedy(directory, prompt, 8)
    stats = d.stats()
    assert stats["kv_received_states"] == 2 and stats["recurrent_snapshot_restores"] == 2
    assert p.stats()["kv_sent_states"] == 2
    for engine in (p, d):
        engine.check_integrity()
        engine.flush_cache()
        engine.check_integrity()
        assert engine.kv.snapshots.num_used == 0


def test_a_state_of_another_size_is_refused_and_tenants_keep_their_own(tiny_model_dir):
    directory = tiny_model_dir("qwen3_5")
    p, d = engine_of(directory), engine_of(directory)
    prompt = tokens(41, 3)
    spoiled = prefill(p, prompt, salt="a")
    spoiled.state_data = np.zeros(spoiled.state_data.size - 4, dtype=np.uint8)
    out = decode(d, prompt, spoiled, salt="a")
    assert out.cached_tokens == 0 and d.stats()["kv_fallback_recomputes"] == 1
    assert p.kv_transfer.release(spoiled.handoff_id)
    d.flush_cache()
    handoff = prefill(p, prompt, salt="a")  # the prefill side's own retry
    assert handoff.state_position == 40
    out = decode(d, prompt, handoff, salt="a")
    assert out.cached_tokens == 40 and out.token_ids == hf_greedy(directory, prompt, 8)
    rid = d.add_request(prompt, SamplingParams(**GREEDY, max_tokens=8), cache_salt="b")
    other = finish(d, rid)
    assert other.cached_tokens == 0 and other.token_ids == out.token_ids  # tenant b computes its own
    rid = d.add_request(prompt, SamplingParams(**GREEDY, max_tokens=8), cache_salt="a")
    assert finish(d, rid).cached_tokens == 40
    for engine in (p, d):
        engine.check_integrity()


def test_a_state_the_prefill_side_keeps_in_its_tier_is_sent_from_there(tiny_model_dir):
    directory = tiny_model_dir("lfm2")
    p, d = engine_of(directory, num_kv_blocks=24, kv_offload_memory=2 << 20), engine_of(directory)
    prompt = tokens(41, 5)
    assert p.kv_transfer.release(prefill(p, prompt).handoff_id)
    for i in range(2):  # other prompts push the prompt's blocks and states into the tier
        finish(p, p.add_request(tokens(41, 20 + i), SamplingParams(**GREEDY, max_tokens=4)))
    again = prefill(p, prompt)  # resumes at 40 from the tier; its state at 40 stays there alone
    node = p.kv.peek_prefix(prompt[:40])[1]
    assert node.node_id in p.kv.snapshots._tier_of and node.node_id not in p.kv.snapshots._of_node
    assert again.state_position == 40 and again.num_blocks == 10
    out = decode(d, prompt, again)
    assert out.cached_tokens == 40 and out.token_ids == hf_greedy(directory, prompt, 8)
    assert p.kv_transfer.release(again.handoff_id)
    for engine in (p, d):
        engine.check_integrity()


def test_blocks_the_decode_side_holds_past_its_deepest_state_are_asked_for_again(tiny_model_dir):
    directory = tiny_model_dir("qwen3_5")
    p, d = engine_of(directory), engine_of(directory)
    prompt = tokens(41, 7)
    other = prompt[:40] + tokens(8, 8)  # shares the prompt's 10 blocks; its states: 16, 32, 44
    finish(d, d.add_request(other, SamplingParams(**GREEDY, max_tokens=1)))
    assert d.kv.cached_pool_blocks(prompt, None) == 8  # the 10 blocks are there, a state only at 32
    handoff = prefill(p, prompt, skip=d.kv_transfer.cached_blocks(prompt, None))
    assert handoff.start_block == 8 and handoff.num_blocks == 2 and handoff.state_position == 40
    out = decode(d, prompt, handoff)
    assert out.cached_tokens == 40 and out.token_ids == hf_greedy(directory, prompt, 8)
    assert d.stats()["kv_blocks_already_held"] == 2  # the blocks were not copied again, the state was kept
    assert p.kv_transfer.release(handoff.handoff_id)
    for engine in (p, d):
        engine.check_integrity()
