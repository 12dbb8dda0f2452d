"""EngineLoop on a tiny random model: all-or-none submit, call, abort, the one recovery
rule for a failed step (consistent engine: keep serving; inconsistent: broken), shutdown."""

from __future__ import annotations

import queue
import threading

import pytest

from radixserve import Engine, SamplingParams
from radixserve.engine.loop import EngineBrokenError, EngineLoop, EngineStoppedError, RequestFailedError
from radixserve.outputs import RequestOutput
from tiny_models import hf_greedy

GREEDY = dict(temperature=0.0, ignore_eos=True)
TIMEOUT = 60


@pytest.fixture(scope="module")
def directory(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture
def engine(directory):
    return Engine(str(directory), block_size=4, num_kv_blocks=128, chunked_prefill_size=7, max_num_batched_tokens=16)


@pytest.fixture
def loop(engine):
    loop = EngineLoop(engine, name="test-engine")
    yield loop
    loop.shutdown(TIMEOUT)
    assert not loop.alive


def finals(outputs: queue.SimpleQueue, count: int) -> dict[str, RequestOutput | BaseException]:
    """Wait for `count` final outputs (or errors, keyed by arrival order)."""
    done: dict[str, RequestOutput | BaseException] = {}
    while len(done) < count:
        item = outputs.get(timeout=TIMEOUT)
        if isinstance(item, BaseException):
            done[f"error-{len(done)}"] = item
        elif item.finished:
            done[item.request_id] = item
    return done


def idle_and_intact(loop: EngineLoop) -> None:
    def check(engine: Engine) -> None:
        engine.check_integrity()
        assert not engine.has_unfinished_requests()
        assert engine.pool.num_free + engine.cache.num_evictable_blocks == engine.pool.num_blocks

    loop.call(check).result(TIMEOUT)


def test_submitted_requests_run_greedy_and_together(loop, engine, directory):
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13]]
    outputs: queue.SimpleQueue = queue.SimpleQueue()
    prepared = [engine.prepare(p, SamplingParams(max_tokens=8, **GREEDY)) for p in prompts]
    ids = loop.submit(prepared, outputs.put, ["a", "b"]).result(TIMEOUT)
    assert ids == ["a", "b"]
    done = finals(outputs, 2)
    for request_id, prompt in zip(ids, prompts):
        assert done[request_id].token_ids == hf_greedy(directory, prompt, 8)
    idle_and_intact(loop)


def test_each_output_carries_what_it_adds_and_the_deltas_assemble_to_the_final_output(loop, engine):
    outputs: queue.SimpleQueue = queue.SimpleQueue()
    prepared = engine.prepare([5, 6, 7], SamplingParams(max_tokens=12, logprobs=2, **GREEDY))
    loop.submit([prepared], outputs.put, ["d"]).result(TIMEOUT)
    seen: list[RequestOutput] = []
    while not (seen and seen[-1].finished):
        seen.append(outputs.get(timeout=TIMEOUT))
    final = seen[-1]
    assert [o.delta.first for o in seen] == [True] + [False] * (len(seen) - 1)
    assert [t for o in seen for t in o.delta.token_ids] == final.token_ids
    assert [lp for o in seen for lp in o.delta.logprobs] == final.logprobs
    assert "".join(o.delta.text for o in seen) == final.text
    assert all(len(o.delta.token_ids) == len(o.token_ids) - len(p.token_ids) for p, o in zip(seen, seen[1:]))
    idle_and_intact(loop)


def test_submit_is_all_or_none(loop, engine):
    outputs: queue.SimpleQueue = queue.SimpleQueue()
    keep = engine.prepare([1, 2, 3], SamplingParams(max_tokens=40, **GREEDY))
    loop.submit([keep], outputs.put, ["taken"]).result(TIMEOUT)
    batch = [engine.prepare([4, 5], SamplingParams(max_tokens=4)) for _ in range(3)]
    with pytest.raises(ValueError, match="already in use"):
        loop.submit(batch, outputs.put, ["x", "y", "taken"]).result(TIMEOUT)
    assert loop.call(lambda e: e.unfinished_request_ids()).result(TIMEOUT) == ["taken"]
    with pytest.raises(ValueError, match="admitted already"):  # "x" was admitted, then withdrawn
        loop.submit([batch[0]], outputs.put).result(TIMEOUT)
    done = finals(outputs, 1)
    assert list(done) == ["taken"] and len(done["taken"].token_ids) == 40
    idle_and_intact(loop)


def test_call_runs_between_steps_and_hands_back_errors(loop):
    assert loop.call(lambda e: e.stats()["blocks_total"]).result(TIMEOUT) == 128
    with pytest.raises(KeyError):
        loop.call(lambda e: {}["missing"]).result(TIMEOUT)
    assert loop.call(lambda e: threading.current_thread().name).result(TIMEOUT) == "test-engine"
    assert loop.healthy


def test_abort_frees_the_blocks_and_silences_the_listener(loop, engine):
    outputs: queue.SimpleQueue = queue.SimpleQueue()
    first = threading.Event()

    def listener(item):
        outputs.put(item)
        first.set()

    long = engine.prepare([3] * 20, SamplingParams(max_tokens=100, **GREEDY))
    (request_id,) = loop.submit([long], listener).result(TIMEOUT)
    assert first.wait(TIMEOUT)
    loop.abort([request_id])
    idle_and_intact(loop)
    seen = []
    while not outputs.empty():
        seen.append(outputs.get())
    assert all(isinstance(o, RequestOutput) and not o.finished for o in seen)
    assert len(seen) < 100


def test_a_failed_step_fails_the_requests_in_flight_and_the_loop_keeps_serving(loop, engine, directory, monkeypatch):
    real_step = engine.step
    calls = {"n": 0}

    def failing_once():
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected step failure")
        return real_step()

    monkeypatch.setattr(engine, "step", failing_once)
    outputs: queue.SimpleQueue = queue.SimpleQueue()
    prepared = [engine.prepare([7, 8, 9], SamplingParams(max_tokens=30, **GREEDY)) for _ in range(2)]
    loop.submit(prepared, outputs.put).result(TIMEOUT)
    errors = list(finals(outputs, 2).values())
    assert all(isinstance(e, RequestFailedError) for e in errors)
    assert "the engine failed on this request: RuntimeError: injected step failure" in str(errors[0])
    idle_and_intact(loop)
    assert loop.healthy and loop.broken_reason is None
    again = engine.prepare([7, 8, 9], SamplingParams(max_tokens=5, **GREEDY))
    (request_id,) = loop.submit([again], outputs.put).result(TIMEOUT)
    assert finals(outputs, 1)[request_id].token_ids == hf_greedy(directory, [7, 8, 9], 5)
    idle_and_intact(loop)


def test_an_inconsistent_engine_is_broken_and_refuses_work(engine, monkeypatch):
    def broken_step():
        raise RuntimeError("injected step failure")

    def broken_check():
        raise AssertionError("injected integrity failure")

    monkeypatch.setattr(engine, "step", broken_step)
    monkeypatch.setattr(engine, "check_integrity", broken_check)
    loop = EngineLoop(engine)
    outputs: queue.SimpleQueue = queue.SimpleQueue()
    loop.submit([engine.prepare([1, 2], SamplingParams(max_tokens=3))], outputs.put).result(TIMEOUT)
    error = outputs.get(timeout=TIMEOUT)
    assert isinstance(error, RequestFailedError) and "injected integrity failure" in str(error)
    loop.shutdown(TIMEOUT)
    assert not loop.healthy and "injected integrity failure" in loop.broken_reason
    with pytest.raises(EngineBrokenError, match="injected integrity failure"):
        loop.submit([engine.prepare([1, 2], SamplingParams(max_tokens=3))], outputs.put).result(TIMEOUT)
    with pytest.raises(EngineBrokenError):
        loop.call(lambda e: e.stats()).result(TIMEOUT)
    monkeypatch.undo()
    engine.check_integrity()
    assert not engine.has_unfinished_requests()


def test_shutdown_fails_pending_listeners_and_refuses_later_work(engine):
    loop = EngineLoop(engine)
    outputs: queue.SimpleQueue = queue.SimpleQueue()
    long = [engine.prepare([4] * 10, SamplingParams(max_tokens=200, **GREEDY)) for _ in range(3)]
    loop.submit(long, outputs.put).result(TIMEOUT)
    loop.shutdown(TIMEOUT)
    assert not loop.alive and not loop.healthy
    errors = [e for e in finals(outputs, 3).values()]
    assert all(isinstance(e, EngineStoppedError) for e in errors)
    with pytest.raises(EngineStoppedError, match="shut down"):
        loop.submit([engine.prepare([1], SamplingParams(max_tokens=2))], outputs.put).result(TIMEOUT)
    with pytest.raises(EngineStoppedError):
        loop.call(lambda e: e.stats()).result(TIMEOUT)
    loop.shutdown(TIMEOUT)  # idempotent
    engine.check_integrity()
    assert not engine.has_unfinished_requests()
    assert len(engine.generate([[1, 2, 3]], SamplingParams(max_tokens=3, **GREEDY))[0].token_ids) == 3



def test_an_idle_loop_hands_the_freed_heap_back_once_after_working(engine, monkeypatch):
    import radixserve.engine.loop as loop_module

    trims = []
    monkeypatch.setattr(loop_module, "IDLE_TRIM_S", 0.05)
    monkeypatch.setattr(loop_module, "return_freed_memory", lambda: trims.append(1) or True)
    loop = EngineLoop(engine, name="test-trim")
    try:
        threading.Event().wait(0.3)
        assert trims == []  # never worked: nothing to hand back
        outputs: queue.SimpleQueue = queue.SimpleQueue()
        loop.submit([engine.prepare([5, 6, 7], SamplingParams(max_tokens=4, **GREEDY))], outputs.put, ["t"]).result(TIMEOUT)
        finals(outputs, 1)
        for _ in range(100):
            if trims:
                break
            threading.Event().wait(0.05)
        threading.Event().wait(0.3)
        assert trims == [1] and loop.heap_trims == 1  # once per idle spell, not every IDLE_TRIM_S
        idle_and_intact(loop)
    finally:
        loop.shutdown(TIMEOUT)


def test_a_busy_loop_hands_the_freed_heap_back_every_busy_trim_s(engine, monkeypatch):
    import radixserve.engine.loop as loop_module

    trims = []
    monkeypatch.setattr(loop_module, "IDLE_TRIM_S", 3600.0)  # never idle long enough: only the busy rule trims
    monkeypatch.setattr(loop_module, "BUSY_TRIM_S", 0.0)  # every step
    monkeypatch.setattr(loop_module, "return_freed_memory", lambda: trims.append(1) or True)
    loop = EngineLoop(engine, name="test-busy-trim")
    try:
        outputs: queue.SimpleQueue = queue.SimpleQueue()
        loop.submit([engine.prepare([5, 6, 7], SamplingParams(max_tokens=6, **GREEDY))], outputs.put, ["b"]).result(TIMEOUT)
        finals(outputs, 1)
        steps = loop.call(lambda e: e.generated_tokens).result(TIMEOUT)
        assert len(trims) == loop.heap_trims >= steps >= 6  # a trim after each step (prompt and decodes)
        idle_and_intact(loop)
    finally:
        loop.shutdown(TIMEOUT)


def test_stats_are_taken_every_refresh_interval_after_each_finished_reply_and_when_idle(engine, monkeypatch):
    """A snapshot every step cost ~16 us of Python a step: it is taken at most every
    STATS_REFRESH_S while requests run, always before a finished reply goes out (its client sees
    its step counted), and before the loop idles (the stats then exact)."""
    import radixserve.engine.loop as loop_module

    monkeypatch.setattr(loop_module, "STATS_REFRESH_S", 3600.0)  # only the finish and idle rules refresh
    taken, seen_at_finish = [], []
    snapshot = engine.snapshot
    monkeypatch.setattr(engine, "snapshot", lambda: taken.append(1) or snapshot())
    loop = EngineLoop(engine, name="test-stats")
    try:
        outputs: queue.SimpleQueue = queue.SimpleQueue()

        def listener(output: RequestOutput) -> None:
            if output.finished:
                seen_at_finish.append(loop.latest_snapshot.generated_tokens)
            outputs.put(output)

        before = len(taken)
        loop.submit([engine.prepare([5, 6, 7], SamplingParams(max_tokens=12, **GREEDY))], listener, ["s"]).result(TIMEOUT)
        finals(outputs, 1)
        steps = loop.call(lambda e: e.snapshot().steps).result(TIMEOUT)
        assert steps >= 12 and seen_at_finish == [12]
        assert len(taken) - before <= 4  # admission, the finishing step, idle, the call: not one a step
        assert loop.latest_snapshot.generated_tokens == 12
        idle_and_intact(loop)
    finally:
        loop.shutdown(TIMEOUT)
