"""release_thread_pool and the EngineLoop's use of it: a thread that hands its parallel work
to another lets its OpenMP workers go, so the stepping thread's workers keep spinning
between parallel regions instead of sleeping (radixserve/kernels/openmp_pool.py)."""

from __future__ import annotations

import os
import queue
import threading
import time
from pathlib import Path

import pytest
import torch

from radixserve import Engine, SamplingParams
from radixserve.engine.cpu_share import usable_cores
from radixserve.engine.loop import EngineLoop
from radixserve.kernels.openmp_pool import release_thread_pool

TASKS = Path("/proc/self/task")
pytestmark = pytest.mark.skipif(not TASKS.exists() or usable_cores() < 2,
                                reason="needs /proc and two usable cores")


@pytest.fixture(autouse=True)
def _a_thread_per_core():
    """These tests count a team's OpenMP workers: one per usable core, as a process of its own
    has (a pytest-xdist worker's tests take a share of the cores, tests/xdist_rules.py)."""
    before = torch.get_num_threads()
    torch.set_num_threads(usable_cores())
    yield
    torch.set_num_threads(before)


def _threads() -> set[int]:
    return {int(t.name) for t in TASKS.iterdir()}


def _parallel_work() -> None:
    torch.randn(1 << 22).exp_()  # one torch op large enough to run on every OpenMP thread


def _voluntary_switches(tids: set[int]) -> int:
    total = 0
    for tid in tids:
        try:
            status = (TASKS / str(tid) / "status").read_text()
        except FileNotFoundError:  # ended meanwhile
            continue
        total += int(next(line.split()[1] for line in status.splitlines() if line.startswith("voluntary_ctxt_switches")))
    return total


def test_release_lets_the_calling_threads_workers_go():
    found: dict[str, object] = {}

    def on_a_thread_of_its_own():
        before = _threads()
        _parallel_work()
        found["workers"] = _threads() - before
        found["released"] = release_thread_pool()
        deadline = time.monotonic() + 5
        while found["workers"] & _threads() and time.monotonic() < deadline:
            time.sleep(0.01)
        found["left"] = found["workers"] & _threads()
        x = torch.arange(1 << 22, dtype=torch.float32)
        found["again"] = torch.equal(x.mul(2.0).sub_(x), x)  # a later region builds a new pool
        found["rebuilt"] = len(_threads() - before) == torch.get_num_threads() - 1

    thread = threading.Thread(target=on_a_thread_of_its_own)
    thread.start()
    thread.join()
    assert len(found["workers"]) == torch.get_num_threads() - 1  # the thread's pool, started by the op
    assert found["released"] is True and not found["left"]
    assert found["again"] and found["rebuilt"]


def test_an_engine_leaves_no_pool_on_the_thread_that_built_it(tiny_model_dir):
    """Loading runs parallel regions; after the build the thread's workers are gone, so its
    next region starts a pool anew (new threads) rather than reusing one."""
    found: dict[str, object] = {}

    def build():
        Engine(str(tiny_model_dir("llama")), num_kv_blocks=64)
        after_build = _threads()
        _parallel_work()
        found["new"] = _threads() - after_build

    thread = threading.Thread(target=build)
    thread.start()
    thread.join()
    assert len(found["new"]) == torch.get_num_threads() - 1, found


def test_an_engine_loop_steps_with_spinning_workers(tiny_model_dir):
    """Built and used on this thread (its pool exists), then stepped by a loop: the loop's
    decode steps must not put OpenMP workers to sleep between parallel regions. With two
    pools on two cores they did, a few times a region: hundreds of switches a step."""
    engine = Engine(str(tiny_model_dir("llama")), num_kv_blocks=64)
    engine.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0.0))
    _parallel_work()  # this thread's pool, as a server's start-up leaves it
    loop = EngineLoop(engine, name="test-engine")
    try:
        loop.call(lambda e: _parallel_work()).result(60)  # the loop thread's own pool
        outputs: queue.SimpleQueue = queue.SimpleQueue()
        main = threading.get_native_id()
        others = _threads() - {main}
        before = _voluntary_switches(others)
        steps = 48
        loop.submit([engine.prepare([1, 2, 3, 4], SamplingParams(max_tokens=steps, temperature=0.0,
                                                                  ignore_eos=True))], outputs.put)
        while not (item := outputs.get(timeout=60)).finished:
            pass
        switches = _voluntary_switches(others) - before
    finally:
        loop.shutdown(60)
    assert len(item.token_ids) == steps
    assert switches < 2 * steps, f"{switches} voluntary context switches over {steps} decode steps"


def test_releasing_beside_a_stepping_loop_changes_no_token(tiny_model_dir):
    """The PD copy thread releases its pool while the engine thread is inside its regions:
    the loop's greedy tokens are the same as with nothing beside it."""
    engine = Engine(str(tiny_model_dir("llama")), num_kv_blocks=64)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    prompts = [[1, 2, 3, 4], [9, 8, 7, 6, 5]]
    alone = [o.token_ids for o in engine.generate(prompts, params)]
    loop = EngineLoop(engine, name="test-engine")
    stop, released = threading.Event(), []

    def beside():
        while not stop.is_set():
            _parallel_work()
            released.append(release_thread_pool())

    other = threading.Thread(target=beside)
    other.start()
    try:
        outputs: queue.SimpleQueue = queue.SimpleQueue()
        ids = loop.submit([engine.prepare(p, params) for p in prompts], outputs.put).result(60)
        done = {}
        while len(done) < len(prompts):
            item = outputs.get(timeout=60)
            if item.finished:
                done[item.request_id] = item.token_ids
    finally:
        stop.set()
        other.join()
        loop.shutdown(60)
    assert [done[i] for i in ids] == alone
    assert released and all(released)
    engine.check_integrity()
