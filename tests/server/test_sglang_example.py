"""examples/sglang_fewshot.py (an SGLang program run with `--url`) against a live server:
it routes its messages and reports the prefix-cache hit rate it achieved."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from radixserve.server import ServerOptions, create_app
from radixserve.server.testing import BackgroundServer

pytestmark = pytest.mark.real_model

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "sglang_fewshot.py"


def test_sglang_example_runs_against_a_server(served_engine, capsys):
    pytest.importorskip("sglang")  # the `sglang` extra (scripts/setup.sh installs it)
    spec = importlib.util.spec_from_file_location("sglang_fewshot", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    served_engine.flush_cache()
    with BackgroundServer(create_app(served_engine, ServerOptions())) as server:
        assert module.main(["--url", server.url, "--limit", "3"]) == 0
    served_engine.check_integrity()
    assert not served_engine.has_unfinished_requests()
    served_engine.flush_cache()
    out = capsys.readouterr().out
    teams = re.findall(r"^\s*(\w+) \(urgency ([1-3])\)", out, re.MULTILINE)
    assert len(teams) == 3 and all(team in module.LABELS for team, _ in teams), out
    assert re.search(r"^answer: \d/3 routed", out, re.MULTILINE), out
    rate = re.search(r"^cache hit rate: (\d+\.\d)%", out, re.MULTILINE)
    assert rate is not None and float(rate.group(1)) > 50.0, out  # the few-shot block is computed once
