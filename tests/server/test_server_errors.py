"""Bad input, limits and failures: exact status and an OpenAI-style error body, and the
server keeps serving with its block pool intact afterwards."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest

from radixserve.server import ServerOptions, create_app
from radixserve.server.testing import BackgroundServer

pytestmark = pytest.mark.real_model

MODEL = "SmolLM2-135M-Instruct"
OK_COMPLETION = {"model": MODEL, "prompt": "Hello", "max_tokens": 2, "temperature": 0}
OK_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
TOO_LONG = list(range(100, 100 + 8192))


def completion(**changes):
    body = dict(OK_COMPLETION, **changes)
    return {k: v for k, v in body.items() if v is not ...}


def chat(**changes):
    body = dict(OK_CHAT, **changes)
    return {k: v for k, v in body.items() if v is not ...}


def user(content):
    return [{"role": "user", "content": content}]


C, CHAT, GEN = "/v1/completions", "/v1/chat/completions", "/generate"

# (name, method, path, body (bytes sent as they are, anything else as JSON), status, message part, param)
BAD_INPUTS = [
    ("malformed json", "POST", C, b'{"model": "x", ', 400, "not valid JSON", None),
    ("invalid utf-8", "POST", C, b'{"model": "\xff\xfe", "prompt": "a"}', 400, "not valid UTF-8", None),
    ("empty body", "POST", C, b"", 400, "body is empty", None),
    ("body not an object", "POST", C, b"[1, 2]", 400, "must be a JSON object", None),
    ("NaN is not JSON", "POST", C, b'{"model": "m", "prompt": "a", "temperature": NaN}', 400, "NaN", None),
    ("missing model", "POST", C, completion(model=...), 400, "'model' is required", "model"),
    ("unknown model", "POST", C, completion(model="gpt-9"), 404, "does not exist", "model"),
    ("model not a string", "POST", C, completion(model=3), 400, "must be a string", "model"),
    ("missing prompt", "POST", C, completion(prompt=...), 400, "'prompt' is required", "prompt"),
    ("prompt wrong type", "POST", C, completion(prompt={"a": 1}), 400, "'prompt' must be", "prompt"),
    ("prompt mixed list", "POST", C, completion(prompt=["a", 1]), 400, "'prompt' must be", "prompt"),
    ("empty prompt", "POST", C, completion(prompt=""), 400, "empty", "prompt"),
    ("empty prompt list", "POST", C, completion(prompt=[]), 400, "empty", "prompt"),
    ("token id out of vocab", "POST", C, completion(prompt=[1, 10**9]), 400, "token ids must be integers", None),
    ("negative token id", "POST", C, completion(prompt=[-1]), 400, "token ids must be integers", None),
    ("prompt longer than context", "POST", C, completion(prompt=TOO_LONG), 400, "context", None),
    ("prompt + max_tokens over context", "POST", C, completion(prompt=TOO_LONG[:8000], max_tokens=500), 400,
     "exceeds the model's context", None),
    ("zero max_tokens", "POST", C, completion(max_tokens=0), 400, "'max_tokens' must be >= 1", "max_tokens"),
    ("negative max_tokens", "POST", C, completion(max_tokens=-3), 400, "'max_tokens' must be >= 1", "max_tokens"),
    ("max_tokens not an int", "POST", C, completion(max_tokens="ten"), 400, "must be an integer", "max_tokens"),
    ("max_tokens float", "POST", C, completion(max_tokens=2.5), 400, "must be an integer", "max_tokens"),
    ("temperature wrong type", "POST", C, completion(temperature="hot"), 400, "must be a number", "temperature"),
    ("temperature out of range", "POST", C, completion(temperature=7), 400, "must be <= 2", "temperature"),
    ("top_p zero", "POST", C, completion(top_p=0), 400, "'top_p' must be > 0.0", "top_p"),
    ("n zero", "POST", C, completion(n=0), 400, "'n' must be >= 1", "n"),
    ("n beyond the limit", "POST", C, completion(n=17), 400, "'n' must be <= 16", "n"),
    ("stop wrong type", "POST", C, completion(stop=5), 400, "'stop' must be a string or a list", "stop"),
    ("stop empty string", "POST", C, completion(stop=[""]), 400, "non-empty", "stop"),
    ("logprobs too many", "POST", C, completion(logprobs=21), 400, "'logprobs' must be <= 20", "logprobs"),
    ("stream not a bool", "POST", C, completion(stream="yes"), 400, "must be a boolean", "stream"),
    ("stream_options without stream", "POST", C, completion(stream_options={"include_usage": True}), 400,
     "only allowed when 'stream' is true", "stream_options"),
    ("seed wrong type", "POST", C, completion(seed="x"), 400, "must be an integer", "seed"),
    ("suffix unsupported", "POST", C, completion(suffix="x"), 400, "not supported", "suffix"),
    ("missing messages", "POST", CHAT, chat(messages=...), 400, "'messages' is required", "messages"),
    ("empty messages", "POST", CHAT, chat(messages=[]), 400, "must not be empty", "messages"),
    ("messages not a list", "POST", CHAT, chat(messages="hi"), 400, "must be an array", "messages"),
    ("message not an object", "POST", CHAT, chat(messages=["hi"]), 400, "must be an object", "messages[0]"),
    ("unknown role", "POST", CHAT, chat(messages=[{"role": "wizard", "content": "x"}]), 400,
     "must be one of", "messages[0].role"),
    ("missing role", "POST", CHAT, chat(messages=[{"content": "x"}]), 400, "role' is required", "messages[0].role"),
    ("missing content", "POST", CHAT, chat(messages=[{"role": "user"}]), 400, "content' must be",
     "messages[0].content"),
    ("image part", "POST", CHAT, chat(messages=user([{"type": "image_url", "image_url": {"url": "x"}}])), 400,
     "'image_url' is not supported", "messages[0].content[0]"),
    ("json_schema format without a schema", "POST", CHAT, chat(response_format={"type": "json_schema"}), 400,
     "needs a 'json_schema' object", "response_format"),
    ("invalid json schema", "POST", CHAT,
     chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}),
     400, "invalid json schema", None),
    ("unknown response_format", "POST", CHAT, chat(response_format={"type": "yaml"}), 400,
     "must be one of 'text', 'json_object' or 'json_schema'", "response_format.type"),
    ("invalid regex", "POST", CHAT, chat(regex="[unclosed"), 400, "invalid regex", None),
    ("generate invalid regex", "POST", GEN, {"text": "a", "sampling_params": {"regex": "(a"}}, 400,
     "invalid regex", None),
    ("legacy functions", "POST", CHAT, chat(functions=[{"name": "f"}]), 400, "not supported", "functions"),
    ("top_logprobs without logprobs", "POST", CHAT, chat(top_logprobs=2), 400, "needs 'logprobs'", "top_logprobs"),
    ("chat zero max_completion_tokens", "POST", CHAT, chat(max_completion_tokens=0), 400, ">= 1",
     "max_completion_tokens"),
    ("chat unknown model", "POST", CHAT, chat(model="nope"), 404, "does not exist", "model"),
    ("generate unknown field", "POST", GEN, {"text": "a", "temprature": 1}, 400, "unknown field(s): temprature",
     "temprature"),
    ("generate no input", "POST", GEN, {"sampling_params": {}}, 400, "exactly one of", "text"),
    ("generate both inputs", "POST", GEN, {"text": "a", "input_ids": [1]}, 400, "exactly one of", "text"),
    ("generate unknown sampling key", "POST", GEN, {"text": "a", "sampling_params": {"temprature": 3}}, 400,
     "unknown field(s): sampling_params.temprature", "sampling_params.temprature"),
    ("generate bad sampling value", "POST", GEN, {"text": "a", "sampling_params": {"temperature": -1}}, 400,
     "'sampling_params.temperature' must be >= 0.0", "sampling_params.temperature"),
    ("generate sampling cross-field", "POST", GEN, {"text": "a", "sampling_params": {"min_tokens": 5, "max_tokens": 2}},
     400, "sampling_params: min_tokens (5) must not exceed max_tokens (2)", "sampling_params"),
    ("generate sampling not an object", "POST", GEN, {"text": "a", "sampling_params": [1]}, 400,
     "must be an object", "sampling_params"),
    ("generate empty text", "POST", GEN, {"text": ""}, 400, "prompt is empty", None),
    ("unknown route", "GET", "/v1/nothing", None, 404, "Not Found", None),
    ("wrong method", "GET", C, None, 405, "Method Not Allowed", None),
]


@pytest.fixture(scope="module")
def engine(served_engine):
    served_engine.flush_cache()
    yield served_engine
    served_engine.check_integrity()
    assert not served_engine.has_unfinished_requests()
    served_engine.flush_cache()


@pytest.fixture(scope="module")
def server(engine):
    with BackgroundServer(create_app(engine, ServerOptions(enable_debug_endpoints=True))) as server:
        yield server


@pytest.mark.parametrize("name,method,path,body,status,message,param", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_is_a_clear_4xx(server, name, method, path, body, status, message, param):
    kwargs = {"content": body} if isinstance(body, bytes) else ({"json": body} if body is not None else {})
    response = httpx.request(method, server.url + path, timeout=60, **kwargs)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert message in error["message"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    assert error["type"]


def test_server_still_serves_and_pool_is_intact_after_bad_inputs(server):
    for name, method, path, body, *_ in BAD_INPUTS:
        kwargs = {"content": body} if isinstance(body, bytes) else ({"json": body} if body is not None else {})
        httpx.request(method, server.url + path, timeout=60, **kwargs)
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    response = httpx.post(server.url + C, json=OK_COMPLETION, timeout=60)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 2
    check = httpx.post(server.url + "/debug/check_integrity", timeout=60).json()
    assert check["ok"] and check["stats"]["running"] == 0 and check["stats"]["waiting"] == 0
    assert check["stats"]["blocks_free"] + check["stats"]["blocks_cached"] == check["stats"]["blocks_total"]
    metrics = httpx.get(server.url + "/metrics").text
    assert 'radixserve_http_requests_total{endpoint="/v1/completions",status="400"}' in metrics
    assert 'status="500"' not in metrics


def test_api_key(engine, monkeypatch):
    with BackgroundServer(create_app(engine, ServerOptions(api_key="sekret"))) as server:
        assert httpx.get(server.url + "/health").status_code == 200
        missing = httpx.post(server.url + C, json=OK_COMPLETION)
        assert missing.status_code == 401 and "missing API key" in missing.json()["error"]["message"]
        wrong = httpx.get(server.url + "/v1/models", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(server.url + "/metrics").status_code == 401
        good = httpx.post(server.url + C, json=OK_COMPLETION, headers={"Authorization": "Bearer sekret"}, timeout=60)
        assert good.status_code == 200


def test_queue_full_is_503_with_retry_after(engine):
    options = ServerOptions(max_queued_requests=2, retry_after_s=3, enable_debug_endpoints=True)
    with BackgroundServer(create_app(engine, options)) as server:
        long_prompt = list(range(1000, 1000 + 800))  # seconds of prefill: nobody starts before all arrive

        async def burst():
            async with httpx.AsyncClient(timeout=120) as client:
                posts = [client.post(server.url + C, json=completion(prompt=long_prompt[i:], max_tokens=1))
                         for i in range(4)]
                return await asyncio.gather(*posts)

        responses = asyncio.run(burst())
        assert sorted(r.status_code for r in responses) == [200, 200, 503, 503]
        for refused in (r for r in responses if r.status_code == 503):
            assert refused.headers["retry-after"] == "3" and refused.json()["error"]["code"] == "queue_full"
        assert httpx.post(server.url + C, json=OK_COMPLETION, timeout=60).status_code == 200
        assert httpx.post(server.url + "/debug/check_integrity", timeout=60).json()["ok"]


def test_request_timeout_aborts(engine):
    options = ServerOptions(request_timeout_s=0.5, enable_debug_endpoints=True)
    slow = completion(max_tokens=400, ignore_eos=True)
    with BackgroundServer(create_app(engine, options)) as server:
        start = time.monotonic()
        response = httpx.post(server.url + C, json=slow, timeout=60)
        assert response.status_code == 504 and response.json()["error"]["type"] == "timeout_error"
        assert time.monotonic() - start < 5
        with httpx.stream("POST", server.url + C, json=dict(slow, stream=True), timeout=60) as streamed:
            events = [line for line in streamed.iter_lines() if line.startswith("data: ")]
        assert "timed out" in json.loads(events[-2][len("data: "):])["error"]["message"]
        assert events[-1] == "data: [DONE]"
        stats = _wait_idle(server)
        assert stats["running"] == 0 and stats["waiting"] == 0


def test_engine_step_failure_fails_requests_and_loop_survives(engine, monkeypatch):
    real_step = engine.step
    calls = {"n": 0}

    def failing_once():
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected step failure")
        return real_step()

    monkeypatch.setattr(engine, "step", failing_once)
    with BackgroundServer(create_app(engine, ServerOptions(enable_debug_endpoints=True))) as server:
        failed = httpx.post(server.url + C, json=completion(max_tokens=6, ignore_eos=True), timeout=60)
        assert failed.status_code == 500 and "injected step failure" in failed.json()["error"]["message"]
        assert httpx.get(server.url + "/health").status_code == 200
        ok = httpx.post(server.url + C, json=OK_COMPLETION, timeout=60)
        assert ok.status_code == 200
        assert httpx.post(server.url + "/debug/check_integrity", timeout=60).json()["ok"]


def test_unexpected_error_while_queueing_is_a_500_and_the_loop_survives(engine, monkeypatch):
    real_add = engine.admit
    calls = {"n": 0}

    def failing_once(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected add failure")
        return real_add(*args, **kwargs)

    monkeypatch.setattr(engine, "admit", failing_once)
    with BackgroundServer(create_app(engine, ServerOptions(enable_debug_endpoints=True))) as server:
        failed = httpx.post(server.url + C, json=completion(n=2), timeout=60)
        assert failed.status_code == 500 and "injected add failure" in failed.json()["error"]["message"]
        assert httpx.post(server.url + C, json=completion(n=2), timeout=60).status_code == 200
        assert httpx.post(server.url + "/debug/check_integrity", timeout=60).json()["ok"]


def test_inconsistent_engine_is_marked_broken(engine, monkeypatch):
    def broken_step():
        raise RuntimeError("injected step failure")

    def broken_check():
        raise AssertionError("injected integrity failure")

    monkeypatch.setattr(engine, "step", broken_step)
    monkeypatch.setattr(engine, "check_integrity", broken_check)
    with BackgroundServer(create_app(engine)) as server:
        failed = httpx.post(server.url + C, json=OK_COMPLETION, timeout=60)
        assert failed.status_code == 500 and "the engine failed" in failed.json()["error"]["message"]
        health = httpx.get(server.url + "/health")
        assert health.status_code == 503 and "injected integrity failure" in health.json()["reason"]
        refused = httpx.post(server.url + C, json=OK_COMPLETION, timeout=60)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_failed"
    monkeypatch.undo()
    engine.check_integrity()
    assert not engine.has_unfinished_requests()


def test_shutdown_aborts_running_requests_and_frees_blocks(engine):
    server = BackgroundServer(create_app(engine, ServerOptions(shutdown_grace_s=0.2)), graceful_timeout_s=1).start()
    got_first = threading.Event()

    def stream_forever():
        body = completion(max_tokens=2000, ignore_eos=True, stream=True)
        try:
            with httpx.stream("POST", server.url + C, json=body, timeout=60) as response:
                for _ in response.iter_lines():
                    got_first.set()
        except httpx.HTTPError:
            pass

    client = threading.Thread(target=stream_forever)
    client.start()
    assert got_first.wait(60)
    start = time.monotonic()
    server.stop()
    assert time.monotonic() - start < 15
    client.join(30)
    engine.check_integrity()
    assert not engine.has_unfinished_requests()
    assert engine.pool.num_free + engine.cache.num_evictable_blocks == engine.pool.num_blocks


def _wait_idle(server, timeout_s: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        stats = httpx.post(server.url + "/debug/check_integrity", timeout=60).json()["stats"]
        if (stats["running"] == 0 and stats["waiting"] == 0) or time.monotonic() > deadline:
            return stats
        time.sleep(0.1)
