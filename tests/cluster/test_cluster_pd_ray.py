"""Disaggregated radixserve.cluster on a local Ray: 1 prefill + 1 decode replica of the default
model, one engine thread each, publishing KV events. Greedy output equals one server's; a repeated prefix sends only
the blocks the decode replica lacks (exact counts from each replica's stats); /health names the
roles; a prefill replica killed while computing a prompt costs that prompt a retry (or a
recompute on the decode replica), never its answer; a killed decode replica fails its stream
with replica_failed; integrity holds on both replicas, each replaced. The ingress follows both
roles' KV event streams: the prefill choice and the decode choice are made on them.

Needs the `cluster` extra; to run alone: .venv/bin/pytest tests/cluster/test_cluster_pd_ray.py
"""

from __future__ import annotations

import random
import threading
import time

import httpx
import pytest

ray = pytest.importorskip("ray", reason="the cluster tests need Ray Serve")
serve = pytest.importorskip("ray.serve")

from radixserve.server.options import ServerOptions  # noqa: E402
from routing_metrics import PREFILL_DECISIONS, routing_reasons  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.real_model, pytest.mark.timeout(600)]

ENGINE = {"num_threads": 1, "num_kv_blocks": 600}
REPLICA_ENGINE = {**ENGINE, "kv_events_endpoint": "tcp://127.0.0.1:5557"}  # each replica binds its own ports
APP = "radixserve-pd"
MODEL = "SmolLM2-135M-Instruct"


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


@pytest.fixture(scope="module")
def single() -> str:
    from radixserve.engine import Engine
    from radixserve.server.app import create_app
    from radixserve.server.testing import BackgroundServer

    with BackgroundServer(create_app(Engine(**ENGINE), ServerOptions())) as server:
        yield server.url


@pytest.fixture(scope="module")
def cluster(single, serve_port) -> str:
    from radixserve.cluster.app import deploy
    from radixserve.cluster.options import ClusterOptions, PDOptions

    port = serve_port
    try:
        options = ClusterOptions(prefill_replicas=1, decode_replicas=1, app_name=APP,
                                 pd=PDOptions(local_prefill_tokens=0, transfer_timeout_s=60.0))
        deploy(REPLICA_ENGINE, ServerOptions(enable_debug_endpoints=True), options, "127.0.0.1", port)
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.delete(APP)


def complete(url: str, prompt: list[int], max_tokens: int = 10) -> str:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    answer = httpx.post(url + "/v1/completions", json=body, timeout=180)
    assert answer.status_code == 200, answer.text
    return answer.json()["choices"][0]["text"]


def roles(url: str) -> dict[str, str]:
    health = httpx.get(url + "/health", timeout=30).json()
    return {r["replica"]: r["role"] for r in health["replicas"] if r.get("replica")}


def stats_by_role(url: str) -> dict[str, dict]:
    by_id = httpx.get(url + "/debug/stats", timeout=60).json()["replicas"]
    role_of = roles(url)
    return {role_of[replica]: s for replica, s in by_id.items()}


def check_integrity(url: str) -> None:
    answer = httpx.post(url + "/debug/check_integrity", timeout=60)
    assert answer.status_code == 200, answer.text
    replicas = answer.json()["replicas"]
    assert len(replicas) == 2 and all(r["ok"] for r in replicas.values())


def test_roles_greedy_equality_and_exact_blocks(cluster, single):
    health = httpx.get(cluster + "/health", timeout=30).json()
    assert health["status"] == "ok" and health["replicas_expected"] == 2
    assert sorted(r["role"] for r in health["replicas"]) == ["decode", "prefill"]

    system = ids(96, 1)  # 6 blocks
    first = system + ids(70, 2)  # 166 tokens: 10 full blocks
    assert complete(cluster, first) == complete(single, first)
    s = stats_by_role(cluster)
    assert (s["prefill"]["kv_sent_blocks"], s["decode"]["kv_received_blocks"]) == (10, 10)
    assert s["decode"]["kv_skipped_blocks"] == 0
    check_integrity(cluster)

    second = system + ids(40, 3)  # 136 tokens: 8 full blocks, 6 of them on the decode replica already
    assert complete(cluster, second) == complete(single, second)
    s = stats_by_role(cluster)
    assert (s["prefill"]["kv_sent_blocks"], s["decode"]["kv_received_blocks"]) == (12, 12)
    assert s["decode"]["kv_skipped_blocks"] == 6

    assert complete(cluster, second) == complete(single, second)  # an exact repeat: no block moves
    s = stats_by_role(cluster)
    assert (s["prefill"]["kv_sent_blocks"], s["decode"]["kv_received_blocks"]) == (12, 12)
    assert s["decode"]["kv_skipped_blocks"] == 6 + 8
    assert s["decode"]["kv_fallback_recomputes"] == 0
    assert s["prefill"]["kv_sent_bytes"] == s["decode"]["kv_received_bytes"] > 0
    deadline = time.monotonic() + 10
    while stats_by_role(cluster)["prefill"]["kv_export_holds"] and time.monotonic() < deadline:
        time.sleep(0.2)  # the acks are sent after the decode side admitted the request
    assert stats_by_role(cluster)["prefill"]["kv_export_holds"] == 0
    metrics = httpx.get(cluster + "/metrics", timeout=30).text
    assert "radixserve_kv_sent_bytes_total" in metrics and "radixserve_kv_received_blocks_total" in metrics
    assert 'radixserve_cluster_replicas{state="reachable"} 2.0' in metrics
    assert "radixserve_cluster_routing_decisions_total" in metrics  # the decode deployment's router
    # The ingress picked the prefill replica for each prompt (it learnt the live one from Ray).
    picks = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                if line.startswith("radixserve_cluster_prefill_routing_decisions_total{"))
    assert picks >= 3, [line for line in metrics.splitlines() if "prefill_routing" in line]
    check_integrity(cluster)


def test_the_ingress_picks_both_roles_on_their_events(cluster):
    system = "You are a careful assistant for a cluster of replicas. " * 8  # text no other test sends

    def on_events() -> tuple[float, float]:  # decode and prefill choices made on KV events so far
        return (routing_reasons(cluster).get("kv_prefix", 0),
                routing_reasons(cluster, PREFILL_DECISIONS).get("kv_prefix", 0))

    before = on_events()

    def both_on_events() -> bool:
        now = on_events()
        return now[0] > before[0] and now[1] > before[1]

    deadline = time.monotonic() + 90
    turn = 0
    while not both_on_events():
        assert time.monotonic() < deadline, "the ingress never picked both roles on KV events"
        body = {"model": MODEL, "max_tokens": 2, "messages": [  # the decode side steps (and publishes)
            {"role": "system", "content": system}, {"role": "user", "content": f"Question {turn}?"}]}
        answer = httpx.post(cluster + "/v1/chat/completions", json=body, timeout=180)
        assert answer.status_code == 200, answer.text
        turn += 1
        time.sleep(0.25)
    assert turn >= 2  # the first prompt was cached nowhere
    check_integrity(cluster)


def test_a_stream_is_the_same_as_the_whole_answer(cluster, single):
    prompt = ids(120, 5)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0, "stream": True}
    text = ""
    with httpx.stream("POST", cluster + "/v1/completions", json=body, timeout=180) as answer:
        assert answer.status_code == 200
        import json

        for line in answer.iter_lines():
            if line.startswith("data: {"):
                text += "".join(c["text"] for c in json.loads(line[6:])["choices"])
    assert text == complete(single, prompt, 12)
    check_integrity(cluster)


def test_a_killed_prefill_replica_costs_a_retry_not_the_answer(cluster, single):
    before = stats_by_role(cluster)["decode"]
    prefill_id = next(r for r, role in roles(cluster).items() if role == "prefill")
    prompt = ids(1500, 7)  # long enough that the kill lands while it is computed
    expected = complete(single, prompt, 6)  # first: computed after the kill, it ran beside the replica's restart
    answers: list[str] = []
    reader = threading.Thread(target=lambda: answers.append(complete(cluster, prompt, 6)))
    reader.start()
    time.sleep(1.5)
    ray.kill(ray.get_actor(f"SERVE_REPLICA::{APP}#PrefillReplica#{prefill_id}", namespace="serve"), no_restart=True)
    reader.join(240)
    assert not reader.is_alive() and answers
    assert answers[0] == expected
    after = stats_by_role_when_healthy(cluster)["decode"]
    retried = after["kv_prefill_retries"] - before["kv_prefill_retries"]
    recomputed = after["kv_fallback_recomputes"] - before["kv_fallback_recomputes"]
    assert retried + recomputed >= 1, (retried, recomputed)
    check_integrity(cluster)


def stats_by_role_when_healthy(url: str) -> dict[str, dict]:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        health = httpx.get(url + "/health", timeout=30).json()
        if health["replicas_healthy"] == 2:
            return stats_by_role(url)
        time.sleep(0.5)
    raise AssertionError(f"the prefill replica was not replaced: {health}")


def test_a_killed_decode_replica_fails_its_stream_with_replica_failed(cluster):
    import json

    decode_id = next(r for r, role in roles(cluster).items() if role == "decode")
    body = {"model": MODEL, "prompt": ids(200, 9), "max_tokens": 300, "temperature": 0, "stream": True,
            "ignore_eos": True}
    events: list[str] = []
    first = threading.Event()

    def read() -> None:
        with httpx.stream("POST", cluster + "/v1/completions", json=body, timeout=180) as answer:
            assert answer.status_code == 200
            for line in answer.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    first.set()

    reader = threading.Thread(target=read)
    reader.start()
    assert first.wait(120)
    ray.kill(ray.get_actor(f"SERVE_REPLICA::{APP}#DecodeReplica#{decode_id}", namespace="serve"), no_restart=True)
    reader.join(120)
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "replica_failed"
    stats_by_role_when_healthy(cluster)
    check_integrity(cluster)
