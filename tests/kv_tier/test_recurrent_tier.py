"""Recurrent-state snapshots in the second tier (core/recurrent_snapshots.py, kv_tier/): a node
whose blocks demote takes its snapshot into a tier state slot and frees its memory row; a
request resuming through the tier restores the blocks and starts from that state, computing
only its new tokens, greedy-equal to transformers; a persisted tier brings the states back
after a restart; tenants keep their own; integrity after every step, nothing held after a flush."""

from __future__ import annotations

import json
import random

import pytest
import torch

from radixserve import Engine
from radixserve.core.kv_events import RECURRENT, TIER, BlockStored, KVEventLog
from radixserve.kv_tier.persist import INDEX_FILE
from radixserve.kv_tier.store import TIER_FILE
from tiny_models import hf_greedy, run_checked


def tokens(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(3, 97) for _ in range(n)]


def engine_of(directory, **options):
    defaults = dict(block_size=4, num_kv_blocks=24, chunked_prefill_size=16, max_num_batched_tokens=32,
                    kv_offload_memory=2 << 20)
    return Engine(str(directory), **{**defaults, **options})


def push_out(engine, n, seed):
    """Other prompts that take the whole pool: what was cached before moves to the tier."""
    run_checked(engine, [tokens(41, seed + i) for i in range(n)], 4)


@pytest.mark.parametrize("kind", ["lfm2", "qwen3_5"])
def test_a_prefix_resumed_through_the_tier_starts_from_its_tier_state(tiny_model_dir, kind):
    directory = tiny_model_dir(kind)
    engine = engine_of(directory)
    snapshots, store = engine.kv.snapshots, engine.tiering.store
    assert snapshots.tier is not None and store.state_slot_bytes == engine.runner.states.slot_bytes
    # the state slots' bytes come out of the tier's own budget: one per 8 block slots
    assert store.num_state_slots == store.num_slots // 8
    assert store.num_slots * store.slot_bytes + store.num_state_slots * store.state_slot_bytes <= 2 << 20
    prompt = tokens(41, 1)
    (first,) = run_checked(engine, [prompt], 4, cache_salt="a")
    push_out(engine, 2, seed=10)
    assert snapshots.num_in_tier >= 3  # the prompt's chunk ends 16, 32 and 40 (and its reply's 44)
    assert all(node.blocks for node in snapshots._node.values()), "a demoted node kept its memory row"
    retry = prompt + first.token_ids[:3] + tokens(2, 3)  # the next turn: resumes at the reply's end, 44
    (second,) = run_checked(engine, [retry], 6, cache_salt="a")
    assert second.cached_tokens == 44 and second.restored_tokens == 36  # the reply's end; 9 blocks from the tier
    assert second.token_ids == hf_greedy(directory, retry, 6)
    stats = engine.stats()
    assert stats["recurrent_snapshot_tier_restores"] == 1 and stats["recurrent_snapshots_in_tier"] >= 3
    slot = next(iter(engine.kv.tier_snapshot_positions()))
    engine.runner.states.tier_positions[slot] += 4  # the runner's record of a tier slot disagrees
    with pytest.raises(AssertionError, match="recurrent states in tier slots stand at"):
        engine.check_integrity()
    engine.runner.states.tier_positions[slot] -= 4
    (other,) = run_checked(engine, [retry], 6, cache_salt="b")  # another tenant: nothing of a's
    assert other.cached_tokens == 0 and other.token_ids == second.token_ids
    engine.flush_cache()
    engine.check_integrity()
    assert snapshots.num_used == 0 and snapshots.num_in_tier == 0 and snapshots.tier.num_free == snapshots.tier.num_slots


def test_tier_states_are_events_in_the_tier_medium(tiny_model_dir):
    engine = engine_of(tiny_model_dir("lfm2"))
    events = engine.kv.cache.event_log = KVEventLog()
    run_checked(engine, [tokens(41, 1)], 4)
    push_out(engine, 2, seed=10)
    mine = [e for e in events.take() if e.group == RECURRENT and e.medium == TIER]
    stored = [e for e in mine if isinstance(e, BlockStored)]
    assert stored and len(stored) - (len(mine) - len(stored)) == engine.kv.snapshots.num_in_tier
    engine.flush_cache()
    mine += [e for e in events.take() if e.group == RECURRENT and e.medium == TIER]
    assert 2 * sum(isinstance(e, BlockStored) for e in mine) == len(mine)  # each removed again


@pytest.mark.parametrize("spoil", [False, True])
def test_a_persisted_tier_brings_the_states_back_after_a_restart(tiny_model_dir, tmp_path, spoil):
    """Spoiled: the reply end's state fails its checksum, is ignored, and the request resumes
    from the state before it."""
    directory = tiny_model_dir("qwen3_5")
    prompt = tokens(41, 1)
    first = engine_of(directory, num_kv_blocks=64, kv_persist_dir=str(tmp_path))
    (cold,) = run_checked(first, [prompt], 4, cache_salt="a")
    assert first.flush_tier()
    kept = first.kv.snapshots.num_in_tier
    assert kept >= 3  # written through: each kept state has a tier copy
    offset, size = first.tiering.store.state_offset, first.tiering.store.state_slot_bytes
    first.close()
    states = json.loads((tmp_path / INDEX_FILE).read_bytes().partition(b"\n")[2])["states"]
    assert len(states) == kept
    if spoil:
        slot = next(entry[0] for entry in states if entry[3] == 44)
        with open(tmp_path / TIER_FILE, "r+b") as f:
            f.seek(offset + slot * size)
            flipped = bytes(b ^ 0xFF for b in f.read(16))
            f.seek(offset + slot * size)
            f.write(flipped)
    again = engine_of(directory, num_kv_blocks=64, kv_persist_dir=str(tmp_path))
    assert again.tiering.loaded_states == kept - spoil and again.kv.snapshots.num_kept == 0
    again.check_integrity()
    retry = prompt + cold.token_ids[:3] + tokens(2, 3)
    (warm,) = run_checked(again, [retry], 6, cache_salt="a")
    resumed = 40 if spoil else 44
    assert warm.cached_tokens == resumed and warm.restored_tokens == resumed
    assert warm.token_ids == hf_greedy(directory, retry, 6)
    (other,) = run_checked(again, [retry], 6, cache_salt="b")
    assert other.cached_tokens == 0
    again.close()


def test_a_state_paged_out_of_a_file_backed_tier_is_read_in_before_its_request_runs(tiny_model_dir, tmp_path):
    directory = tiny_model_dir("lfm2")
    engine = engine_of(directory, kv_offload_dir=str(tmp_path))
    if engine.tiering.prefetch is None:
        pytest.skip("page calls (mincore, madvise) are Linux only")
    prompt = tokens(41, 1)
    run_checked(engine, [prompt], 4)
    push_out(engine, 2, seed=10)
    run_checked(engine, [prompt], 1)  # resumes at 40 from the tier: blocks back in the pool, the state stays there
    node = engine.kv.peek_prefix(prompt[:40])[1]
    slot = engine.kv.snapshots._tier_of[node.node_id]
    assert node.blocks and node.node_id not in engine.kv.snapshots._of_node
    if engine.tiering.drop_cached_pages() != 0:
        pytest.skip("this filesystem keeps the tier file's pages in memory (tmpfs?)")
    store = engine.tiering.store
    assert store.pages.missing_pages(*store.state_span(slot))
    (again,) = run_checked(engine, [prompt + [5, 6]], 4)
    stats = engine.stats()
    assert stats["tier_prefetch_holds"] == 1 and stats["tier_prefetched_blocks"] == 0  # held for its state alone
    assert again.cached_tokens == 40 and again.token_ids == hf_greedy(directory, prompt + [5, 6], 4)


def test_large_states_take_at_most_a_quarter_of_the_tier():
    """One state slot per 8 block slots, unless that is more than a quarter of the tier's
    bytes: states of a large Mamba2 model must not crowd out the blocks."""
    from radixserve.config import EngineConfig
    from radixserve.kv_tier.tiering import Tiering

    size, block_shape = 4 << 20, (2, 2, 16, 4, 16)  # 16 KiB float32 blocks
    small = Tiering.build(EngineConfig(kv_offload_memory=size), torch.nn.Module(), block_shape, torch.float32, {},
                          state_bytes=40_000)
    large = Tiering.build(EngineConfig(kv_offload_memory=size), torch.nn.Module(), block_shape, torch.float32, {},
                          state_bytes=300_000)
    try:
        # 4 MiB // (16,384 + 40,000 / 8) = 196 block slots, 24 state slots (23% of the bytes)
        assert (small.store.num_slots, small.store.num_state_slots) == (196, 24)
        # by the ratio alone 77 block slots and 9 state slots (64%); capped: 3 state slots
        # (1 MiB // 300,000) and 201 block slots in the 3,294,304 bytes left
        assert (large.store.num_slots, large.store.num_state_slots) == (201, 3)
        assert large.state_slots.num_slots == 3
    finally:
        small.close()
        large.close()
