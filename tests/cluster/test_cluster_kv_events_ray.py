"""The cluster's ingress routing on its replicas' KV events, on a local Ray (loopback): 2
replicas of the default model publishing their events; a prompt computed on one replica is
routed back to it by what that replica reports holding (reason kv_prefix), and after a flush
nothing is held anywhere (reason new); an Anthropic conversation with tools is named too and
its next turn routed on events. (Disaggregated, the ingress's choices on both roles' streams are
checked on test_cluster_pd_ray.py's cluster.) Slow: two engines under Ray."""

from __future__ import annotations

import time

import httpx
import pytest

ray = pytest.importorskip("ray", reason="the cluster tests need Ray Serve")
serve = pytest.importorskip("ray.serve")

from bench.lib.chat_sessions import REPLICA_HEADER  # noqa: E402
from radixserve.server.options import ServerOptions  # noqa: E402
from routing_metrics import routing_reasons  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.real_model, pytest.mark.timeout(400)]

APP = "radixserve-kv"
MODEL = "SmolLM2-135M-Instruct"


def test_the_ingress_routes_on_what_the_replicas_report_holding(serve_port):
    from radixserve.cluster.app import deploy
    from radixserve.cluster.options import ClusterOptions

    port = serve_port
    url = f"http://127.0.0.1:{port}"
    engine = {"num_threads": 1, "kv_events_endpoint": "tcp://127.0.0.1:5557"}  # each replica binds its own ports
    prompt = [(7 * i) % 5000 + 100 for i in range(96)]
    try:
        deploy(engine, ServerOptions(enable_debug_endpoints=True), ClusterOptions(replicas=2, app_name=APP),
               "127.0.0.1", port)
        first = httpx.post(url + "/generate", json={"input_ids": prompt, "sampling_params": {"max_tokens": 1}},
                           timeout=120)
        assert first.status_code == 200, first.text
        home = first.headers[REPLICA_HEADER]
        deadline = time.monotonic() + 60
        while routing_reasons(url).get("kv_prefix", 0) == 0:  # until the ingress tracks both replicas' streams
            assert time.monotonic() < deadline, "the ingress never routed on KV events"
            again = httpx.post(url + "/generate", json={"input_ids": prompt + [9, 9],
                                                        "sampling_params": {"max_tokens": 1}}, timeout=120)
            assert again.status_code == 200 and again.headers[REPLICA_HEADER] == home
            time.sleep(0.25)
        assert httpx.post(url + "/flush_cache", timeout=60).status_code == 200
        time.sleep(1)  # the flush's events reach the ingress
        before = routing_reasons(url)
        httpx.post(url + "/generate", json={"input_ids": prompt, "sampling_params": {"max_tokens": 1}}, timeout=120)
        after = routing_reasons(url)
        assert after.get("new", 0) == before.get("new", 0) + 1 and after.get("kv_prefix") == before.get("kv_prefix")

        tools = [{"name": "get_weather", "description": "Current weather in a city", "input_schema": {
            "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
        turns = [{"role": "user", "content": "What is the weather in Paris? " * 6}]
        body = {"model": MODEL, "max_tokens": 2, "system": "You answer with tools. " * 10, "tools": tools}
        asked = httpx.post(url + "/v1/messages", json={**body, "messages": turns}, timeout=120)
        assert asked.status_code == 200, asked.text
        time.sleep(1)  # its blocks' events reach the ingress
        before = routing_reasons(url)
        turns += [{"role": "assistant", "content": "Let me look."}, {"role": "user", "content": "And in Rome?"}]
        follow = httpx.post(url + "/v1/messages", json={**body, "messages": turns}, timeout=120)
        assert follow.status_code == 200 and follow.headers[REPLICA_HEADER] == asked.headers[REPLICA_HEADER]
        assert routing_reasons(url).get("kv_prefix", 0) == before.get("kv_prefix", 0) + 1  # named: routed on events
    finally:
        serve.delete(APP)
