"""The server against hostile or careless clients (issue 16, points 5, 6, 7, 9): a huge body,
`n` the queue can never hold, values that used to be 500s or silently accepted, and
tenants (several API keys, each with its own prefix-cache namespace). Loopback only, bounded."""

from __future__ import annotations

import gc
import json

import httpx
import pytest

from radixserve.server import ServerOptions, create_app
from radixserve.server.testing import BackgroundServer

pytestmark = pytest.mark.real_model

MODEL = "SmolLM2-135M-Instruct"
C, CHAT, GEN = "/v1/completions", "/v1/chat/completions", "/generate"
OK_COMPLETION = {"model": MODEL, "prompt": "Hello", "max_tokens": 2, "temperature": 0}
# Long enough for several full KV blocks of 16 tokens, so a repeat hits the prefix cache.
SHARED_PROMPT = (
    "Once upon a time, in a small village at the edge of a great forest, there lived an old "
    "clockmaker who repaired every clock in the valley. One winter morning a stranger arrived and said"
)


def _check_integrity(server: BackgroundServer, headers: dict | None = None) -> dict:
    check = httpx.post(server.url + "/debug/check_integrity", headers=headers, timeout=60).json()
    assert check["ok"] and check["stats"]["running"] == 0 and check["stats"]["waiting"] == 0
    return check["stats"]


def _vm_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def test_a_300_mb_body_is_refused_with_413_without_being_buffered(engine):
    """16.5: the cap is checked on Content-Length first and enforced while a chunked body
    is read; the server (in this process) grows by far less than the body."""
    total, piece = 300 << 20, b"x" * (1 << 20)

    def body():
        for _ in range(total // len(piece)):
            yield piece

    with BackgroundServer(create_app(engine, ServerOptions(enable_debug_endpoints=True))) as server:
        assert httpx.post(server.url + C, json=OK_COMPLETION, timeout=60).status_code == 200
        gc.collect()
        before = _vm_rss_bytes()
        declared = httpx.post(server.url + C, content=body(), headers={"Content-Length": str(total)}, timeout=120)
        chunked = httpx.post(server.url + C, content=body(), timeout=120)
        growth = _vm_rss_bytes() - before
        for response in (declared, chunked):
            assert response.status_code == 413, response.text
            assert response.json()["error"]["code"] == "body_too_large"
        assert growth < 64 << 20, f"RSS grew by {growth / 2**20:.0f} MiB"
        assert httpx.post(server.url + C, json=OK_COMPLETION, timeout=60).status_code == 200
        _check_integrity(server)


def test_n_beyond_the_queue_is_a_400_not_a_503(engine):
    """16.6: a request needing more engine requests than the queue holds can never succeed."""
    options = ServerOptions(max_queued_requests=2, enable_debug_endpoints=True)
    with BackgroundServer(create_app(engine, options)) as server:
        too_many = httpx.post(server.url + C, json=dict(OK_COMPLETION, n=3), timeout=60)
        assert too_many.status_code == 400 and "retry-after" not in too_many.headers
        error = too_many.json()["error"]
        assert error["param"] == "n" and error["code"] == "request_too_large" and "at most 2" in error["message"]
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "n": 3}
        assert httpx.post(server.url + CHAT, json=chat, timeout=60).status_code == 400
        batch = httpx.post(server.url + GEN, json={"text": ["a", "b", "c"], "sampling_params": {"max_tokens": 2}},
                           timeout=60)
        assert batch.status_code == 400 and batch.json()["error"]["param"] == "text"
        fits = httpx.post(server.url + C, json=dict(OK_COMPLETION, n=2), timeout=60)
        assert fits.status_code == 200 and len(fits.json()["choices"]) == 2
        _check_integrity(server)


def test_values_that_were_500s_or_silently_accepted_are_400s(engine):
    """16.7: lone surrogates, a 5,000-digit integer, stop_token_ids beyond the vocabulary,
    seeds outside [0, 2**64); and a lower-case 'bearer' scheme is accepted."""
    vocab = engine.loaded.spec.vocab_size
    chat = {"model": MODEL, "max_tokens": 2}
    cases = [
        (C, dict(OK_COMPLETION, prompt="abc \ud800 def"), "prompt"),
        (C, dict(OK_COMPLETION, prompt=["fine", "\udfff"]), "prompt[1]"),
        (CHAT, dict(chat, messages=[{"role": "user", "content": "hi \ud800"}]), "messages[0].content"),
        (CHAT, dict(chat, messages=[{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}]),
         "messages[0].content[0].text"),
        (GEN, {"text": "x\ud800"}, "text"),
        (C, dict(OK_COMPLETION, stop_token_ids=[vocab]), "stop_token_ids"),
        (CHAT, dict(chat, messages=[{"role": "user", "content": "hi"}], stop_token_ids=[2, vocab + 5]),
         "stop_token_ids"),
        (GEN, {"text": "x", "sampling_params": {"stop_token_ids": [vocab]}}, "sampling_params.stop_token_ids"),
        (C, dict(OK_COMPLETION, seed=2**64), "seed"),
        (C, dict(OK_COMPLETION, seed=-1), "seed"),
        (C, dict(OK_COMPLETION, seed=2**64 - 1, n=2), "seed"),  # sample 1 would use seed 2**64
        (GEN, {"text": "x", "sampling_params": {"seed": 2**64}}, "sampling_params.seed"),
    ]
    options = ServerOptions(api_key="K", admin_api_keys=("K-admin",), enable_debug_endpoints=True)
    auth = {"Authorization": "bearer K"}
    with BackgroundServer(create_app(engine, options)) as server:
        for path, body, param in cases:
            raw = json.dumps(body).encode()  # escapes the surrogates as \ud800 (JSON allows that)
            response = httpx.post(server.url + path, content=raw, headers=auth, timeout=60)
            assert response.status_code == 400, (path, body, response.text)
            assert response.json()["error"]["param"] == param, response.text
        digits = b'{"model": "%s", "prompt": "a", "max_tokens": %s}' % (MODEL.encode(), b"9" * 5000)
        huge = httpx.post(server.url + C, content=digits, headers=auth, timeout=60)
        assert huge.status_code == 400 and "number" in huge.json()["error"]["message"]
        for header in ("bearer K", "BEARER K", "Bearer   K"):
            ok = httpx.post(server.url + C, json=OK_COMPLETION, headers={"Authorization": header}, timeout=60)
            assert ok.status_code == 200, (header, ok.text)
        for header in ("Basic K", "bearer k", "bearerK", "K"):
            refused = httpx.post(server.url + C, json=OK_COMPLETION, headers={"Authorization": header}, timeout=60)
            assert refused.status_code == 401, header
        seeded = httpx.post(server.url + C, json=dict(OK_COMPLETION, seed=2**64 - 1, temperature=1.0),
                            headers=auth, timeout=60)
        assert seeded.status_code == 200
        metrics = httpx.get(server.url + "/metrics", headers=auth).text
        assert 'status="500"' not in metrics
        _check_integrity(server, {"Authorization": "Bearer K-admin"})


def test_each_api_key_has_its_own_cache_namespace(engine):
    """16.9: the same prompt under another key is not a cache hit (cached_tokens would tell
    one tenant what another sent); under the same key it is; cache_salt still separates
    within a key; --shared-cache-across-keys shares again."""
    keys = {"a": {"Authorization": "Bearer key-a"}, "b": {"Authorization": "Bearer key-b"}}
    admin = {"Authorization": "Bearer key-admin"}
    body = {"model": MODEL, "prompt": SHARED_PROMPT, "max_tokens": 1, "temperature": 0}

    def cached(server, key, **extra) -> int:
        response = httpx.post(server.url + C, json=dict(body, **extra), headers=keys[key], timeout=60)
        assert response.status_code == 200, response.text
        return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    engine.flush_cache()
    options = ServerOptions(api_keys=("key-a", "key-b"), admin_api_keys=("key-admin",), enable_debug_endpoints=True)
    with BackgroundServer(create_app(engine, options)) as server:
        assert cached(server, "a") == 0
        assert cached(server, "a") >= 32  # same key: hits
        assert cached(server, "b") == 0  # other key: no cross-key hit
        assert cached(server, "b") >= 32
        assert cached(server, "a", cache_salt="s1") == 0  # a salt is its own namespace within a key
        assert cached(server, "a", cache_salt="s1") >= 32
        assert cached(server, "b", cache_salt="s1") == 0  # the same salt under another key is not
        native = httpx.post(server.url + GEN, json={"text": SHARED_PROMPT, "sampling_params": {"max_tokens": 1}},
                            headers=keys["b"], timeout=60).json()
        assert native["meta_info"]["cached_tokens"] >= 32  # /generate uses the key's namespace too
        _check_integrity(server, admin)
    engine.flush_cache()
    shared = ServerOptions(api_keys=("key-a", "key-b"), admin_api_keys=("key-admin",), shared_cache_across_keys=True,
                           enable_debug_endpoints=True)
    with BackgroundServer(create_app(engine, shared)) as server:
        assert cached(server, "a") == 0
        assert cached(server, "b") >= 32
        _check_integrity(server, admin)
    engine.flush_cache()


def test_openapi_lists_every_route(engine):
    with BackgroundServer(create_app(engine, ServerOptions(enable_debug_endpoints=True))) as server:
        schema = httpx.get(server.url + "/openapi.json").json()
    assert set(schema["paths"]) >= {
        "/health", "/v1/models", "/v1/completions", "/v1/chat/completions", "/generate", "/metrics",
        "/flush_cache", "/openapi.json", "/debug/check_integrity", "/debug/stats",
    }
    completions = schema["paths"]["/v1/completions"]["post"]
    assert completions["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/CompletionRequest"
    }
    assert {"200", "400", "413", "503"} <= set(completions["responses"])
    request = schema["components"]["schemas"]["CompletionRequest"]
    assert request["properties"]["max_tokens"]["anyOf"][0] == {"minimum": 1, "type": "integer"}
    assert set(request["required"]) == {"model", "prompt"}
    assert schema["components"]["schemas"]["GenerateRequest"]["additionalProperties"] is False
    json.dumps(schema)
