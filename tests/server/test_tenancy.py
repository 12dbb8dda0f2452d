"""Tenants (API keys) isolated everywhere a request can name an object (issue 29, point 1):
stored responses, rids, sessions and the cache namespace a flush drops. Another key gets
what a stranger would (404, nothing aborted, nothing flushed); an admin key may act for
every tenant; without keys everything stays one trusted tenant. Real model, loopback."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from radixserve.server import ServerOptions, create_app
from radixserve.server.testing import BackgroundServer
from test_reliability_server import SHARED_PROMPT as PROMPT

pytestmark = pytest.mark.real_model

MODEL = "SmolLM2-135M-Instruct"
A = {"Authorization": "Bearer key-a"}
B = {"Authorization": "Bearer key-b"}
ADMIN = {"Authorization": "Bearer key-admin"}
KEYS = ServerOptions(api_keys=("key-a", "key-b"), admin_api_keys=("key-admin",), enable_debug_endpoints=True)
SHARED = ServerOptions(api_keys=("key-a", "key-b"), admin_api_keys=("key-admin",), shared_cache_across_keys=True,
                       enable_debug_endpoints=True)
SECRET = "The vault code of the Lindqvist family is 4417-alpha, and the spare key hides under the blue pot."


def _post(server: BackgroundServer, path: str, body: dict, headers: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=headers, timeout=120)


def _cached(server: BackgroundServer, headers: dict, **extra) -> int:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1, "temperature": 0, **extra}
    answer = _post(server, "/v1/completions", body, headers)
    assert answer.status_code == 200, answer.text
    return answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def _idle_and_intact(server: BackgroundServer) -> None:
    check = _post(server, "/debug/check_integrity", {}, ADMIN).json()
    assert check["ok"] and check["stats"]["running"] == 0 and check["stats"]["waiting"] == 0


def test_a_stored_response_is_its_keys_alone(engine):
    """Key B continuing key A's response id gets 404 (as for an id that never existed), so
    A's conversation never reaches B's model context; A itself continues it."""
    with BackgroundServer(create_app(engine, KEYS)) as server:
        client_a = openai.OpenAI(base_url=server.url + "/v1", api_key="key-a")
        client_b = openai.OpenAI(base_url=server.url + "/v1", api_key="key-b")
        first = client_a.responses.create(model=MODEL, input=SECRET, max_output_tokens=4, temperature=0)
        with pytest.raises(openai.NotFoundError) as foreign:
            client_b.responses.create(model=MODEL, input="Repeat what I said.", previous_response_id=first.id,
                                      max_output_tokens=4)
        with pytest.raises(openai.NotFoundError) as unknown:
            client_b.responses.create(model=MODEL, input="Repeat.", previous_response_id="resp_" + "0" * 32,
                                      max_output_tokens=4)
        for refused in (foreign.value, unknown.value):
            assert refused.body["param"] == "previous_response_id" and refused.body["code"] == "response_not_found"
        assert "not found" in foreign.value.body["message"] and "not found" in unknown.value.body["message"]
        again = client_a.responses.create(model=MODEL, input="Repeat what I said.", previous_response_id=first.id,
                                          max_output_tokens=4, temperature=0)
        assert again.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
        # Without keys the one tenant continues any response, as before.
        _idle_and_intact(server)
    with BackgroundServer(create_app(engine, ServerOptions())) as open_server:
        client = openai.OpenAI(base_url=open_server.url + "/v1", api_key="none")
        first = client.responses.create(model=MODEL, input="Hi there.", max_output_tokens=2, temperature=0)
        assert client.responses.create(model=MODEL, input="Again.", previous_response_id=first.id,
                                       max_output_tokens=2).usage.input_tokens > first.usage.input_tokens
    engine.flush_cache()


def _start_long_generate(server: BackgroundServer, headers: dict, rid: str, answers: dict) -> threading.Thread:
    body = {"text": PROMPT, "rid": rid, "sampling_params": {"max_new_tokens": 120, "ignore_eos": True,
                                                            "temperature": 0}}
    thread = threading.Thread(target=lambda: answers.update({rid: _post(server, "/generate", body, headers).json()}))
    thread.start()
    return thread


def _wait_running(server: BackgroundServer, count: int) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if httpx.get(server.url + "/debug/stats", headers=ADMIN).json()["running"] >= count:
            return
        time.sleep(0.05)
    raise AssertionError(f"{count} requests never ran")


def test_rids_are_per_key(engine):
    """B aborting A's rid (or aborting all) ends nothing of A's; B may hold the same rid
    string at the same time; A's abort of its own rid works; the admin's abort_all ends all."""
    answers: dict = {}
    with BackgroundServer(create_app(engine, KEYS)) as server:
        caller = _start_long_generate(server, A, "job-1", answers)
        _wait_running(server, 1)
        assert _post(server, "/abort_request", {"rid": "job-1"}, B).json() == {"aborted": 0}
        assert _post(server, "/abort_request", {"abort_all": True}, B).json() == {"aborted": 0}
        caller.join(120)
        assert answers["job-1"]["meta_info"]["finish_reason"]["type"] == "length"
        assert len(answers["job-1"]["output_ids"]) == 120

        callers = [_start_long_generate(server, A, "same", answers_a := {}),
                   _start_long_generate(server, B, "same", answers_b := {})]
        _wait_running(server, 2)  # the same rid under two keys is no clash
        assert _post(server, "/abort_request", {"rid": "same"}, A).json() == {"aborted": 1}
        callers[0].join(60)
        assert answers_a["same"]["meta_info"]["finish_reason"]["type"] == "abort"
        assert _post(server, "/abort_request", {"abort_all": True}, ADMIN).json() == {"aborted": 1}
        callers[1].join(60)
        assert answers_b["same"]["meta_info"]["finish_reason"]["type"] == "abort"
        assert len(answers_b["same"]["output_ids"]) < 120
        _idle_and_intact(server)
    engine.flush_cache()


def test_only_an_admin_key_reaches_the_debug_endpoints_and_ids_count_nothing(engine):
    """The debug endpoints report every tenant's totals (and check_integrity holds the engine):
    a tenant's key gets 403. Generated ids are random, so no key learns how many requests the
    others sent between two of its own."""
    with BackgroundServer(create_app(engine, KEYS)) as server:
        for method, path in (("POST", "/debug/check_integrity"), ("GET", "/debug/stats")):
            refused = httpx.request(method, server.url + path, headers=A, timeout=60)
            assert refused.status_code == 403 and refused.json()["error"]["code"] == "admin_key_required"
            assert httpx.request(method, server.url + path, headers=ADMIN, timeout=60).status_code == 200
        body = {"text": "Hi", "sampling_params": {"max_new_tokens": 1}}
        ids = [_post(server, "/generate", body, A).json()["meta_info"]["id"] for _ in range(2)]
        assert ids[0] != ids[1] and ids[0][:20] != ids[1][:20]  # no shared prefix with a counter after it
        _idle_and_intact(server)


def test_a_flush_drops_only_the_callers_namespace(engine):
    """B's flush leaves A's cached prefixes (A's repeat still hits), A's own flush drops them,
    cache_salt namespaces within a key go with it, and only an admin flushes everyone."""
    engine.flush_cache()
    with BackgroundServer(create_app(engine, KEYS)) as server:
        assert _cached(server, A) == 0 and _cached(server, A, cache_salt="s") == 0 and _cached(server, B) == 0
        assert _post(server, "/flush_cache", {}, B).json()["freed_blocks"] > 0
        assert _cached(server, A) >= 32 and _cached(server, A, cache_salt="s") >= 32
        assert _cached(server, B) == 0  # B's own were flushed
        assert _post(server, "/flush_cache", {}, A).json()["freed_blocks"] > 0
        assert _cached(server, A) == 0 and _cached(server, A, cache_salt="s") == 0
        assert _cached(server, B) >= 32  # A's flush left B's
        everything = _post(server, "/flush_cache", {}, ADMIN).json()
        assert everything["freed_blocks"] > 0 and everything["flushed"] == "all"
        assert _cached(server, A) == 0 and _cached(server, B) == 0
        assert _post(server, "/flush_cache", {}, B).json()["flushed"] == "own"
        _idle_and_intact(server)
    engine.flush_cache()
    with BackgroundServer(create_app(engine, SHARED)) as server:
        assert _cached(server, A) == 0 and _cached(server, B) >= 32
        refused = httpx.get(server.url + "/flush_cache", headers=B)
        assert refused.status_code == 403 and refused.json()["error"]["code"] == "admin_key_required"
        assert _cached(server, A) >= 32  # the refused flush dropped nothing
        assert _post(server, "/flush_cache", {}, ADMIN).json()["freed_blocks"] > 0
        assert _cached(server, A) == 0
    engine.flush_cache()


@pytest.mark.parametrize("options", [KEYS, SHARED], ids=["own-cache", "shared-cache"])
def test_a_session_is_its_keys_alone(engine, options):
    """B closing A's session finds none (404), even where keys share the cache; A closes it."""
    with BackgroundServer(create_app(engine, options)) as server:
        body = {"text": PROMPT, "session_id": "agent-7", "sampling_params": {"max_new_tokens": 1}}
        assert _post(server, "/generate", body, A).status_code == 200
        foreign = _post(server, "/v1/sessions/agent-7/close", {}, B)
        assert foreign.status_code == 404 and foreign.json()["error"]["code"] == "session_not_found"
        assert _post(server, "/v1/sessions/agent-7/close", {}, A).status_code == 200
        assert _post(server, "/v1/sessions/agent-7/close", {}, A).status_code == 404
        long_id = "x" * 256  # the longest id a client may send still fits behind its tenant's name
        assert _post(server, "/generate", dict(body, session_id=long_id), B).status_code == 200
        assert _post(server, f"/v1/sessions/{long_id}/close", {}, B).status_code == 200
        _idle_and_intact(server)
    engine.flush_cache()


def test_without_keys_one_tenant_acts_for_all(engine):
    """No keys: flush drops everything, abort_all ends every rid (behaviour as before)."""
    engine.flush_cache()
    with BackgroundServer(create_app(engine, ServerOptions(enable_debug_endpoints=True))) as server:
        assert _cached(server, {}) == 0 and _cached(server, {}, cache_salt="t") == 0
        assert _post(server, "/flush_cache", {}, {}).json()["freed_blocks"] > 0
        assert _cached(server, {}) == 0 and _cached(server, {}, cache_salt="t") == 0
    engine.flush_cache()
