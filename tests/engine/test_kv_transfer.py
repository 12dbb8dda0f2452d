"""KV handoff between a prefill engine and a decode engine (engine/kv_transfer.py), without Ray:
greedy output equal to one engine doing it all, only the blocks the decode tree lacks move
(exact counts), exports held until released or timed out, a handoff that never arrives
computed on the decode side, integrity on both engines after every scenario."""

from __future__ import annotations

import pickle
import random
import threading

import pytest

from radixserve import Engine, SamplingParams
from radixserve.engine.kv_import import ImportResult
from radixserve.engine.kv_transfer import KVHandoff, TransferFailed

BS = 4
GREEDY = dict(temperature=0.0, ignore_eos=True)


def engine_of(directory, **options) -> Engine:
    defaults = dict(block_size=BS, num_kv_blocks=256, chunked_prefill_size=8, max_num_batched_tokens=32)
    return Engine(str(directory), **{**defaults, **options})


def tokens(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 97) for _ in range(n)]


def run(engine: Engine, request_id: str) -> list[int]:
    out = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.request_id == request_id and o.finished:
                out = o
    assert out is not None
    return out.token_ids


def prefill(engine: Engine, prompt: list[int], skip_blocks: int, salt: str | None = None, **params) -> KVHandoff:
    """The prefill role: compute the prompt, sample its first token, export what the decode side lacks."""
    sp = SamplingParams(**{**GREEDY, **params, "max_tokens": 1})
    rid = engine.add_request(prompt, sp, cache_salt=salt)
    [first] = run(engine, rid)
    return engine.kv_transfer.export(prompt, salt, skip_blocks, first)


def decode(engine: Engine, prompt: list[int], handoff, salt: str | None = None, max_tokens: int = 10,
           wire: bool = True) -> tuple[list[int], list[int]]:
    """The decode role: (all output tokens, the first output's tokens)."""
    if wire and isinstance(handoff, KVHandoff):
        handoff = pickle.loads(pickle.dumps(handoff))  # what a transport carries
    prepared = engine.prepare(prompt, SamplingParams(**GREEDY, max_tokens=max_tokens), salt)
    rid, first = engine.admit_handoff(prepared, handoff)
    first_tokens = first.token_ids if first is not None else []
    if first is not None and first.finished:
        return first.token_ids, first_tokens
    return run(engine, rid), first_tokens


def handoff_round(p: Engine, d: Engine, prompt: list[int], salt: str | None = None, max_tokens: int = 10):
    have = d.kv_transfer.cached_blocks(prompt, salt)
    handoff = prefill(p, prompt, have, salt)
    out, _ = decode(d, prompt, handoff, salt, max_tokens)
    assert p.kv_transfer.release(handoff.handoff_id) == (handoff.num_blocks > 0)  # nothing sent: nothing held
    assert p.kv_transfer.num_holds == 0
    return out, handoff, have


def check(*engines: Engine) -> None:
    for engine in engines:
        engine.check_integrity()
        assert not engine.has_unfinished_requests()


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir("llama")


def test_greedy_output_equals_one_engine(model):
    single = engine_of(model)
    p, d = engine_of(model), engine_of(model)
    for n, seed in [(1, 1), (3, 2), (4, 3), (13, 4), (16, 5), (41, 6)]:
        prompt = tokens(n, seed)
        want = single.generate([prompt], SamplingParams(**GREEDY, max_tokens=10))[0].token_ids
        got, handoff, have = handoff_round(p, d, prompt)
        assert got == want, (n, got, want)
        assert handoff.num_blocks == n // BS - have
        check(single, p, d)


def test_only_the_missing_blocks_move(model):
    p, d = engine_of(model), engine_of(model)
    system = tokens(24, 10)  # 6 blocks
    first = system + tokens(6, 11)  # 30 tokens: 7 full blocks
    _, h1, have = handoff_round(p, d, first)
    assert (have, h1.start_block, h1.num_blocks) == (0, 0, 7)
    assert d.stats()["kv_received_blocks"] == 7
    check(p, d)

    second = system + tokens(10, 12)  # shares the 6 system blocks, then 2 more full blocks
    _, h2, have = handoff_round(p, d, second)
    assert (have, h2.start_block, h2.num_blocks) == (6, 6, 2)
    check(p, d)

    _, h3, have = handoff_round(p, d, second)  # an exact repeat: nothing moves
    assert (have, h3.num_blocks, h3.nbytes) == (8, 0, 0)
    stats = d.stats()
    assert stats["kv_received_blocks"] == 9 and stats["kv_received_tokens"] == 9 * BS
    assert stats["kv_skipped_blocks"] == 6 + 8 and stats["kv_fallback_recomputes"] == 0
    assert p.stats()["kv_sent_blocks"] == 9
    assert p.stats()["kv_sent_bytes"] == d.stats()["kv_received_bytes"] == 9 * h1.nbytes // 7
    check(p, d)

    # The decode tree serves the next turn from the received blocks.
    turn = second + tokens(3, 13)
    out = d.generate([turn], SamplingParams(**GREEDY, max_tokens=4))[0]
    assert out.cached_tokens == 8 * BS
    check(p, d)


def test_blocks_the_decode_tree_gained_meanwhile_are_not_copied(model):
    p, d = engine_of(model), engine_of(model)
    prompt = tokens(20, 20)
    handoff = prefill(p, prompt, skip_blocks=0)
    d.generate([prompt[:12]], SamplingParams(**GREEDY, max_tokens=1))  # 3 blocks appear meanwhile
    want = engine_of(model).generate([prompt], SamplingParams(**GREEDY, max_tokens=10))[0].token_ids
    got, _ = decode(d, prompt, handoff)
    assert got == want
    stats = d.stats()
    assert (stats["kv_received_blocks"], stats["kv_blocks_already_held"]) == (2, 3)
    p.kv_transfer.release(handoff.handoff_id)
    check(p, d)


def test_export_holds_its_blocks_until_release_or_timeout(model):
    p = engine_of(model, num_kv_blocks=16)
    prompt = tokens(24, 30)  # 6 blocks
    handoff = prefill(p, prompt, skip_blocks=0)
    assert p.stats()["kv_export_holds"] == 1
    p.check_integrity()
    assert p.flush_cache() == 0  # held: nothing of it can be dropped
    # Other prompts fill the pool: the held blocks stay.
    p.generate([tokens(30, 31)], SamplingParams(**GREEDY, max_tokens=2))
    assert p.kv_transfer.cached_blocks(prompt, None) == 6
    assert p.kv_transfer.expire(now=handoff_deadline(p, handoff) + 1) == 1
    assert p.stats()["kv_holds_expired"] == 1 and p.stats()["kv_export_holds"] == 0
    assert not p.kv_transfer.release(handoff.handoff_id)  # a late ack changes nothing
    check(p)
    assert p.flush_cache() > 0
    assert p.pool.num_free == p.pool.num_blocks


def handoff_deadline(engine: Engine, handoff: KVHandoff) -> float:
    return engine.kv.external_holds[handoff.handoff_id].deadline


def test_a_handoff_that_never_arrives_is_computed_on_the_decode_side(model):
    p, d = engine_of(model), engine_of(model)
    prompt = tokens(18, 40)
    want = engine_of(model).generate([prompt], SamplingParams(**GREEDY, max_tokens=10))[0].token_ids
    handoff = prefill(p, prompt, skip_blocks=0)  # exported, but the decode side never gets it
    got, first = decode(d, prompt, TransferFailed("timeout"))
    assert got == want and first == []
    stats = d.stats()
    assert (stats["kv_fallback_recomputes"], stats["kv_fallback_tokens"], stats["kv_received_blocks"]) == (1, 18, 0)
    assert stats["computed_tokens"] >= 18
    p.kv_transfer.expire(now=handoff_deadline(p, handoff))
    check(p, d)


@pytest.mark.parametrize("spoil", ["hashes", "layout", "data", "short_data", "prompt", "namespace"])
def test_an_unusable_handoff_falls_back(model, spoil):
    """namespace: a handoff computed under another tenant's salt is not taken into this
    request's namespace (nor into its own: nothing of it enters the tree)."""
    p, d = engine_of(model), engine_of(model)
    prompt = tokens(16, 50)
    want = engine_of(model).generate([prompt], SamplingParams(**GREEDY, max_tokens=6))[0].token_ids
    handoff = prefill(p, prompt, skip_blocks=0, salt="tenant-a" if spoil == "namespace" else None)
    if spoil == "hashes":
        handoff.block_hashes = [h ^ 1 for h in handoff.block_hashes]
    elif spoil == "layout":
        handoff.dtype = "torch.int8"
    elif spoil == "data":
        handoff.data = None
    elif spoil == "short_data":
        handoff.data = handoff.data[:, :-4]
    elif spoil == "prompt":
        handoff.token_ids = handoff.token_ids[:-1] + [handoff.token_ids[-1] % 90 + 4]
    got, _ = decode(d, prompt, handoff, max_tokens=6)
    assert got == want
    assert d.stats()["kv_fallback_recomputes"] == 1 and d.stats()["kv_received_blocks"] == 0
    assert d.kv_transfer.cached_blocks(prompt, "tenant-a") == 0
    p.kv_transfer.release(handoff.handoff_id)
    check(p, d)


def test_namespaces_and_a_first_token_that_stops(model):
    p, d = engine_of(model), engine_of(model)
    prompt = tokens(12, 60)
    _, h, _ = handoff_round(p, d, prompt, salt="tenant-a")
    assert h.num_blocks == 3
    assert d.kv_transfer.cached_blocks(prompt, "tenant-b") == 0 and d.kv_transfer.cached_blocks(prompt, "tenant-a") == 3
    out, first = decode(d, prompt, prefill(p, prompt, 3, "tenant-a"), "tenant-a", max_tokens=1)
    assert len(out) == 1 and first == out  # max_tokens=1: the first token finishes the request
    p.kv_transfer.expire(now=float("inf"))
    check(p, d)


POOLS = {  # engine options of each pool kind, and the kv_cache_dtype its stats name
    "bfloat16": ({"dtype": "bfloat16"}, "bfloat16"),
    "int8": ({"kv_cache_dtype": "int8"}, "int8"),
    "fp8_e4m3": ({"kv_cache_dtype": "fp8_e4m3", "attention_backend": "torch"}, "fp8_e4m3"),
}


@pytest.mark.parametrize("pool", list(POOLS))
def test_every_kv_dtype_moves_as_its_pages_bytes(model, pool):
    """A block moves as its storage's bytes: bfloat16 elements, or a quantized page's codes and
    per-token scales as one unit."""
    options, name = POOLS[pool]
    p, d, single = (engine_of(model, **options) for _ in range(3))
    prompt = tokens(22, 70)
    want = single.generate([prompt], SamplingParams(**GREEDY, max_tokens=8))[0].token_ids
    got, h, _ = handoff_round(p, d, prompt, max_tokens=8)
    assert got == want and h.num_blocks == 22 // BS and h.data.dtype.name == "uint8"
    assert d.stats()["kv_cache_dtype"] == name and d.stats()["kv_received_blocks"] == h.num_blocks
    check(p, d)


@pytest.mark.real_model
def test_real_model_handoff_equals_one_engine(real_model_dir):
    p, d = Engine(str(real_model_dir), num_threads=1), Engine(str(real_model_dir), num_threads=1)
    single = Engine(str(real_model_dir), num_threads=1)
    system = "You are a careful assistant. Answer in one short sentence. " * 4
    for question in ["What is the capital of France?", "Name a prime number above ten."]:
        prompt = single.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": question}])
        want = single.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12))[0].token_ids
        have = d.kv_transfer.cached_blocks(prompt, None)
        handoff = prefill(p, prompt, have, temperature=0.0, ignore_eos=False)
        prepared = d.prepare(prompt, SamplingParams(temperature=0.0, max_tokens=12))
        rid, first = d.admit_handoff(prepared, pickle.loads(pickle.dumps(handoff)))
        got = first.token_ids if first.finished else run(d, rid)
        assert got == want
        assert handoff.num_blocks == len(prompt) // 16 - have
        p.kv_transfer.release(handoff.handoff_id)
        check(p, d, single)
    assert d.stats()["kv_skipped_blocks"] > 0  # the second question reused the system prompt's blocks


def test_a_handoff_of_another_page_layout_is_computed_not_copied(model):
    p, float_side, float_single = engine_of(model, kv_cache_dtype="int8"), engine_of(model), engine_of(model)
    prompt = tokens(22, 71)
    handoff = prefill(p, prompt, 0)
    computed, _ = decode(float_side, prompt, handoff, max_tokens=8)
    assert p.kv_transfer.release(handoff.handoff_id)
    assert computed == float_single.generate([prompt], SamplingParams(**GREEDY, max_tokens=8))[0].token_ids
    stats = float_side.stats()
    assert stats["kv_fallback_recomputes"] == 1 and stats["kv_received_blocks"] == 0
    check(p, float_side)


@pytest.mark.parametrize("extra", [{}, {"top_k": 20, "repetition_penalty": 1.3}])
def test_seeded_sampling_is_the_same_disaggregated(model, extra):
    """The first token is drawn on the prefill side, the rest on the decode side: a seeded
    request's noise is keyed by (seed, output position), so the tokens equal one engine's."""
    p, d, single = engine_of(model), engine_of(model), engine_of(model)
    sampled = dict(temperature=0.9, seed=1234, ignore_eos=True, **extra)
    for n, seed in [(7, 80), (29, 81)]:
        prompt = tokens(n, seed)
        want = single.generate([prompt], SamplingParams(**sampled, max_tokens=12))[0].token_ids
        unseeded = single.generate([prompt], SamplingParams(**{**sampled, "seed": 99}, max_tokens=12))[0].token_ids
        assert want != unseeded  # the seed decides these tokens
        handoff = prefill(p, prompt, d.kv_transfer.cached_blocks(prompt, None), **sampled)
        wire = pickle.loads(pickle.dumps(handoff))
        rid, first = d.admit_handoff(d.prepare(prompt, SamplingParams(**sampled, max_tokens=12)), wire)
        got = run(d, rid)
        assert first.token_ids == want[:1] and got == want, (n, got, want)
        p.kv_transfer.release(handoff.handoff_id)
        check(p, d, single)


def reserved(d: Engine, handoff: KVHandoff):
    """The decode engine's reservation for a handoff off the wire (not yet copied)."""
    pending = d.kv_transfer.reserve(pickle.loads(pickle.dumps(handoff)))
    assert not isinstance(pending, ImportResult), pending
    return pending


def test_the_copy_runs_off_the_engine_thread_while_a_stream_steps(model):
    """Reserve on the engine thread, copy on another while a running request keeps stepping,
    commit, admit: the output equals one engine's, and the reserved blocks are held (counted by
    check_integrity, handed to nobody) until the commit puts them in the tree."""
    p, d, single = engine_of(model), engine_of(model), engine_of(model)
    prompt, other = tokens(26, 90), tokens(9, 91)
    want = single.generate([prompt], SamplingParams(**GREEDY, max_tokens=8))[0].token_ids
    want_other = single.generate([other], SamplingParams(**GREEDY, max_tokens=20))[0].token_ids
    stream = d.add_request(other, SamplingParams(**GREEDY, max_tokens=20))
    d.step()
    handoff = prefill(p, prompt, 0)
    free = d.pool.num_free
    pending = reserved(d, handoff)
    assert len(pending.block_table) == 6 and d.pool.num_free == free - 6
    assert d.stats()["kv_imports_pending"] == 1 and d.kv_transfer.cached_blocks(prompt, None) == 0
    d.check_integrity()
    copier = threading.Thread(target=pending.copy)
    copier.start()
    steps, outs = 0, {}
    while copier.is_alive() or steps < 2:  # the stream steps while the bytes are copied (it may finish)
        outs.update({o.request_id: o.token_ids for o in d.step() if o.finished})
        steps += 1
    copier.join()
    assert pending.state == "copied" and pending.handoff.data is None
    d.check_integrity()
    rid, first = d.admit_handoff(d.prepare(prompt, SamplingParams(**GREEDY, max_tokens=8)), pending)
    assert pending.state == "committed" and d.kv_transfer.cached_blocks(prompt, None) == 6
    while d.has_unfinished_requests():
        outs.update({o.request_id: o.token_ids for o in d.step() if o.finished})
    assert outs[rid] == want and outs[stream] == want_other
    stats = d.stats()
    assert (stats["kv_received_blocks"], stats["kv_imports_pending"], stats["kv_fallback_recomputes"]) == (6, 0, 0)
    assert stats["kv_import_ms"] > 0 and stats["kv_import_engine_ms"] > 0
    p.kv_transfer.release(handoff.handoff_id)
    check(p, d, single)


@pytest.mark.parametrize("when", ["before_copy", "after_copy", "copy_fails", "expired", "wrong_prompt"])
def test_a_reservation_not_committed_frees_every_block(model, when):
    p, d = engine_of(model), engine_of(model)
    prompt = tokens(21, 92)
    want = engine_of(model).generate([prompt], SamplingParams(**GREEDY, max_tokens=6))[0].token_ids
    handoff = prefill(p, prompt, 0)
    free = d.pool.num_free
    pending = reserved(d, handoff)
    if when == "copy_fails":
        pending.handoff.data = pending.handoff.data[:, :7]  # too short for a block
    if when != "before_copy":
        pending.copy()
    if when == "before_copy":
        assert d.kv_transfer.cancel(pending) and pending.state == "cancelled"
        pending.copy()  # a copy that starts after the cancel writes nothing
        assert pending.state == "cancelled"
    elif when == "after_copy":
        assert d.kv_transfer.cancel(pending) and not d.kv_transfer.cancel(pending)
    elif when == "expired":
        d.kv_transfer.expire(now=pending.deadline)
        assert pending.state == "cancelled"
    assert d.pool.num_free == free or when in ("copy_fails", "wrong_prompt")
    check(d)
    asked = prompt if when != "wrong_prompt" else prompt[:-1] + [prompt[-1] % 90 + 4]
    rid, first = d.admit_handoff(d.prepare(asked, SamplingParams(**GREEDY, max_tokens=6)), pending)
    assert first is None and pending.state == "cancelled"  # computed here instead
    got = run(d, rid)
    if when != "wrong_prompt":
        assert got == want
    stats = d.stats()
    assert (stats["kv_fallback_recomputes"], stats["kv_received_blocks"], stats["kv_imports_pending"]) == (1, 0, 0)
    d.flush_cache()
    assert d.pool.num_free == d.pool.num_blocks  # nothing of the reservation is left anywhere
    p.kv_transfer.release(handoff.handoff_id)
    check(p, d)


def test_a_reservation_with_nothing_to_copy_holds_nothing(model):
    p, d = engine_of(model), engine_of(model)
    prompt = tokens(16, 93)
    d.generate([prompt], SamplingParams(**GREEDY, max_tokens=1))  # the decode tree has all 4 blocks
    handoff = prefill(p, prompt, 0)
    free = d.pool.num_free
    pending = reserved(d, handoff)
    assert pending.block_table == [] and pending.state == "copied" and d.pool.num_free == free
    rid, first = d.admit_handoff(d.prepare(prompt, SamplingParams(**GREEDY, max_tokens=4)), pending)
    assert first is not None and d.stats()["kv_blocks_already_held"] == 4
    run(d, rid)
    p.kv_transfer.release(handoff.handoff_id)
    check(p, d)
