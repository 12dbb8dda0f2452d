"""The step trace (EngineConfig.step_trace, --step-trace): one JSON line per step on the clock
every process shares, a bad path refused up front, a failed write never failing the step."""

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
    engine._step_trace.close()  # every later write raises ValueError, as a full disk raises OSError
    out = engine.generate([[1, 2, 3]], GREEDY)[0]
    assert len(out.token_ids) == 4 and engine._step_trace is None
    assert "step trace" in caplog.text
    engine.check_integrity()
