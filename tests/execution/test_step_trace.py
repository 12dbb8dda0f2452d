"""The step trace (EngineConfig.step_trace, --step-trace): one JSON line per step on the clock
every process shares, written off the engine thread; a bad path refused up front, a failed
write never failing the step."""

from __future__ import annotations

import json
import time

import pytest

from radixserve import Engine, SamplingParams

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def test_step_trace_writes_one_line_per_step_on_the_shared_clock(tiny_model_dir, tmp_path):
    path = tmp_path / "steps.jsonl"
    engine = Engine(str(tiny_model_dir("llama")), step_trace=str(path), chunked_prefill_size=8)
    before = time.monotonic()
    engine.generate([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [11, 12]], GREEDY)
    after = time.monotonic()
    engine.close()
    steps = [json.loads(line) for line in path.read_text().splitlines()]
    assert all(before < s["end"] < after and s["ms"] > 0 for s in steps)
    assert [s["end"] for s in steps] == sorted(s["end"] for s in steps)
    assert sum(s["prefill"] for s in steps) == 12, "every prompt token once"
    assert sum(s["decode"] for s in steps) == 2 * 3, "every later output token once"
    assert (steps[0]["decode"], steps[0]["prefill"]) == (0, 10)  # 8 + 2: both prompts' first chunks


@pytest.mark.parametrize("where", ["a directory", "no such directory"])
def test_a_bad_trace_path_is_refused_before_anything_starts(tiny_model_dir, tmp_path, where):
    path = tmp_path if where == "a directory" else tmp_path / "missing" / "steps.jsonl"
    with pytest.raises(ValueError, match="step_trace"):
        Engine(str(tiny_model_dir("llama")), step_trace=str(path))


def test_a_failed_trace_write_turns_the_trace_off_and_keeps_the_step(tiny_model_dir, tmp_path, caplog):
    engine = Engine(str(tiny_model_dir("llama")), step_trace=str(tmp_path / "steps.jsonl"))
    engine.step_trace._file.close()  # every later write raises ValueError, as a full disk raises OSError
    out = engine.generate([[1, 2, 3]], GREEDY)[0]
    assert len(out.token_ids) == 4
    engine.close()  # waits for the trace's thread
    assert engine.step_trace._failed and "step trace" in caplog.text
    assert not engine.step_trace._thread.is_alive()
    engine.check_integrity()


def test_the_engine_thread_only_queues(tiny_model_dir, tmp_path):
    engine = Engine(str(tiny_model_dir("llama")), step_trace=str(tmp_path / "steps.jsonl"))
    assert engine.step_trace._thread.name == "radixserve-step-trace" and engine.step_trace._thread.is_alive()
    engine.generate([[1, 2, 3]], GREEDY)
    engine.close()
    engine.close()  # idempotent
    assert len((tmp_path / "steps.jsonl").read_text().splitlines()) == 4


def test_bench_latency_tail_anatomy_lines_gaps_up_with_steps():
    from bench.bench_latency import RunResult, tail_anatomy
    from bench.lib.client import Record

    stream = Record("x", 10.0, chunks=[10.5, 10.55, 10.9, 10.95, 11.3])  # gaps 50, 350, 50, 350 ms
    run = RunResult("c", "no-sharing", [stream], start=10.0, duration_s=2.0)
    steps = [
        {"end": 10.55, "ms": 50.0, "decode": 1, "prefill": 0},
        {"end": 10.9, "ms": 340.0, "decode": 1, "prefill": 400},  # inside the first long gap
        {"end": 10.95, "ms": 50.0, "decode": 1, "prefill": 0},
        {"end": 11.3, "ms": 340.0, "decode": 1, "prefill": 0},  # the second: decodes only
        {"end": 13.0, "ms": 50.0, "decode": 1, "prefill": 0},  # after the run: not counted
    ]
    a = tail_anatomy(run, steps, 0.12)
    assert (a["gaps"], a["long"], a["with_prompt"], a["steps"]) == (4, 2, 1, 4)
    assert a["plain_ms"] == [50.0, 50.0, 340.0] and a["mixed_ms"] == [340.0]
    assert tail_anatomy(run, steps[4:], 0.12) is None
