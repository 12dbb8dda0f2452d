"""radixserve.cluster on a local Ray (loopback): 2 replicas of the default model, one engine
thread each. Prefix-affinity routing keeps a single replica's cache reuse on an agent
workload; a replica killed mid-stream fails only its own request, the router stops using
it at once, and Ray replaces it.

Needs the `cluster` extra (scripts/setup.sh installs it); to run these alone:
    .venv/bin/pip install -c constraints.txt -e '.[cluster]' && .venv/bin/pytest tests/cluster/test_cluster_ray.py
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

ray = pytest.importorskip(
    "ray", reason="the cluster tests need Ray Serve: .venv/bin/pip install -c constraints.txt -e '.[cluster]'"
)
serve = pytest.importorskip("ray.serve")

from bench.lib import chat_sessions  # noqa: E402
from bench.lib.chat_sessions import REPLICA_HEADER, ChatSessions  # noqa: E402
from radixserve.cluster.metrics_merge import sample_total  # noqa: E402
from radixserve.server.options import ServerOptions  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.real_model, pytest.mark.timeout(400)]

WORKLOAD = ChatSessions(sessions=4, turns=3, system_prompts=2, max_tokens=8)
ENGINE = {"num_threads": 1}
APP = "radixserve"


@pytest.fixture(scope="module")
def reference() -> list[chat_sessions.Turn]:
    """The workload on one in-process replica (one cache sees every request): the reuse to keep."""
    from radixserve.engine import Engine
    from radixserve.server.app import create_app
    from radixserve.server.testing import BackgroundServer

    with BackgroundServer(create_app(Engine(**ENGINE), ServerOptions())) as server:
        return chat_sessions.run(server.url, WORKLOAD)


@pytest.fixture(scope="module")
def cluster(reference, serve_port) -> str:
    from radixserve.cluster.app import deploy
    from radixserve.cluster.options import ClusterOptions

    port = serve_port
    try:
        deploy(ENGINE, ServerOptions(enable_debug_endpoints=True), ClusterOptions(replicas=2, app_name=APP),
               "127.0.0.1", port)
        url = f"http://127.0.0.1:{port}"
        _wait_until_every_replica_answers(url)
        yield url
    finally:
        serve.delete(APP)


def _wait_until_every_replica_answers(url: str, timeout_s: float = 120.0) -> None:
    """Until the ingress's handle reaches both replicas (its /health broadcast): before that, its
    router may be offered one replica only, and every first request would go there."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=30).json().get("status") == "ok":
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.5)
    raise AssertionError(f"the cluster's replicas did not all answer /health within {timeout_s:.0f} s")


def test_affinity_routing_keeps_one_replicas_reuse(cluster, reference):
    turns = chat_sessions.run(cluster, WORKLOAD)
    sessions = {s: {t.replica for t in turns if t.session == s} for s in range(WORKLOAD.sessions)}
    prompts = {p: {t.replica for t in turns if t.system_prompt == p} for p in range(WORKLOAD.system_prompts)}
    assert all(len(replicas) == 1 for replicas in sessions.values()), sessions
    assert all(len(replicas) == 1 for replicas in prompts.values()), prompts
    assert prompts[0] != prompts[1]  # the two system prompts spread over both replicas
    single = chat_sessions.cached_tokens(reference)
    cached = chat_sessions.cached_tokens(turns)
    assert single > 0.5 * chat_sessions.prompt_tokens(reference)
    assert cached >= 0.95 * single, (cached, single)

    metrics = httpx.get(cluster + "/metrics", timeout=30).text
    assert sample_total(metrics, "radixserve_cached_prompt_tokens_total") == cached
    assert sample_total(metrics, "radixserve_prompt_tokens_total") == chat_sessions.prompt_tokens(turns)
    assert 'radixserve_cluster_replicas{state="reachable"} 2.0' in metrics
    health = httpx.get(cluster + "/health", timeout=30).json()
    assert health["status"] == "ok" and health["replicas_healthy"] == 2
    assert {r["replica"] for r in health["replicas"]} == set().union(*prompts.values())
    _check_integrity(cluster, expected_replicas=2)


def test_bad_request_gets_the_servers_own_error(cluster):
    answer = httpx.post(cluster + "/v1/completions", json={"model": "nope", "prompt": "x"}, timeout=30)
    assert answer.status_code == 404 and answer.json()["error"]["code"] == "model_not_found"
    answer = httpx.post(cluster + "/v1/completions", content=b"{not json", timeout=30)
    assert answer.status_code == 400 and "not valid JSON" in answer.json()["error"]["message"]


def test_a_stream_through_the_cluster_says_what_the_whole_answer_says(cluster):
    model = httpx.get(cluster + "/v1/models", timeout=30).json()["data"][0]["id"]
    body = {"model": model, "messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 10,
            "temperature": 0}
    whole = httpx.post(cluster + "/v1/chat/completions", json=body, timeout=60)
    assert whole.status_code == 200
    pieces = []
    with httpx.stream("POST", cluster + "/v1/chat/completions", json={**body, "stream": True}, timeout=60) as answer:
        assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in answer.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    for event in events[:-1]:
        pieces.append(json.loads(event)["choices"][0]["delta"].get("content") or "")
    assert "".join(pieces) == whole.json()["choices"][0]["message"]["content"] != ""


def test_previous_response_id_follows_the_replica_that_stored_it(cluster):
    model = httpx.get(cluster + "/v1/models", timeout=30).json()["data"][0]["id"]
    first = httpx.post(cluster + "/v1/responses", timeout=60,
                       json={"model": model, "input": "Say hi.", "max_output_tokens": 4, "temperature": 0})
    if first.status_code == 404:
        pytest.skip("this server has no /v1/responses")
    assert first.status_code == 200, first.text
    home, previous = first.headers[REPLICA_HEADER], first.json()["id"]
    # Each follow-up's own input matches nothing routed before: only the binding keeps it home
    # (unbound, each would go to the replica with less load or the smaller tree).
    for text in ("Blue?", "Why not red?", "Green, then.", "Okay, stop."):
        answer = httpx.post(cluster + "/v1/responses", timeout=60, json={
            "model": model, "input": text, "previous_response_id": previous, "max_output_tokens": 4,
            "temperature": 0,
        })
        assert answer.status_code == 200, answer.text
        assert answer.headers[REPLICA_HEADER] == home
        previous = answer.json()["id"]


def test_killed_replica_fails_its_stream_only_and_is_replaced(cluster):
    model = httpx.get(cluster + "/v1/models", timeout=30).json()["data"][0]["id"]
    body = {"model": model, "prompt": "Write a long story about a lighthouse keeper.", "max_tokens": 400,
            "temperature": 0, "stream": True, "session_id": "doomed", "ignore_eos": True}
    events: list[str] = []
    victim: list[str] = []
    first_event = threading.Event()

    def stream() -> None:
        with httpx.stream("POST", cluster + "/v1/completions", json=body, timeout=120) as answer:
            assert answer.status_code == 200
            victim.append(answer.headers[REPLICA_HEADER])
            for line in answer.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    first_event.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert first_event.wait(60)
    ray.kill(ray.get_actor(f"SERVE_REPLICA::{APP}#RadixReplica#{victim[0]}", namespace="serve"), no_restart=True)
    reader.join(60)
    assert not reader.is_alive()
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "replica_failed" and "failed" in error["message"]
    assert len(events) - 2 < 400  # cut short: the stream did not finish

    # At once: every request goes to the live replica, the killed one's session included.
    for i in range(4):
        answer = httpx.post(cluster + "/v1/completions", timeout=60, json={
            "model": model, "prompt": f"Quick question {i}:", "max_tokens": 4, "temperature": 0,
            "session_id": "doomed" if i % 2 else None,
        })
        assert answer.status_code == 200, answer.text
        assert answer.headers[REPLICA_HEADER] != victim[0]

    deadline = time.monotonic() + 150
    health: dict = {}
    while time.monotonic() < deadline:
        health = httpx.get(cluster + "/health", timeout=30).json()
        if health["replicas_healthy"] == 2:
            break
        assert health["status"] in ("degraded", "ok")
        time.sleep(0.5)
    assert health["replicas_healthy"] == 2, health
    replicas = {r["replica"] for r in health["replicas"]}
    assert victim[0] not in replicas and len(replicas) == 2
    _check_integrity(cluster, expected_replicas=2)


def _check_integrity(url: str, expected_replicas: int) -> None:
    answer = httpx.post(url + "/debug/check_integrity", timeout=60)
    assert answer.status_code == 200, answer.text
    replicas = answer.json()["replicas"]
    assert len(replicas) == expected_replicas and all(r["ok"] for r in replicas.values())

