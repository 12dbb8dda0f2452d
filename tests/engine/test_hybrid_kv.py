"""Hybrid KV on tiny sliding-window models (core/window_pages.py): window layers keep pages
only within a window of where a request reads or a cached prefix ends, outputs stay equal
to transformers token for token, matches are cut where a window page is missing, and the
pages freed as the window slides are exactly the expected ones."""

from __future__ import annotations

import random

import pytest
import torch

from radixserve import Engine, SamplingParams
from radixserve.core.window_pages import NO_PAGE, WindowPages
from tiny_models import hf_greedy, run_checked

GREEDY = dict(temperature=0.0, ignore_eos=True)
BS, WINDOW = 4, 6  # the tiny models' window spans two blocks, neither aligned


def prompts_of(lengths, seed=0, vocab=97):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def engine_for(directory, **options):
    defaults = dict(block_size=BS, num_kv_blocks=256, chunked_prefill_size=64, max_num_batched_tokens=64)
    return Engine(str(directory), **{**defaults, **options})


# ---- WindowPages alone -------------------------------------------------------------------------


def test_first_needed_keeps_the_window_before_the_last_full_block():
    pages = WindowPages(8, 16, window=6, block_size=4)
    # 13 computed tokens: the last full block ends at 12; its window starts at 6 (block 1)
    assert [pages.first_needed(n) for n in (0, 5, 8, 12, 13, 16, 40)] == [0, 0, 0, 1, 1, 2, 8]


def test_valid_prefix_stops_before_a_missing_page():
    pages = WindowPages(16, 16, window=6, block_size=4)
    blocks = [3, 7, 9, 11, 12, 14]
    pages.attach(blocks)
    assert pages.valid_prefix(blocks) == 6
    pages.trim(12)  # block index 4: every end whose window reaches it is out
    assert pages.valid_prefix(blocks) == 4  # ends at 16 tokens: window from block 2 on, all resident
    pages.trim(9)
    assert pages.valid_prefix(blocks) == 2
    pages.trim(3)
    assert pages.valid_prefix(blocks) == 0
    assert pages.num_free == 16 - 3 and pages.trimmed == 3


# ---- the engine ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["gemma3", "mistral_window"])
def test_greedy_equals_transformers_with_window_pages_trimmed(tiny_model_dir, kind):
    directory = tiny_model_dir(kind)
    engine = engine_for(directory, chunked_prefill_size=7, max_num_batched_tokens=16)
    assert engine.runner.pool.hybrid
    prompts = prompts_of([3, 9, 23, 41, 60], seed=3)
    outs = run_checked(engine, prompts, 14)
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(directory, prompt, 14)
    assert engine.pool.window.trimmed > 0
    stats = engine.stats()
    assert stats["window_pages_trimmed"] == engine.pool.window.trimmed
    assert stats["window_pages_total"] == engine.pool.window.num_pages and stats["window_page_bytes"] > 0
    assert stats["blocks_free"] == engine.pool.num_free_blocks


def test_the_pages_freed_as_the_window_slides_are_exact(tiny_model_dir):
    engine = engine_for(tiny_model_dir("gemma3"), enable_prefix_cache=False)
    window = engine.pool.window
    engine.add_request(prompts_of([22])[0], SamplingParams(max_tokens=10, **GREEDY))
    engine.step()  # the whole prompt: 22 computed, blocks 0..5 (the last for tokens 20..23)
    request = engine.scheduler.running[0]
    table = list(request.block_table)
    # the last full block ends at 20; its window starts at 14: block 3 on keeps pages
    assert [window.page_of[b] != NO_PAGE for b in table] == [False, False, False, True, True, True]
    for _ in range(6):  # 28 computed (a full block's end): window from 22 (block 5)
        engine.step()
    table = list(request.block_table)
    assert request.num_computed_tokens == 28 and len(table) == 7
    assert [window.page_of[b] != NO_PAGE for b in table] == [False] * 5 + [True] * 2
    assert window.num_attached == 2 and request.window_first == 5
    engine.check_integrity()
    while engine.has_unfinished_requests():
        engine.step()
    assert window.num_attached == 0 and engine.pool.num_free_blocks == engine.pool.num_blocks
    engine.check_integrity()


def test_a_follow_up_hits_a_cached_prefix_longer_than_the_window_exactly(tiny_model_dir):
    directory = tiny_model_dir("gemma3")
    engine = engine_for(directory)
    first = prompts_of([37], seed=5)[0]
    out = run_checked(engine, [first], 9)[0]
    cached_end = (len(first) + 9 - 1) // BS * BS  # the computed tokens' full blocks: one node
    follow = first + out.token_ids + [11, 12, 13]
    second = run_checked(engine, [follow], 8)[0]
    assert second.cached_tokens == cached_end > 2 * WINDOW
    assert second.token_ids == hf_greedy(directory, follow, 8)
    # a prompt that leaves the cached one early finds no window there (pages trimmed): no hit
    early = first[:20] + [1, 2, 3, 4, 5]
    third = run_checked(engine, [early], 4)[0]
    assert third.cached_tokens == 0
    assert third.token_ids == hf_greedy(directory, early, 4)


def test_a_cached_node_keeps_only_the_windows_before_its_prompts_and_replys_ends(tiny_model_dir):
    engine = engine_for(tiny_model_dir("gemma3"))
    window = engine.pool.window
    prompt = prompts_of([30], seed=6)[0]
    out = run_checked(engine, [prompt], 3)[0]  # 32 computed: 8 full blocks cached
    node = engine.cache.match_prefix(prompt + out.token_ids, None).node
    # two nodes: the prompt's 7 full blocks (inserted once computed) and the reply's block
    assert [len(node.parent.blocks), len(node.blocks)] == [7, 1]
    blocks = node.parent.blocks + node.blocks
    # the prompt's end at 28 (an anchor: a retry resumes there) keeps the window of every point
    # from a block (the slack) before it: from 24 - 6 = 18 (block 4); the reply's end at 32 from 22
    assert window.slack == 1
    assert [window.page_of[b] != NO_PAGE for b in blocks] == [False] * 4 + [True] * 4
    assert window.num_attached == 4
    engine.flush_cache()
    assert window.num_attached == 0
    engine.check_integrity()


def test_page_pressure_evicts_and_preempts_with_outputs_intact(tiny_model_dir):
    directory = tiny_model_dir("gemma3")
    # 24 blocks, the least window pages (one request's window and chunk): many prompts compete
    engine = engine_for(directory, num_kv_blocks=24, window_pages_ratio=0.01, chunked_prefill_size=8,
                        max_num_batched_tokens=16)
    assert engine.pool.window.num_pages < engine.pool.num_blocks
    prompts = prompts_of([12, 30, 7, 25, 18, 33, 9], seed=8)
    outs = run_checked(engine, prompts, 10)
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(directory, prompt, 10)
    stats = engine.stats()
    assert stats["preemptions"] > 0 or engine.cache.evicted_blocks > 0


def test_the_same_memory_holds_more_blocks_and_off_keeps_every_layer(tiny_model_dir):
    directory = tiny_model_dir("gemma3")
    memory = 1 << 20
    hybrid = engine_for(directory, num_kv_blocks=None, kv_cache_memory=memory)
    full = engine_for(directory, num_kv_blocks=None, kv_cache_memory=memory, hybrid_kv="off")
    assert not full.runner.pool.hybrid and full.pool.window is None
    # tiny gemma3: one full layer and two window layers at 0.25 pages per block: 1.5 of 3 layers
    assert hybrid.pool.num_blocks == 2 * full.pool.num_blocks
    prompt = prompts_of([29], seed=9)[0]
    assert (hybrid.generate([prompt], SamplingParams(max_tokens=6, **GREEDY))[0].token_ids
            == full.generate([prompt], SamplingParams(max_tokens=6, **GREEDY))[0].token_ids)


def _prefill_and_decode(p, d, prompt, max_tokens):
    """The prefill role computes the prompt and exports what d lacks; d goes on from it."""
    import pickle

    skip = d.kv_transfer.cached_blocks(prompt, None)
    rid = p.add_request(prompt, SamplingParams(max_tokens=1, **GREEDY))
    [first] = run_checked_ids(p, rid)
    handoff = pickle.loads(pickle.dumps(p.kv_transfer.export(prompt, None, skip, first)))
    prepared = d.prepare(prompt, SamplingParams(max_tokens=max_tokens, **GREEDY))
    rid, _ = d.admit_handoff(prepared, handoff)
    out = run_checked_ids(d, rid)
    p.kv_transfer.release(handoff.handoff_id)
    p.check_integrity()
    return out, handoff, skip


def run_checked_ids(engine, rid):
    out = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.request_id == rid and o.finished:
                out = o
        engine.check_integrity()
    return out.token_ids


def test_kv_transfer_moves_hybrid_blocks_with_their_window_pages(tiny_model_dir):
    """Prefill and decode engines both keep hybrid KV: a handoff carries each block's full
    layers and the window pages of those that have one (the window before the prompt's end);
    the decode side hits all of it and its tokens equal transformers'. A later turn's handoff
    skips what the decode side holds, but never the last window's blocks."""
    directory = tiny_model_dir("gemma3")
    p, d = engine_for(directory), engine_for(directory)
    # 7 full blocks; the prompt's end (28) keeps the window of every point from a block before it: block 4 on
    prompt = prompts_of([30], seed=41)[0]
    out, handoff, skip = _prefill_and_decode(p, d, prompt, 6)
    assert out == hf_greedy(directory, prompt, 6)
    assert skip == 0 and handoff.num_blocks == 7 and handoff.window_mask == [False] * 4 + [True] * 3
    stats = d.stats()
    assert stats["kv_received_blocks"] == 7 and stats["cached_prompt_tokens"] == 28
    follow = prompt + out + prompts_of([9], seed=42)[0]  # 45 tokens: 11 full blocks
    out2, handoff2, skip2 = _prefill_and_decode(p, d, follow, 5)
    assert out2 == hf_greedy(directory, follow, 5)
    # d holds 8 blocks of it (the first turn's 35 computed tokens); the window before 44 (blocks 9, 10)
    # and its slack (block 8) come with the handoff's pages
    assert skip2 == 8 and handoff2.start_block == 8 and handoff2.window_mask == [True, True, True]
    # asking again with all 11 blocks held: the last window's blocks are asked for all the same
    assert d.kv_transfer.cached_blocks(follow, None) == 9
    assert d.stats()["cached_prompt_tokens"] == 28 + 44
    d.check_integrity()


def test_a_hybrid_handoff_into_an_engine_keeping_every_layer_is_computed_there(tiny_model_dir):
    directory = tiny_model_dir("gemma3")
    p, d = engine_for(directory), engine_for(directory, hybrid_kv="off")
    prompt = prompts_of([22], seed=43)[0]
    out, _, _ = _prefill_and_decode(p, d, prompt, 4)
    assert out == hf_greedy(directory, prompt, 4)
    assert d.stats()["kv_fallback_recomputes"] == 1


def test_int8_pages_give_the_same_tokens_hybrid_or_not(tiny_model_dir):
    """Window pages hold int8 codes and scales like blocks do: the window layers read the same
    values whether their KV lives in window pages or in every block."""
    directory = tiny_model_dir("gemma3")
    prompts = prompts_of([5, 19, 38], seed=11)
    hybrid = engine_for(directory, kv_cache_dtype="int8", chunked_prefill_size=7, max_num_batched_tokens=16)
    full = engine_for(directory, kv_cache_dtype="int8", chunked_prefill_size=7, max_num_batched_tokens=16,
                      hybrid_kv="off")
    assert hybrid.runner.pool.hybrid and hybrid.runner.pool.window_kv.dtype == torch.uint8
    got = [o.token_ids for o in run_checked(hybrid, prompts, 10)]
    want = [o.token_ids for o in run_checked(full, prompts, 10)]
    assert got == want and hybrid.pool.window.trimmed > 0


def test_the_second_tier_keeps_hybrid_kv_and_a_restore_equals_recompute(tiny_model_dir):
    """A block leaving the pool for the tier takes its full layers and, where it has one, its
    window page: a follow-up restores both (a hit of the whole turn, counted as restored) and
    its tokens equal transformers' (recomputing everything). Integrity (the tier's block and
    window slots too) holds after every step."""
    directory = tiny_model_dir("gemma3")
    engine = engine_for(directory, num_kv_blocks=12, window_pages_ratio=1.0, chunked_prefill_size=8,
                        max_num_batched_tokens=16, kv_offload_memory=1 << 16)
    assert engine.runner.pool.hybrid and engine.tiering.window_slots is not None
    a, b, c, d = prompts_of([14, 14, 14, 14], seed=31)
    outs = [run_checked(engine, [p], 3)[0] for p in (a, b, c, d)]  # d's blocks push a's to the tier
    match = engine.cache.match_prefix(a + outs[0].token_ids[:2], None)
    assert match.blocks == [] and match.num_tier_blocks == 4
    # a's windows went with it, but page pressure had trimmed its reply's end (block 3: 4 tokens saved)
    # before its prompt's (12 tokens; window and slack blocks 0-2): the least compute saved per page first
    assert engine.cache.tier_windows(match) == [True, True, True, False]
    follow = a + outs[0].token_ids + [5, 6, 7]
    out = run_checked(engine, [follow], 4)[0]
    assert out.cached_tokens == 12 and engine.stats()["restored_prompt_tokens"] == 12
    assert out.token_ids == hf_greedy(directory, follow, 4)
    engine.flush_cache()
    engine.check_integrity()
    assert engine.tiering.window_slots.num_free == engine.tiering.window_slots.num_slots


def test_a_restored_block_has_a_window_only_where_its_page_came_back():
    """Saving a node whose last two blocks have pages, with one window slot in the tier: the
    first of them keeps its window in the tier, the other is saved as a tombstone. Restored,
    only the first gets a page (its saved one copied back), so no end of it is valid."""
    from radixserve.core.block_pool import BlockPool
    from radixserve.core.radix_cache import RadixCache
    from radixserve.kv_tier.index import KVCopy, KVTier

    window = WindowPages(8, 8, window=6, block_size=4)
    pool = BlockPool(8, window)
    cache = RadixCache(pool, 4, KVTier(8), window_tier=KVTier(1))
    tokens = list(range(16))
    blocks = pool.allocate(4)
    window.trim(blocks[0]), window.trim(blocks[1])
    cache.insert(tokens, blocks)
    pool.free(reversed(blocks))
    pages = [window.page_of[b] for b in blocks]
    assert pages == [NO_PAGE, NO_PAGE, 2, 3]
    assert cache.evict(4) == 4 and window.num_free == 8
    node = cache.match_prefix(tokens).node
    assert node.slots == [0, 1, 2, 3] and node.window_slots == [-1, -1, 0, -1]
    assert cache.take_copies() == [KVCopy(True, 0, 0), KVCopy(True, 1, 1), KVCopy(True, 2, 2, 2, 0),
                                   KVCopy(True, 3, 3)]
    match = cache.match_prefix(tokens)
    assert cache.tier_windows(match) == [False, False, True, False]
    assert window.valid_length([False, False, True, False]) == 0
    cache.lock(match.node)
    restored = cache.restore(match)
    assert [window.has_page(b) for b in restored] == [False, False, True, False]
    page = window.page_of[restored[2]]
    assert cache.take_copies() == [KVCopy(False, restored[0], 0), KVCopy(False, restored[1], 1),
                                   KVCopy(False, restored[2], 2, page, 0), KVCopy(False, restored[3], 3)]
    cache.unlock(match.node)
    cache.check_integrity()
    window.check_integrity(pool.ref_counts, [])


# ---- persistence across restarts (kv_persist_dir) -----------------------------------------------


def persisted(directory, kv_dir, **options):
    return engine_for(directory, kv_persist_dir=str(kv_dir), **{"kv_offload_memory": 1 << 16, **options})


FIRST_TURN = prompts_of([37], seed=5)[0]


def first_turn(directory, kv_dir, **options):
    """A 37-token prompt and 9 greedy tokens on an engine that persists its tier; flushed, closed.
    44 tokens computed: a node for the prompt's 9 full blocks, one for the reply's 2."""
    engine = persisted(directory, kv_dir, **options)
    out = run_checked(engine, [FIRST_TURN], 9)[0]
    assert engine.flush_tier()
    engine.check_integrity()
    engine.close()
    return out


def index_of(kv_dir):
    import json

    from radixserve.kv_tier.persist import INDEX_FILE

    return json.loads((kv_dir / INDEX_FILE).read_bytes().partition(b"\n")[2])


def tier_path(engine, tokens):
    match = engine.cache.match_prefix(tokens, None)
    return match, engine.cache.tier_windows(match)


def test_a_restarted_hybrid_engine_adopts_full_layers_and_saved_windows_exactly(tiny_model_dir, tmp_path):
    """Persistence keeps hybrid KV: a slot holds a block's full layers, and the window pages
    before each saved node's end (the prompt's at 36 tokens, the turn's at 44) have window slots
    of their own, named in the index. A restarted engine adopts both; the next turn's hit is the
    whole first turn, restored, and its tokens equal transformers' and a recompute. The index the
    second run writes is good for a third."""
    directory, kv = tiny_model_dir("gemma3"), tmp_path / "kv"
    out = first_turn(directory, kv)
    body = index_of(kv)
    assert body["header"]["hybrid_kv"]["layer_windows"] == [6, 6, 0]
    windows = {entry[0]: entry[6] >= 0 for entry in body["entries"]}  # slot -> has a window slot
    # blocks 6-8 (the prompt's end at 36 and its slack: saved when the turn's end healed nothing, as kept
    # pages) and 9, 10
    assert [windows[s] for s in range(11)] == [False] * 6 + [True] * 5
    engine = persisted(directory, kv)
    assert engine.runner.pool.hybrid and engine.tiering.loaded_blocks == 11
    engine.check_integrity()
    assert engine.tiering.window_slots.num_slots - engine.tiering.window_slots.num_free == 5
    match, saved = tier_path(engine, FIRST_TURN + out.token_ids[:7])
    assert match.blocks == [] and match.num_tier_blocks == 11 and saved == [False] * 6 + [True] * 5
    assert engine.pool.window.valid_length(saved) == 11
    follow = FIRST_TURN + out.token_ids + [11, 12, 13]
    second = run_checked(engine, [follow], 8)[0]
    assert second.cached_tokens == second.restored_tokens == 44
    assert second.token_ids == hf_greedy(directory, follow, 8)
    recompute = run_checked(engine_for(directory, enable_prefix_cache=False), [follow], 8)[0]
    assert second.token_ids == recompute.token_ids
    assert engine.flush_tier()
    engine.close()
    third = persisted(directory, kv)
    turn = follow + second.token_ids + [21, 22]
    out3 = run_checked(third, [turn], 5)[0]
    assert out3.cached_tokens == out3.restored_tokens == (len(follow) + 8 - 1) // BS * BS
    assert out3.token_ids == hf_greedy(directory, turn, 5)
    third.close()


def test_a_restore_gives_pages_only_to_the_window_before_its_end(tiny_model_dir, tmp_path):
    """Chunks of 8 tokens leave a node end every two blocks, each saved with the window before
    it: the tier holds a window for all 11 blocks of the first turn, more than the restarted
    engine's pool has pages. The follow-up restores the whole turn with pages for the window
    before its end only (the others come back as tombstones) and runs; it used to wait for 11
    pages that could never be free."""
    directory, kv = tiny_model_dir("gemma3"), tmp_path / "kv"
    small = dict(chunked_prefill_size=8, max_num_batched_tokens=16, num_kv_blocks=16)
    out = first_turn(directory, kv, **small)
    engine = persisted(directory, kv, **small)
    assert sum(entry[6] >= 0 for entry in index_of(kv)["entries"]) == 11 > engine.pool.window.num_pages
    follow = FIRST_TURN + out.token_ids + [11, 12, 13]
    engine.add_request(follow, SamplingParams(max_tokens=6, **GREEDY))
    final = None
    for _ in range(50):
        final = next((o for o in engine.step() if o.finished), None)
        engine.check_integrity()
        if final is not None:
            break
    assert final is not None and final.cached_tokens == final.restored_tokens == 44
    assert final.token_ids == hf_greedy(directory, follow, 6)
    engine.close()


def test_a_match_after_a_restart_reaches_only_as_far_as_the_restored_windows(tiny_model_dir, tmp_path, caplog):
    """The window page saved for block 10 is corrupted on disk: its full layers are adopted,
    its window is not (a tombstone), so the follow-up's hit stops at 40 tokens, the last end
    whose window (blocks 8, 9) came back; a prompt that leaves the cached one at 20 tokens finds
    no window there and computes everything. Tokens equal transformers' throughout."""
    import logging

    from radixserve.kv_tier.store import TIER_FILE

    directory, kv = tiny_model_dir("gemma3"), tmp_path / "kv"
    out = first_turn(directory, kv)
    header = index_of(kv)["header"]["hybrid_kv"]
    window_slot = {entry[0]: entry[6] for entry in index_of(kv)["entries"]}[10]
    raw = bytearray((kv / TIER_FILE).read_bytes())
    raw[header["window_offset"] + window_slot * header["window_slot_bytes"] + 5] ^= 0xFF
    (kv / TIER_FILE).write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING, logger="radixserve.kv_persist"):
        engine = persisted(directory, kv)
    assert "1 window page(s)" in caplog.text and "tombstones" in caplog.text
    assert engine.tiering.loaded_blocks == 11
    engine.check_integrity()
    _, saved = tier_path(engine, FIRST_TURN + out.token_ids[:7])
    assert saved == [False] * 6 + [True] * 4 + [False]
    follow = FIRST_TURN + out.token_ids + [11, 12, 13]
    second = run_checked(engine, [follow], 6)[0]
    assert second.cached_tokens == second.restored_tokens == 40
    assert second.token_ids == hf_greedy(directory, follow, 6)
    early = FIRST_TURN[:20] + [1, 2, 3, 4, 5]
    third = run_checked(engine, [early], 4)[0]
    assert third.cached_tokens == 0 and third.token_ids == hf_greedy(directory, early, 4)
    engine.close()


def test_a_shared_prefix_branch_keeps_its_window_across_a_restart(tiny_model_dir, tmp_path):
    """Two prompts share a 12-token prefix: the first's tier copy was saved with only its own
    end's window, the second heals the prefix's end (its pages) when it branches there, and that
    window goes to the tier too. After a restart a third prompt sharing the prefix hits it,
    restored, with transformers' tokens."""
    directory, kv = tiny_model_dir("gemma3"), tmp_path / "kv"
    shared = prompts_of([14], seed=41)[0]
    a, b, c = (shared + tail for tail in prompts_of([9, 11, 7], seed=42))
    engine = persisted(directory, kv)
    run_checked(engine, [a], 4)
    assert run_checked(engine, [b], 4)[0].cached_tokens == 0  # the prefix's end was a tombstone
    node = engine.cache.match_prefix(shared[:12], None).node
    # the window of every point from a block (the slack) before 12 to it: blocks 0-2
    assert [w >= 0 for w in node.window_slots] == [True, True, True]
    assert engine.flush_tier()
    engine.close()
    engine = persisted(directory, kv)
    out = run_checked(engine, [c], 5)[0]
    assert out.cached_tokens == out.restored_tokens == 12
    assert out.token_ids == hf_greedy(directory, c, 5)
    engine.close()


def test_int8_window_pages_persist_and_restore_as_stored(tiny_model_dir, tmp_path):
    """int8 KV: slots and window slots hold codes and scales as bytes; after a restart the
    follow-up restores the whole first turn and its tokens equal an int8 engine's that
    computes it again (int8 has its own rounding, so not transformers')."""
    directory, kv = tiny_model_dir("gemma3"), tmp_path / "kv"
    out = first_turn(directory, kv, kv_cache_dtype="int8")
    engine = persisted(directory, kv, kv_cache_dtype="int8")
    assert engine.runner.pool.window_kv.dtype == torch.uint8 and engine.tiering.loaded_blocks == 11
    assert index_of(kv)["header"]["kv_cache_dtype"] == "int8"
    follow = FIRST_TURN + out.token_ids + [11, 12, 13]
    second = run_checked(engine, [follow], 8)[0]
    assert second.cached_tokens == second.restored_tokens == 44
    recompute = run_checked(engine_for(directory, kv_cache_dtype="int8", enable_prefix_cache=False), [follow], 8)[0]
    assert second.token_ids == recompute.token_ids
    engine.close()


def test_a_torn_hybrid_index_is_ignored(tiny_model_dir, tmp_path, caplog):
    import logging

    from radixserve.kv_tier.persist import INDEX_FILE

    directory, kv = tiny_model_dir("gemma3"), tmp_path / "kv"
    out = first_turn(directory, kv)
    index = kv / INDEX_FILE
    index.write_bytes(index.read_bytes()[:-40])
    with caplog.at_level(logging.WARNING, logger="radixserve.kv_persist"):
        engine = persisted(directory, kv)
    assert "torn or corrupt" in caplog.text and engine.tiering.loaded_blocks == 0
    assert engine.tiering.window_slots.num_free == engine.tiering.window_slots.num_slots
    follow = FIRST_TURN + out.token_ids + [11, 12, 13]
    second = run_checked(engine, [follow], 6)[0]
    assert second.cached_tokens == 0 and second.token_ids == hf_greedy(directory, follow, 6)
    engine.close()


@pytest.mark.parametrize("writer, reader", [("auto", "off"), ("off", "auto"), ("auto", "other split")])
def test_a_tier_persisted_under_another_kv_split_is_ignored(tiny_model_dir, tmp_path, caplog, writer, reader):
    """A slot of a hybrid tier holds the full layers only, one of a tier keeping every layer
    holds all: an index written by one is never read by the other (nor under another split of
    the layers), and says which part of the header differs."""
    import hashlib
    import json
    import logging

    from radixserve.kv_tier.persist import INDEX_FILE

    directory, kv = tiny_model_dir("gemma3"), tmp_path / "kv"
    out = first_turn(directory, kv, hybrid_kv=writer)
    if reader == "other split":  # as if the model's layer_types had changed under the same weights
        body = index_of(kv)
        body["header"]["hybrid_kv"]["layer_windows"] = [6, 0, 6]
        raw = json.dumps(body, separators=(",", ":")).encode()
        (kv / INDEX_FILE).write_bytes(hashlib.sha256(raw).hexdigest().encode() + b"\n" + raw)
    with caplog.at_level(logging.WARNING, logger="radixserve.kv_persist"):
        engine = persisted(directory, kv, hybrid_kv="off" if reader == "off" else "auto")
    assert "another model or layout" in caplog.text and "hybrid_kv" in caplog.text
    assert engine.tiering.loaded_blocks == 0 and engine.runner.pool.hybrid == (reader != "off")
    follow = FIRST_TURN + out.token_ids + [11, 12, 13]
    second = run_checked(engine, [follow], 6)[0]
    assert second.cached_tokens == 0 and second.token_ids == hf_greedy(directory, follow, 6)
    engine.close()


def test_a_saved_window_takes_the_window_slots_of_entries_worth_less():
    """A tier written through (persistence) saves each new node's window; when the window slots
    are all held, the new node takes those of the least valuable entries, which stay in the tier
    as tombstones for the window layers (their entries set anew, without a window slot)."""
    from radixserve.core.block_pool import BlockPool
    from radixserve.core.radix_cache import RadixCache
    from radixserve.kv_tier.index import KVTier

    window = WindowPages(16, 16, window=6, block_size=4)
    pool = BlockPool(16, window)
    cache = RadixCache(pool, 4, KVTier(16), write_through=True, record_entries=True, window_tier=KVTier(2))
    old, new = list(range(16)), list(range(100, 116))
    for tokens in (old, new):
        blocks = pool.allocate(4)
        cache.insert(tokens, blocks)
        pool.free(reversed(blocks))
    old_node, new_node = cache.match_prefix(old).node, cache.match_prefix(new).node
    assert old_node.window_slots == [] and new_node.window_slots == [-1, -1, 0, 1]
    events = cache.take_tier_events()
    assert [(e.slot, e.window_slot) for _, e in events] == [
        (0, -1), (1, -1), (2, 0), (3, 1),  # the old node saved with its window
        (0, -1), (1, -1), (2, -1), (3, -1),  # ... which the new one takes
        (4, -1), (5, -1), (6, 0), (7, 1)]
    assert cache.window_tier.num_free == 0
    cache.check_integrity()
    window.check_integrity(pool.ref_counts, [])


def test_a_save_finds_the_windows_to_take_without_walking_the_tier():
    """Each of 50 written-through nodes takes the two window slots of the one before it, leaving
    49 older entries without windows. A save looks only at the entries that still hold windows
    (never walking the tier's eviction order past those 49, as it did on every save): the 51st
    takes the 50th's."""
    from sortedcontainers import SortedSet

    from radixserve.core.block_pool import BlockPool
    from radixserve.core.radix_cache import RadixCache
    from radixserve.kv_tier.index import KVTier

    class NoWalk(SortedSet):
        saving = True

        def __iter__(self):
            assert not self.saving, "a save walked the tier's eviction order"
            return super().__iter__()

    window = WindowPages(256, 256, window=6, block_size=4)
    pool = BlockPool(256, window)
    cache = RadixCache(pool, 4, KVTier(256), write_through=True, window_tier=KVTier(2))
    cache.tier_slots.evictable = NoWalk(key=lambda n: n.sort_key)
    nodes = []
    for i in range(51):
        blocks = pool.allocate(4)
        nodes.append(cache.insert([1000 + i] + list(range(15)), blocks))
        pool.free(reversed(blocks))
    cache.tier_slots.evictable.saving = False
    assert [n.window_slots for n in nodes[:50]] == [[]] * 50
    assert sorted(nodes[50].window_slots[2:]) == [0, 1] and cache.window_tier.num_free == 0
    cache.check_integrity()


def test_speculative_drafts_verify_over_window_pages(tiny_model_dir):
    """Prompt-lookup drafts enter attention as single-query rows, each over the window
    layers' own pages: the output stays transformers' greedy one."""
    directory = tiny_model_dir("gemma3")
    base = prompts_of([9], seed=13)[0]
    prompt = base * 4  # repeats give the drafter n-grams to propose
    engine = engine_for(directory, speculative="prompt-lookup")
    out = run_checked(engine, [prompt], 16)[0]
    assert out.token_ids == hf_greedy(directory, prompt, 16)
    assert engine.stats()["spec_drafts"] > 0


@pytest.mark.parametrize("kind", ["mistral_window", "gemma3"])
@pytest.mark.parametrize("hybrid_kv", ["off", "auto"])
def test_a_windowed_model_decodes_in_the_native_decoder(tiny_model_dir, kind, hybrid_kv):
    """Keeping every layer, or hybrid (the window layers read their own pages through the
    step's window tables and slots): transformers' greedy tokens either way."""
    directory = tiny_model_dir(kind)
    engine = engine_for(directory, hybrid_kv=hybrid_kv)
    assert engine.runner.model.native is not None and engine.runner.pool.hybrid == (hybrid_kv == "auto")
    prompts = prompts_of([4, 27], seed=14)
    for prompt, out in zip(prompts, run_checked(engine, prompts, 12)):
        assert out.token_ids == hf_greedy(directory, prompt, 12)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_shared_prefix_traffic_matches_every_layer_kept(tiny_model_dir, seed):
    """Agents sharing prefixes, growing turn by turn, leaving early and arriving mid-run, in
    a pool small enough to evict and preempt: hybrid KV gives exactly the tokens of keeping
    every layer, with every invariant checked after every step."""
    directory = tiny_model_dir("gemma3")
    rng = random.Random(seed)
    system = prompts_of([rng.randrange(6, 20)], seed=seed + 100)[0]
    prompts: list[list[int]] = []
    for i in range(14):
        history = system + prompts_of([rng.randrange(1, 30)], seed=seed * 50 + i)[0]
        if prompts and rng.random() < 0.5:  # a later turn of an earlier conversation
            history = prompts[rng.randrange(len(prompts))] + prompts_of([rng.randrange(1, 9)], seed=seed * 70 + i)[0]
        prompts.append(history)
    options = dict(num_kv_blocks=40, chunked_prefill_size=rng.choice([5, 8, 13]), max_num_batched_tokens=16)
    outputs = {}
    for mode in ("auto", "off"):
        engine = engine_for(directory, hybrid_kv=mode, window_pages_ratio=0.3, **options)
        assert engine.runner.pool.hybrid == (mode == "auto")
        outputs[mode], stats = _staggered(engine, prompts, rng_seed=seed)
        assert stats["cached_prompt_tokens"] > 0 and stats["evicted_blocks"] + stats["preemptions"] > 0
    assert outputs["auto"] == outputs["off"]


def _staggered(engine, prompts, rng_seed, flush=True) -> tuple[list[list[int]], dict]:
    """Add the prompts a few at a time while others run; lengths vary; check after every step
    (and flush the cache at the end, unless told not to)."""
    rng = random.Random(rng_seed)
    pending = list(enumerate(prompts))
    ids, done = {}, {}
    while pending or engine.has_unfinished_requests():
        for _ in range(rng.randrange(0, 3)):
            if pending:
                i, prompt = pending.pop(0)
                ids[engine.add_request(prompt, SamplingParams(max_tokens=3 + i % 7, **GREEDY))] = i
        for out in engine.step():
            if out.finished:
                done[ids[out.request_id]] = out.token_ids
        engine.check_integrity()
    stats = engine.stats()
    if flush:
        engine.flush_cache()
        engine.check_integrity()
    return [done[i] for i in range(len(prompts))], stats


def test_a_window_as_long_as_the_context_keeps_every_layer(tiny_model_dir):
    engine = engine_for(tiny_model_dir("gemma3"), max_model_len=6)
    assert not engine.runner.pool.hybrid and engine.pool.window is None


def test_the_text_tower_of_an_image_text_gemma3_equals_transformers(tmp_path):
    """A Gemma3ForConditionalGeneration directory serves its text tower (the vision tower's
    weights are left out): greedy text equals transformers' own image-text model on text."""
    from transformers import Gemma3ForConditionalGeneration

    from tiny_models import build_tiny_gemma3_image_text

    directory = build_tiny_gemma3_image_text(tmp_path)
    engine = engine_for(directory)
    assert engine.loaded.spec.family == "gemma3" and engine.runner.pool.hybrid
    reference = Gemma3ForConditionalGeneration.from_pretrained(directory, dtype=torch.float32).eval()
    for prompt in prompts_of([5, 23], seed=15, vocab=290):
        out = run_checked(engine, [prompt], 8)[0]
        ids = torch.tensor([prompt])
        want = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, min_new_tokens=8,
                                  do_sample=False)[0, len(prompt):].tolist()
        assert out.token_ids == want


def test_a_small_budget_holds_the_least_pages_inside_it(tiny_model_dir):
    """The window pages one request needs come out of kv_cache_memory, never on top of it."""
    memory = 64 * 1024
    engine = engine_for(tiny_model_dir("gemma3"), num_kv_blocks=None, kv_cache_memory=memory)
    pool = engine.runner.pool
    used = pool.kv.numel() * pool.kv.element_size() + pool.window_kv.numel() * pool.window_kv.element_size()
    assert used <= memory and engine.pool.window.num_pages == 20  # (6 + 64) / 4 + 2: the least
    with pytest.raises(ValueError, match="less than one request's window"):
        engine_for(tiny_model_dir("gemma3"), num_kv_blocks=None, kv_cache_memory=16 * 1024)


def test_a_shared_prefix_becomes_a_branch_that_keeps_its_window(tiny_model_dir):
    """A's prompt runs alone: its system prefix's end is no node end then, so its window is
    dropped. B shares the prefix: its match stops there (a tombstone), it computes the prefix
    again, and its own pages heal the cached blocks, now a branch end that keeps its window.
    C, a third prompt sharing the prefix, hits all of it."""
    directory = tiny_model_dir("gemma3")
    engine = engine_for(directory)
    system = prompts_of([24], seed=16)[0]  # six whole blocks
    a, b, c = (system + p for p in prompts_of([9, 11, 7], seed=17))
    assert run_checked(engine, [a], 4)[0].cached_tokens == 0
    assert run_checked(engine, [b], 4)[0].cached_tokens == 0  # the window before 24 is gone
    out = run_checked(engine, [c], 4)[0]
    assert out.cached_tokens == 24
    assert out.token_ids == hf_greedy(directory, c, 4)


# ---- page pressure: cached windows go before entries -------------------------------------------


def _cached_path(engine, tokens):
    """The cache's blocks for the leading full blocks of `tokens` (a tombstone's too)."""
    from radixserve.core.sliding_window import _path

    node = engine.cache.match_prefix(tokens, None).node
    return [b for n in reversed(_path(node)) for b in n.blocks]


def test_page_pressure_trims_the_least_valuable_windows_and_evicts_nothing(tiny_model_dir):
    """Three prompts leave their prompts' and replies' ends (four pages each, of 8): the third
    finds too few pages, and the windows that save the least compute per page go: a's (the
    oldest) whole, b's reply's end (4 tokens past its prompt's). A fourth takes b's prompt's
    end's page of its own and c's reply's end. Their blocks stay cached as tombstones,
    nothing is evicted. A follow-up to a recomputes it, equal to transformers, still without
    evicting anything."""
    directory = tiny_model_dir("gemma3")
    engine = engine_for(directory, num_kv_blocks=64, window_pages_ratio=0.125, chunked_prefill_size=8,
                        max_num_batched_tokens=16)
    window = engine.pool.window
    assert window.num_pages == 8
    a, b, c, d = prompts_of([14, 14, 14, 10], seed=21)
    outs = {}
    for name, prompt in zip("abc", (a, b, c)):
        outs[name] = run_checked(engine, [prompt], 3)[0]  # 16 computed: 4 blocks, an end at 16
    paths = {name: _cached_path(engine, p + outs[name].token_ids[:2]) for name, p in zip("abc", (a, b, c))}
    assert paths == {"a": [0, 1, 2, 3], "b": [4, 5, 6, 7], "c": [8, 9, 10, 11]}
    pages = lambda: {k: [window.page_of[x] for x in v] for k, v in paths.items()}  # noqa: E731
    assert pages() == {"a": [NO_PAGE] * 4, "b": [4, 5, 6, NO_PAGE], "c": [3, 7, 0, 1]}
    assert window.num_free == 1
    engine.add_request(d, SamplingParams(max_tokens=3, **GREEDY))
    trimmed = window.trimmed
    engine.step()  # d's first chunk (8 tokens) takes the free page and one more
    engine.check_integrity()
    engine.step()  # and its next block one more: c's reply's end's and b's prompt's end's own pages go
    engine.check_integrity()
    assert pages() == {"a": [NO_PAGE] * 4, "b": [NO_PAGE, 5, 6, NO_PAGE], "c": [3, 7, 0, NO_PAGE]}
    assert window.trimmed == trimmed + 2 and window.num_free == 0
    assert engine.cache.evicted_blocks == 0 and _cached_path(engine, a + outs["a"].token_ids[:2]) == [0, 1, 2, 3]
    while engine.has_unfinished_requests():
        engine.step()
        engine.check_integrity()
    follow = a + outs["a"].token_ids + [7, 8, 9]
    again = run_checked(engine, [follow], 4)[0]
    assert again.cached_tokens == 0  # the window before a's end was trimmed: recomputed
    assert again.token_ids == hf_greedy(directory, follow, 4)
    assert _cached_path(engine, follow)[:4] == [0, 1, 2, 3]  # the tree kept its own blocks for a's tokens
    assert engine.cache.evicted_blocks == 0 and engine.stats()["preemptions"] == 0


def test_a_window_on_a_running_requests_path_outlasts_the_unlocked_ones(tiny_model_dir):
    """A shared prefix S is a branch (two prompts went on from it) and keeps its window. While
    R, a third prompt on S, runs (S is locked), a newcomer Q under page pressure takes the
    unlocked ends' windows, never S's: when that is not enough it waits (or is preempted)
    until R is done. Outputs equal transformers; nothing is evicted."""
    directory = tiny_model_dir("gemma3")
    engine = engine_for(directory, num_kv_blocks=64, window_pages_ratio=0.125, chunked_prefill_size=8,
                        max_num_batched_tokens=16)
    window = engine.pool.window
    s, x, y, r, q = prompts_of([8, 6, 6, 9, 9], seed=23)
    for prompt in (s + x, s + y):
        run_checked(engine, [prompt], 1)
    s_blocks = engine.cache.match_prefix(s, None).blocks
    assert s_blocks == [0, 1] and [window.page_of[b] for b in s_blocks] == [0, 1]
    ends = [2, 6]  # the last blocks of s + x and s + y
    rid = engine.add_request(s + r, SamplingParams(max_tokens=12, **GREEDY))
    for _ in range(4):
        engine.step()
        engine.check_integrity()
    running = engine.scheduler.running[0]
    assert running.block_table[:2] == s_blocks and running.window_first == 2  # S is on R's path, out of its window
    qid = engine.add_request(q, SamplingParams(max_tokens=2, **GREEDY))
    done = {}
    while engine.has_unfinished_requests():
        r_running = any(req.request_id == rid for req in engine.scheduler.running)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
        engine.check_integrity()
        if r_running:
            assert [window.page_of[b] for b in s_blocks] == [0, 1]
    assert not any(window.has_page(b) for b in ends)  # the unlocked ends' windows went
    assert done[rid] == hf_greedy(directory, s + r, 12) and done[qid] == hf_greedy(directory, q, 2)
    assert engine.cache.evicted_blocks == 0


@pytest.mark.parametrize("seed", [3, 4])
def test_heavy_page_pressure_trims_windows_and_matches_every_layer_kept(tiny_model_dir, seed):
    """Shared-prefix traffic with few window pages and enough blocks: page pressure only trims
    windows (no entry is evicted) and the tokens equal keeping every layer's KV."""
    directory = tiny_model_dir("gemma3")
    rng = random.Random(seed)
    system = prompts_of([14], seed=seed + 200)[0]
    prompts: list[list[int]] = []
    for i in range(16):
        history = system + prompts_of([rng.randrange(2, 20)], seed=seed * 90 + i)[0]
        if prompts and rng.random() < 0.6:
            history = prompts[rng.randrange(len(prompts))] + prompts_of([rng.randrange(1, 9)], seed=seed * 30 + i)[0]
        prompts.append(history)
    options = dict(num_kv_blocks=160, window_pages_ratio=0.08, chunked_prefill_size=8, max_num_batched_tokens=16)
    outputs = {}
    for mode in ("auto", "off"):
        engine = engine_for(directory, hybrid_kv=mode, **options)
        outputs[mode], stats = _staggered(engine, prompts, rng_seed=seed)
        if mode == "auto":
            assert stats["window_pages_trimmed"] > 0 and stats["evicted_blocks"] == 0
            assert stats["cached_prompt_tokens"] > 0
    assert outputs["auto"] == outputs["off"]


def test_a_cold_hybrid_restore_after_a_restart_reads_its_window_slots_off_the_engine_thread(tiny_model_dir, tmp_path):
    """After a restart with the tier file's pages out of memory, the follow-up is held while
    the prefetch thread reads its 11 block slots and its 5 window slots in, then restores the
    whole first turn with transformers' tokens."""
    from radixserve.kv_tier.mapped_pages import MappedPages

    if not MappedPages().available:
        pytest.skip("page calls (mincore, madvise) are Linux only")
    directory, kv = tiny_model_dir("gemma3"), tmp_path / "kv"
    out = first_turn(directory, kv)
    engine = persisted(directory, kv)
    if engine.tiering.drop_cached_pages() != 0:
        pytest.skip("this filesystem keeps the tier file's pages in memory (tmpfs?)")
    follow = FIRST_TURN + out.token_ids + [11, 12, 13]
    windows = engine.cache.tier_only_window_slots(follow, None)
    store = engine.tiering.store
    assert len(windows) == 5 and all(store.pages.missing_pages(*store.window_span(w)) for w in windows)
    rid = engine.add_request(follow, SamplingParams(max_tokens=6, **GREEDY))
    assert engine.tiering.num_held == 1
    second = None
    while engine.has_unfinished_requests():
        second = next((o for o in engine.step() if o.request_id == rid and o.finished), second)
        engine.check_integrity()
    assert engine.stats()["tier_prefetched_blocks"] == 11
    assert not any(store.pages.missing_pages(*store.window_span(w)) for w in windows)
    assert second.cached_tokens == second.restored_tokens == 44
    assert second.token_ids == hf_greedy(directory, follow, 6)
    engine.close()


@pytest.mark.parametrize("seed, tier_bytes", [(0, 1 << 17), (1, 40 << 10)])
def test_random_traffic_across_restarts_matches_every_layer_kept(tiny_model_dir, tmp_path, seed, tier_bytes):
    """Shared-prefix traffic in three parts, the engine restarted between them on its persisted
    tier (a small pool and a tier of 24 blocks or about three times that: blocks move to the
    tier, entries are dropped from it, window slots are taken from older entries): every
    part's tokens equal those of an engine keeping every layer without a tier, later parts
    restore what earlier ones left, and every invariant holds after every step."""
    directory = tiny_model_dir("gemma3")
    rng = random.Random(seed)
    system = prompts_of([rng.randrange(8, 20)], seed=seed + 300)[0]
    prompts: list[list[int]] = []
    for i in range(18):
        history = system + prompts_of([rng.randrange(1, 24)], seed=seed * 40 + i)[0]
        if prompts and rng.random() < 0.6:  # a later turn of an earlier conversation
            history = prompts[rng.randrange(len(prompts))] + prompts_of([rng.randrange(1, 9)], seed=seed * 60 + i)[0]
        prompts.append(history)
    parts = [prompts[:6], prompts[6:12], prompts[12:]]
    options = dict(num_kv_blocks=40, window_pages_ratio=0.3, chunked_prefill_size=8, max_num_batched_tokens=16)
    full = engine_for(directory, hybrid_kv="off", **options)
    want = [_staggered(full, part, rng_seed=seed + k, flush=False)[0] for k, part in enumerate(parts)]
    restored = []
    for k, part in enumerate(parts):
        engine = persisted(directory, tmp_path / "kv", kv_offload_memory=tier_bytes, **options)
        assert engine.runner.pool.hybrid and (k == 0 or engine.tiering.loaded_blocks > 0)
        engine.check_integrity()
        got, stats = _staggered(engine, part, rng_seed=seed + k, flush=False)
        assert got == want[k]
        restored.append(stats["restored_prompt_tokens"])
        assert engine.flush_tier()
        engine.close()
    assert restored[1] > 0 and restored[2] > 0
