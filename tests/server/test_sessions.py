"""Agent sessions end to end (tiny random model): session_id on the engine, /generate and
the OpenAI routes; close and pin routes; idle TTL; metrics; integrity after each scenario."""

from __future__ import annotations

import time

import httpx
import pytest

from radixserve import Engine, SamplingParams
from radixserve.server import create_app
from radixserve.server.options import ServerOptions
from radixserve.server.testing import BackgroundServer

GREEDY = SamplingParams(max_tokens=4, temperature=0.0)
SYSTEM = [(5 * i) % 80 + 3 for i in range(48)]


def turn(history: list[int], extra: int) -> list[int]:
    return history + [(11 * extra + j) % 80 + 3 for j in range(20)]


def test_a_session_keeps_its_latest_context_and_demotes_what_it_superseded(tiny_model_dir):
    engine = Engine(str(tiny_model_dir("llama")), num_kv_blocks=24)
    first = turn(SYSTEM, 1)
    engine.add_request(first, GREEDY, session_id="agent-1")
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats()["sessions_open"] == 1
    node_before = engine.scheduler.kv.sessions._sessions[(None, "agent-1")].node
    assert node_before.protect == 1
    # a turn that does not extend the first one (the client rewrote the history)
    second = turn(SYSTEM, 2)
    engine.add_request(second, GREEDY, session_id="agent-1")
    while engine.has_unfinished_requests():
        engine.step()
    node_after = engine.scheduler.kv.sessions._sessions[(None, "agent-1")].node
    assert node_after is not node_before and node_after.protect == 1
    assert node_before.protect == 0 and node_before.demoted
    engine.check_integrity()
    assert engine.close_session("agent-1") and not engine.close_session("agent-1")
    assert node_after.protect == 0 and engine.stats()["sessions_open"] == 0
    engine.check_integrity()


def test_sessions_never_refuse_a_request_that_eviction_could_serve(tiny_model_dir):
    engine = Engine(str(tiny_model_dir("llama")), num_kv_blocks=12)
    for i in range(4):  # each session's context alone is most of the pool
        out = engine.generate([turn(SYSTEM[:100], 10 + i)], GREEDY)
        assert out[0].finished
        engine.add_request(turn(SYSTEM[:100], 20 + i), GREEDY, session_id=f"s{i}")
        while engine.has_unfinished_requests():
            engine.step()
    assert engine.stats()["sessions_open"] == 4
    engine.check_integrity()


def test_idle_sessions_expire(tiny_model_dir):
    engine = Engine(str(tiny_model_dir("llama")), num_kv_blocks=24, session_ttl_s=1)
    engine.generate([turn(SYSTEM, 3)], GREEDY)
    engine.add_request(turn(SYSTEM, 4), GREEDY, session_id="idle")
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats()["sessions_open"] == 1
    time.sleep(1.1)
    engine.generate([turn(SYSTEM, 5)], GREEDY)  # any step expires idle sessions
    assert engine.stats()["sessions_open"] == 0
    engine.check_integrity()


def test_pinned_prefix_is_kept_until_its_ttl(tiny_model_dir):
    engine = Engine(str(tiny_model_dir("llama")), num_kv_blocks=24)
    engine.generate([turn(SYSTEM, 6)], GREEDY)
    assert engine.pin_prefix(SYSTEM, ttl_s=60) == 48
    assert engine.stats()["pins"] == 1
    engine.check_integrity()
    with pytest.raises(ValueError):
        engine.add_request([1, 2, 3], GREEDY, session_id="")


def test_session_routes_and_fields_over_http(tiny_model_dir):
    engine = Engine(str(tiny_model_dir("llama")), num_kv_blocks=32)
    app = create_app(engine, ServerOptions(enable_debug_endpoints=True))
    with BackgroundServer(app) as server, httpx.Client(base_url=server.url, timeout=60) as http:
        prompt = turn(SYSTEM, 7)
        r = http.post("/generate", json={"input_ids": prompt, "session_id": "web-1",
                                          "sampling_params": {"max_tokens": 3, "temperature": 0}})
        assert r.status_code == 200, r.text
        r = http.post("/v1/completions", json={"model": engine.model_name, "prompt": turn(SYSTEM, 8),
                                                "max_tokens": 2, "session_id": "web-2"})
        assert r.status_code == 200, r.text
        # /metrics is up to date as soon as an answer, a close or a pin is back
        assert "radixserve_sessions_open 2.0" in http.get("/metrics").text
        assert http.post("/v1/sessions/web-1/close").json() == {"id": "web-1", "object": "session", "closed": True}
        assert "radixserve_sessions_open 1.0" in http.get("/metrics").text
        missing = http.post("/v1/sessions/web-1/close")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "session_not_found"
        bad = http.post("/generate", json={"input_ids": prompt, "session_id": ""})
        assert bad.status_code == 400 and "session_id" in bad.text
        bad = http.post("/v1/completions", json={"model": engine.model_name, "prompt": "x", "session_id": 5})
        assert bad.status_code == 400
        pin = http.post("/v1/sessions/pin", json={"input_ids": SYSTEM, "ttl_s": 30})
        assert pin.status_code == 200 and pin.json()["pinned_tokens"] == 48
        assert "radixserve_pinned_prefixes 1.0" in http.get("/metrics").text
        assert http.post("/v1/sessions/pin", json={"input_ids": SYSTEM, "ttl_s": -1}).status_code == 400
        assert http.post("/v1/sessions/pin", json={"ttl_s": 3}).status_code == 400
        assert http.post("/debug/check_integrity").status_code == 200
        stats = http.get("/debug/stats").json()
        assert stats["sessions_open"] == 1 and stats["pins"] == 1
