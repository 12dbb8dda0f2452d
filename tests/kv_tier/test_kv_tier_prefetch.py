"""Disk I/O of a file-backed second tier off the engine thread (tiny random model): a request
whose restore would read pages that are not in memory is held while the prefetch thread
reads them, then runs with the same greedy tokens; a hot restore is never held; an aborted
held request leaves nothing behind; the engine loop serves held requests; the slots the
tier hands out next are faulted in for writing ahead of use; the page calls themselves."""

from __future__ import annotations

import ctypes
import mmap
import os
import queue
import threading
import time

import pytest
import torch

from radixserve import Engine, SamplingParams
from radixserve.core.block_pool import BlockPool
from radixserve.kv_tier.index import KVTier
from radixserve.core.radix_cache import RadixCache
from radixserve.engine.loop import EngineLoop
from radixserve.kv_tier.mapped_pages import PAGE, MappedPages
from radixserve.kv_tier.store import TierStore
from radixserve.core.request import RequestStatus

pytestmark = pytest.mark.skipif(not MappedPages().available, reason="page calls (mincore, madvise) are Linux only")

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPT = [(7 * i) % 90 + 3 for i in range(150)]  # 9 whole blocks of 16 before the last token


def make_engine(model_dir, tmp_path, **kw) -> Engine:
    return Engine(str(model_dir), num_kv_blocks=32, kv_offload_memory=4 << 20,
                  kv_offload_dir=str(tmp_path), **kw)


def demote_all_and_drop_pages(engine: Engine) -> None:
    """Move every cached block to the tier (the copies run in an empty step), then drop the
    tier file's pages from memory, as after a restart or under memory pressure."""
    engine.cache.evict(engine.cache.num_evictable_blocks)
    assert engine.step() == []
    assert engine.cache.num_cached_blocks == 0 and engine.cache.num_tier_blocks >= 9
    if engine.tiering.drop_cached_pages() != 0:
        pytest.skip("this filesystem keeps the tier file's pages in memory (tmpfs?)")


def run_to_end(engine: Engine, request_id: str):
    final = None
    for _ in range(10_000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                final = out
    assert final is not None
    return final


def test_a_cold_restore_is_held_until_its_pages_are_read_in_and_gives_the_same_tokens(tiny_model_dir, tmp_path):
    engine = make_engine(tiny_model_dir("llama"), tmp_path)
    cold = engine.generate([PROMPT], GREEDY)[0]
    demote_all_and_drop_pages(engine)
    slots = engine.cache.tier_only_slots(PROMPT[:-1], None)
    assert len(slots) == 9 and engine.tiering.store.resident_pages(slots) == 0
    rid = engine.add_request(PROMPT, GREEDY)
    assert engine.tiering.num_held == 1 and engine.stats()["waiting"] == 1
    assert engine.has_unfinished_requests()
    assert [r.status for r in engine.scheduler.waiting] == [RequestStatus.PREFETCHING]  # a status, not a queue
    out = run_to_end(engine, rid)
    assert out.restored_tokens == 144 and out.cached_tokens == 144
    assert out.token_ids == cold.token_ids
    stats = engine.stats()
    assert stats["tier_prefetch_holds"] == 1 and stats["tier_prefetched_blocks"] == 9
    assert engine.tiering.num_held == 0
    engine.check_integrity()
    # pages in memory (the prefix is restored from the page cache): nothing is held
    engine.cache.evict(engine.cache.num_evictable_blocks)
    engine.step()
    rid = engine.add_request(PROMPT, GREEDY)
    assert engine.tiering.num_held == 0
    assert [r.status for r in engine.scheduler.waiting] == [RequestStatus.WAITING]
    again = run_to_end(engine, rid)
    assert again.restored_tokens == 144 and again.token_ids == cold.token_ids
    assert engine.stats()["tier_prefetch_holds"] == 1
    engine.check_integrity()


def test_other_requests_run_while_one_is_held(tiny_model_dir, tmp_path):
    engine = make_engine(tiny_model_dir("llama"), tmp_path)
    cold = engine.generate([PROMPT], GREEDY)[0]
    other = [(5 * i) % 80 + 4 for i in range(40)]  # nothing of it is cached
    demote_all_and_drop_pages(engine)
    engine.tiering.prefetch.max_hold_s = 60.0
    held = engine.add_request(PROMPT, GREEDY)
    free = engine.add_request(other, GREEDY)
    assert engine.tiering.num_held == 1
    waiting = [(r.request_id, r.status) for r in engine.scheduler.waiting]
    assert waiting == [(held, RequestStatus.PREFETCHING), (free, RequestStatus.WAITING)]
    outs = {}
    for _ in range(10_000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
    assert outs[held].token_ids == cold.token_ids and outs[held].restored_tokens == 144
    assert outs[free].cached_tokens == 0
    engine.check_integrity()
    assert engine.generate([other], GREEDY)[0].token_ids == outs[free].token_ids


def test_an_aborted_held_request_leaves_nothing_behind(tiny_model_dir, tmp_path):
    engine = make_engine(tiny_model_dir("llama"), tmp_path)
    engine.generate([PROMPT], GREEDY)
    demote_all_and_drop_pages(engine)
    rid = engine.add_request(PROMPT, GREEDY)
    assert engine.tiering.num_held == 1
    assert engine.abort(rid)
    assert engine.tiering.num_held == 0 and not engine.has_unfinished_requests()
    assert engine.stats()["waiting"] == 0 and rid not in engine.unfinished_request_ids()
    assert not engine.abort(rid)
    engine.check_integrity()
    assert engine.step() == []
    assert engine.tiering.ready() == []


def test_the_engine_loop_serves_a_held_request(tiny_model_dir, tmp_path):
    engine = make_engine(tiny_model_dir("llama"), tmp_path)
    cold = engine.generate([PROMPT], GREEDY)[0]
    demote_all_and_drop_pages(engine)
    loop = EngineLoop(engine, name="test-prefetch-loop")
    try:
        outputs: queue.SimpleQueue = queue.SimpleQueue()
        [rid] = loop.submit([engine.prepare(PROMPT, GREEDY)], outputs.put).result(60)
        final = None
        while final is None:
            item = outputs.get(timeout=60)
            assert not isinstance(item, BaseException), item
            final = item if item.finished else None
        assert final.request_id == rid and final.token_ids == cold.token_ids and final.restored_tokens == 144
        assert loop.call(lambda e: e.stats()["tier_prefetch_holds"]).result(60) == 1
        loop.call(lambda e: e.check_integrity()).result(60)
    finally:
        loop.shutdown(60)


def test_the_next_slots_the_tier_hands_out_are_faulted_in_for_writing(tiny_model_dir, tmp_path, monkeypatch):
    engine = make_engine(tiny_model_dir("llama"), tmp_path)
    prefetch = engine.tiering.prefetch
    populate = prefetch.pages.populate

    def slow_populate(*args, **kwargs):  # so wait_idle has a warm-up still running to wait for
        time.sleep(0.002)
        return populate(*args, **kwargs)

    monkeypatch.setattr(prefetch.pages, "populate", slow_populate)
    engine.generate([PROMPT], GREEDY)  # the first step's copies send the window to the thread
    assert prefetch.wait_idle()
    assert prefetch.warmed_blocks >= prefetch.window_slots > 0
    store, tier = engine.tiering.store, engine.tiering.slots
    window = tier.peek_free(prefetch.window_slots)
    assert all(store.pages.missing_pages(*store.slot_span(s)) == 0 for s in window)
    assert engine.stats()["tier_warmed_blocks"] == prefetch.warmed_blocks
    engine.check_integrity()


def test_the_next_window_slots_are_faulted_in_for_writing_too(tiny_model_dir, tmp_path):
    """Hybrid KV: the window slots the tier hands out next are faulted in ahead as its block
    slots are (a saved window's pages would otherwise fault on the engine thread's copy)."""
    engine = make_engine(tiny_model_dir("gemma3"), tmp_path)
    prefetch, store, tier = engine.tiering.prefetch, engine.tiering.store, engine.tiering.window_slots
    assert engine.runner.pool.hybrid and tier is not None
    engine.generate([PROMPT], GREEDY)
    assert prefetch.wait_idle()
    ahead = tier.peek_free(tier.num_slots // 4)  # (the count the prefetcher keeps warm on so small a tier)
    assert prefetch.warmed_window_pages >= len(ahead) > 0
    assert all(store.pages.missing_pages(*store.window_span(w)) == 0 for w in ahead)
    engine.check_integrity()


def test_tier_only_slots_reads_the_tree_without_changing_it():
    pool = BlockPool(8)
    cache = RadixCache(pool, 2, KVTier(8))
    blocks = pool.allocate(4)
    cache.insert([1, 2, 3, 4, 5, 6, 7, 8], blocks)
    pool.free(reversed(blocks))
    cache.evict(2)  # the deepest two blocks move to the tier
    slots = [c.slot for c in cache.take_copies()]
    nodes = cache.num_nodes
    assert sorted(cache.tier_only_slots([1, 2, 3, 4, 5, 6, 7, 8, 9], None)) == sorted(slots)
    assert len(cache.tier_only_slots([1, 2, 3, 4, 5, 6, 0, 0], None)) == 1  # the match ends inside
    assert cache.tier_only_slots([1, 2, 3, 4], None) == []  # the pool part only
    assert cache.tier_only_slots([9, 9, 9], None) == [] and cache.tier_only_slots([1, 2], "salt") == []
    assert cache.num_nodes == nodes
    cache.check_integrity()


def test_page_calls_on_a_file_mapping(tmp_path):
    pages = MappedPages()
    size = 64 * PAGE
    fd = os.open(tmp_path / "f.bin", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, size)
        memory = mmap.mmap(fd, size)
        addr = ctypes.addressof(ctypes.c_char.from_buffer(memory))
        assert pages.missing_pages(addr, size) == 64  # a sparse file: nothing read yet
        assert pages.populate(addr, size, write=True)
        assert pages.missing_pages(addr, size) == 0
        memory[:5] = b"hello"
        pages.sync(addr + 3, 10)  # any sub-range: widened to whole pages
        assert os.pread(fd, 5, 0) == b"hello"
        assert pages.populate(addr + 1, PAGE, write=False)  # faulting in changes no byte
        assert memory[:5] == b"hello" and memory[PAGE:PAGE + 4] == bytes(4)
    finally:
        os.close(fd)


@pytest.mark.serial
def test_writing_the_tier_back_leaves_the_gil_to_other_threads(tmp_path):
    """The persistence thread's sync waits on the disk without the GIL (mmap.flush holds it:
    the engine thread would stop for the whole write-back)."""
    store = TierStore(64, (32, 2, 16, 4, 64), torch.float32, str(tmp_path))  # 128 MiB
    for _ in range(3):  # the kernel may write pages back on its own first: dirty them again
        store.data.normal_()  # every page dirty
        start, end, beats = _timed_write_back(store)
        if end - start >= 0.02:
            break
    else:
        pytest.skip(f"the write-back took {1000 * (end - start):.1f} ms three times: too quick to tell")
    inside = [start] + [t for t in beats if start < t < end] + [end]
    longest = max(b - a for a, b in zip(inside, inside[1:]))
    assert longest < 0.5 * (end - start), f"other threads stopped for {longest * 1000:.0f} ms of a {(end - start) * 1000:.0f} ms sync"
    store.close()


def _timed_write_back(store: TierStore) -> tuple[float, float, list[float]]:
    """(start, end) of a sync of every slot on another thread, and when this thread ran meanwhile."""
    span: list[float] = []

    def write_back() -> None:
        span.append(time.perf_counter())
        store.sync(range(store.num_slots))
        span.append(time.perf_counter())

    beats: list[float] = []
    worker = threading.Thread(target=write_back)
    worker.start()
    while worker.is_alive():
        beats.append(time.perf_counter())
    worker.join()
    return span[0], span[1], beats
