"""The same program on rl.Runtime and on rl.Endpoint (a server over the same engine) gives
the same greedy result; streaming, errors and stats over HTTP."""

from __future__ import annotations

import pytest

import radixserve.lang as rl
from radixserve.server import ServerOptions, create_app
from radixserve.server.testing import BackgroundServer

pytestmark = pytest.mark.real_model

API_KEY = "lang-test-key"


@rl.function
def triage(s, ticket):
    s += rl.system("You sort support tickets.")
    s += rl.user(ticket)
    s += rl.assistant(rl.select("team", choices=["billing", "tech", "sales"]))
    s += rl.user("Why? Answer in a few words.")
    s += rl.assistant(rl.gen("why", max_tokens=10, stop="\n"))
    s += rl.user("Priority from 1 to 5?")
    s += rl.assistant("Priority: " + rl.gen("priority", regex="[1-5]", max_tokens=2))
    forks = s.fork(2)
    for i, f in enumerate(forks):
        f += rl.user(f"Write reply draft {i + 1}.") + rl.assistant(rl.gen("draft", max_tokens=6))
    forks.join()


TICKETS = ["I was charged twice for my order", "The app crashes when I open settings"]


@pytest.fixture(scope="module")
def both(real_engine):
    """(runtime states, endpoint, endpoint server url, the shut-down runtime): the runtime
    runs first, then the same engine serves HTTP (only one thread may drive it at a time)."""
    runtime = rl.Runtime(engine=real_engine)
    try:
        runtime_states = triage.run_batch([{"ticket": t} for t in TICKETS], backend=runtime, temperature=0)
    finally:
        runtime.shutdown()
    app = create_app(real_engine, ServerOptions(api_key=API_KEY))
    with BackgroundServer(app) as server:
        yield runtime_states, rl.Endpoint(server.url, api_key=API_KEY), server.url, runtime
    real_engine.check_integrity()


def test_same_greedy_result_on_runtime_and_endpoint(both):
    runtime_states, endpoint, _, _ = both
    endpoint_states = triage.run_batch([{"ticket": t} for t in TICKETS], backend=endpoint, temperature=0)
    for on_runtime, on_endpoint in zip(runtime_states, endpoint_states):
        assert on_endpoint.text() == on_runtime.text()
        assert on_endpoint.variables() == on_runtime.variables()
        assert on_endpoint.scores("team").total_logprobs == pytest.approx(
            on_runtime.scores("team").total_logprobs, abs=1e-3
        )


def test_endpoint_streams_reports_stats_and_raises_value_error_on_400(both):
    _, endpoint, _, _ = both

    @rl.function
    def story(s):
        s += rl.user("Tell a one-line story.")
        s += rl.assistant(rl.gen("story", max_tokens=10))

    before = endpoint.stats()
    state = story.run(backend=endpoint, stream=True, temperature=0)
    pieces = list(state.text_iter("story"))
    assert len(pieces) > 1 and "".join(pieces) == state["story"]
    after = endpoint.stats()
    assert after["prompt_tokens"] > before["prompt_tokens"]
    assert 0 <= after["cached_prompt_tokens"] <= after["prompt_tokens"]
    bad = rl.ProgramState(endpoint)
    bad += "Code: " + rl.gen("code", regex="([a-z", max_tokens=4)
    with pytest.raises(ValueError, match="invalid regex"):
        bad.sync()


def test_endpoint_needs_the_api_key(both):
    _, _, url, _ = both
    state = rl.ProgramState(rl.Endpoint(url, api_key="wrong", tokenizer=both[1].tokenizer))
    state += "Hello" + rl.gen("x", max_tokens=2)
    with pytest.raises(rl.EndpointError, match="401"):
        state.sync()


def test_a_shut_down_runtime_refuses_work(both):
    runtime = both[3]
    with pytest.raises(RuntimeError, match="shut down"):
        runtime.stats()
    state = rl.ProgramState(runtime)
    state += "Hello" + rl.gen("x", max_tokens=2)
    with pytest.raises(RuntimeError, match="shut down"):
        state.sync()
