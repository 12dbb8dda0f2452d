"""The soak of bench/soak.py for 170 calls, a fifth of them warm-up (issue 29, point 3; the ten-minute run is
`python -m bench.soak`): every route, two keys, drops, aborts, bad inputs and flushes; the
server ends idle and intact, without leaks, and no key sees the other's text or ids. A count of
calls, not a time, ends it, so it needs no quiet machine: it runs beside the other tests."""

from __future__ import annotations

import json

import pytest

from bench import soak

pytestmark = [pytest.mark.slow, pytest.mark.real_model]

CALLS = 170  # what 36 s of the soak made alone on two cores


def test_a_short_soak_holds(real_model_dir, tmp_path):
    out = tmp_path / "soak.json"
    # RSS is far from steady a fifth of the way in: the short run's bound is loose (the ten-minute run's is 5%)
    assert soak.main(["--minutes", "3", "--calls", str(CALLS), "--workers", "4", "--rss-bound", "0.25",
                      "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["calls"] >= CALLS and not report["failures"] and not report["leaks"]  # not cut by the 3 minutes
    assert len(report["rss_samples"]) >= 3  # the warm sample and the bound's samples after it
    kinds = {name.split(":")[0] for name in report["outcomes"]}
    assert {"chat", "completion", "responses", "generate", "dropped_stream", "bad_input", "flush", "session",
            "foreign response id", "foreign rid"} <= kinds
