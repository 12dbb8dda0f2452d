"""Agent hints over HTTP (the default model, its chat template): a 400 naming the field for
a bad hint on every generating route (through the official openai client's extra_body where
it applies), Dynamo's nvext spelling, holds living in the caller's namespace, /metrics, and a
speculative prefill that makes the next turn's cached tokens cover the reply and the header."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from radixserve import Engine
from radixserve.server import ServerOptions, create_app
from radixserve.server.testing import BackgroundServer

pytestmark = pytest.mark.real_model

KEYS = ServerOptions(api_keys=("key-a", "key-b"), admin_api_keys=("key-admin",), enable_debug_endpoints=True)
ADMIN = {"Authorization": "Bearer key-admin"}
A = {"Authorization": "Bearer key-a"}
B = {"Authorization": "Bearer key-b"}
SYSTEM = "You are a careful assistant. " * 12
MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name three prime numbers."}]


@pytest.fixture(scope="module")
def engine(real_model_dir):
    engine = Engine(str(real_model_dir), num_kv_blocks=256)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def server(engine):
    with BackgroundServer(create_app(engine, KEYS)) as running:
        running.model = engine.model_name
        yield running
    engine.check_integrity()


def client(server, key="key-a"):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=300)


def chat(server, messages, key="key-a", **extra):
    return client(server, key).chat.completions.create(
        model=server.model, messages=messages, max_tokens=8, temperature=0, extra_body=extra or None)


def _idle(server, done=lambda stats: True, within: float = 120):
    """The engine's stats once it is idle and `done` holds (what the server starts after a reply,
    a speculative prefill, is queued a moment after the reply reaches the client)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        stats = httpx.get(server.url + "/debug/stats", headers=ADMIN, timeout=30).json()
        if stats["running"] == 0 and stats["waiting"] == 0 and done(stats):
            return stats
        time.sleep(0.05)
    raise AssertionError(f"within {within} s the engine did not go idle with what was waited for done")


@pytest.mark.parametrize("extra, param", [
    ({"agent_hints": {"priority": "high"}}, "agent_hints.priority"),
    ({"agent_hints": {"priority": 5000}}, "agent_hints.priority"),
    ({"agent_hints": {"ttl_s": -1}}, "agent_hints.ttl_s"),
    ({"agent_hints": {"osl": 1.5}}, "agent_hints.osl"),
    ({"agent_hints": {"speculative_prefill": "yes"}}, "agent_hints.speculative_prefill"),
    ({"agent_hints": {"pirority": 1}}, "agent_hints.pirority"),
    ({"agent_hints": {"ttl_s": 5, "release": True}}, "agent_hints.release"),
    ({"agent_hints": []}, "agent_hints"),
    ({"nvext": {"agent_hints": {"osl": -2}}}, "nvext.agent_hints.osl"),
    ({"nvext": {"greed_sampling": True}}, "nvext.greed_sampling"),
    ({"nvext": {"agent_hints": {}}, "agent_hints": {}}, "nvext"),
])
def test_a_bad_hint_is_a_400_naming_it(server, extra, param):
    with pytest.raises(openai.BadRequestError) as err:
        chat(server, MESSAGES, **extra)
    assert err.value.body["param"] == param, err.value.body


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"model": "default", "prompt": "Hello", "max_tokens": 2}),
    ("/v1/responses", {"model": "default", "input": "Hello", "max_output_tokens": 2}),
    ("/v1/messages", {"model": "default", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}),
    ("/generate", {"text": "Hello", "sampling_params": {"max_tokens": 2}}),
])
def test_every_generating_route_takes_and_checks_hints(server, path, body):
    if "model" in body:
        body = {**body, "model": server.model}
    good = httpx.post(server.url + path, json={**body, "agent_hints": {"priority": 2, "osl": 2}}, headers=A, timeout=120)
    assert good.status_code == 200, good.text
    nvext = httpx.post(server.url + path, json={**body, "nvext": {"agent_hints": {"latency_sensitivity": 1.2}}},
                       headers=A, timeout=120)
    assert nvext.status_code == 200, nvext.text
    bad = httpx.post(server.url + path, json={**body, "agent_hints": {"priority": 1.5}}, headers=A, timeout=120)
    assert bad.status_code == 400 and "agent_hints.priority" in bad.text


def test_hints_show_in_metrics(server):
    chat(server, MESSAGES, agent_hints={"priority": 1, "osl": 8})
    text = httpx.get(server.url + "/metrics", headers=A, timeout=30).text
    assert 'radixserve_hint_requests_total{kind="priority"}' in text
    assert 'radixserve_hint_requests_total{kind="osl"}' in text
    for name in ("radixserve_hint_ttl_held_blocks", "radixserve_speculative_prefills_total",
                 "radixserve_speculative_prefill_tokens_total"):
        assert name in text


def test_holds_live_in_the_callers_namespace(server, engine):
    messages = [{"role": "system", "content": "Key A's own agent. " * 10}, {"role": "user", "content": "Go."}]
    chat(server, messages, key="key-a", agent_hints={"ttl_s": 300}, session_id="agent")
    assert _idle(server)["hint_ttl_holds"] >= 1
    holds = engine.kv.sessions.holds
    before = len(holds)
    rendered = engine.apply_chat_template(messages)
    # key B names the same session and the same prefix: nothing of key A's is touched
    other = httpx.post(server.url + "/v1/sessions/release", json={"session_id": "agent", "input_ids": rendered},
                       headers=B, timeout=30)
    assert other.status_code == 200 and other.json()["released"] == 0
    assert len(holds) == before
    own = httpx.post(server.url + "/v1/sessions/release", json={"session_id": "agent", "input_ids": rendered},
                     headers=A, timeout=30)
    assert own.status_code == 200 and own.json()["released"] >= 2  # the TTL hold and the session
    assert len(holds) == before - 1
    bad = httpx.post(server.url + "/v1/sessions/release", json={}, headers=A, timeout=30)
    assert bad.status_code == 400


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.parametrize("warm", [False, True])
def test_speculative_prefill_warms_the_next_turn(server, engine, warm):
    salt = f"spec-{warm}"
    first = client(server).chat.completions.create(
        model=server.model, messages=MESSAGES, max_tokens=12, temperature=0,
        extra_body={"cache_salt": salt, "agent_hints": {"speculative_prefill": warm}})
    reply = first.choices[0].message.content
    warmed = _idle(server, lambda stats: stats["speculative_prefills"] > 0 or not warm, within=30)
    before = warmed["speculative_prefills"]
    nxt = MESSAGES + [{"role": "assistant", "content": reply}, {"role": "user", "content": "And three more?"}]
    second = client(server).chat.completions.create(model=server.model, messages=nxt, max_tokens=1, temperature=0,
                                                    extra_body={"cache_salt": salt})
    cached = second.usage.prompt_tokens_details.cached_tokens
    bs = engine.config.block_size
    next_ids = engine.apply_chat_template(nxt)
    if warm:
        warm_ids = engine.apply_chat_template(MESSAGES + [{"role": "assistant", "content": reply}])
        replied = engine.apply_chat_template(MESSAGES + [{"role": "assistant", "content": reply}],
                                             add_generation_prompt=False)
        assert before >= 1
        assert cached == _common(warm_ids, next_ids) // bs * bs
        assert cached >= len(replied) // bs * bs  # the reply and its end of turn, as the next turn renders them
    else:  # at most what the first turn computed: its prompt and its reply's tokens but the last
        assert cached <= (len(engine.apply_chat_template(MESSAGES)) + 11) // bs * bs
