"""Every example in examples/agents/ runs to the end with a small token budget and prints
its answer and the cache hit rate it achieved."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.real_model

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "agents"

SMOKE_ARGS = {
    "react_agent": ["--max-steps", "2", "--max-tokens", "40"],
    "fewshot_classify": ["--limit", "3", "--max-tokens", "2"],
    "tree_of_thought": ["--width", "2", "--depth", "1", "--keep", "1", "--max-tokens", "4"],
    "shared_prompt_agents": ["--rounds", "1", "--max-tokens", "6"],
    "langchain_tools": ["--max-steps", "1", "--max-tokens", "40"],
    "anthropic_tools": ["--max-steps", "1", "--max-tokens", "40"],
}
# the `agents` extra, and the `test` extra's anthropic client (scripts/setup.sh installs both)
NEEDS = {"langchain_tools": "langchain_openai", "anthropic_tools": "anthropic"}
# The examples that start `radixserve serve` themselves share one here, started once with room for a
# cold page cache on a slow machine; the in-process examples keep their own runtime.
SERVED = {"react_agent", "langchain_tools", "anthropic_tools"}
SERVER_START_S = 900.0


def test_every_example_has_a_smoke_test():
    assert sorted(p.stem for p in EXAMPLES.glob("*.py")) == sorted(SMOKE_ARGS)


@pytest.mark.parametrize("name", sorted(SMOKE_ARGS))
def test_example_runs_and_reports_its_hit_rate(name, real_model_dir, request, capsys):
    if name in NEEDS:
        pytest.importorskip(NEEDS[name])
    module = _load(EXAMPLES / f"{name}.py")
    if name in SERVED:
        target = ["--url", request.getfixturevalue("example_server").url]
    else:
        target = ["--model", str(real_model_dir)]
    assert module.main([*target, *SMOKE_ARGS[name]]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^answer: ", out, re.MULTILINE), out
    rate = re.search(r"^cache hit rate: (\d+\.\d)%", out, re.MULTILINE)
    assert rate is not None, out
    # Every example sends requests that share a prefix (a system prompt, the few-shot block,
    # a fork's root, the transcript so far), so some of their prompt tokens come from the cache.
    assert 0.0 < float(rate.group(1)) < 100.0, out
    counts = re.search(r"\((\d+) cached of (\d+) prompt tokens, (\d+) steps\)", out)
    if counts is not None:  # the agents that count usage themselves: the rate is theirs
        cached, prompt, steps = map(int, counts.groups())
        assert steps >= 2 and 0 < cached < prompt, out
        assert rate.group(1) == f"{100 * cached / prompt:.1f}", out


@pytest.fixture(scope="module")
def example_server(real_model_dir):
    """The examples' own `LocalServer`, so its success path is what the served examples run on."""
    server = _load(EXAMPLES / "react_agent.py").LocalServer(str(real_model_dir))
    server.start(timeout_s=SERVER_START_S)
    yield server
    server.stop()
    assert server.process.returncode == 0, "the server did not stop cleanly on SIGTERM"


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(f"example_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_local_server_says_the_server_exited_and_with_what_code(tmp_path):
    module = _load(EXAMPLES / "react_agent.py")
    server = module.LocalServer(str(tmp_path / "no-such-model"))
    with pytest.raises(RuntimeError, match=r"exited with code [1-9]\d* before it was healthy"):
        server.start(timeout_s=120)
    assert server.process.poll() is not None
