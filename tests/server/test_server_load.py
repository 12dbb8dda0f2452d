"""64 concurrent streaming clients, a quarter of them leaving mid-stream: the others get
every token, the leavers' requests are aborted, and no block stays held by a request."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from radixserve.server import ServerOptions, create_app
from radixserve.server.testing import BackgroundServer

pytestmark = pytest.mark.real_model

MODEL = "SmolLM2-135M-Instruct"
CLIENTS = 64
MAX_TOKENS = 10
LEAVER_MAX_TOKENS = 2000  # far more than the test waits for: only an abort can end them in time


@pytest.fixture(scope="module")
def served(served_engine):
    served_engine.flush_cache()
    app = create_app(served_engine, ServerOptions())
    with BackgroundServer(app) as server:
        yield server, app.state.server.engine
    served_engine.check_integrity()
    served_engine.flush_cache()


async def _client(http: httpx.AsyncClient, url: str, index: int) -> dict:
    leaver = index % 4 == 3
    body = {
        "model": MODEL,
        "prompt": f"Request number {index} says:",
        "max_tokens": LEAVER_MAX_TOKENS if leaver else MAX_TOKENS,
        "temperature": 0.8,
        "seed": index,
        "ignore_eos": True,
        "logprobs": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    result = {"leaver": leaver, "tokens": 0, "usage": None, "finish": None, "done": False}
    async with http.stream("POST", url + "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                result["done"] = True
                break
            chunk = json.loads(data)
            if chunk.get("usage"):
                result["usage"] = chunk["usage"]
            for choice in chunk["choices"]:
                result["tokens"] += len(choice["logprobs"]["tokens"])
                result["finish"] = choice["finish_reason"] or result["finish"]
            if leaver and result["tokens"] >= 2:
                break  # leaving the block closes the connection mid-stream
    return result


async def _run_clients(url: str) -> list[dict]:
    limits = httpx.Limits(max_connections=CLIENTS + 8, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=180, limits=limits) as http:
        return await asyncio.gather(*(_client(http, url, i) for i in range(CLIENTS)))


def test_concurrent_streams_with_disconnects(served):
    server, async_engine = served
    generated_before = async_engine.run_on_engine(lambda e: e.stats()).result(60)["generated_tokens"]
    results = asyncio.run(_run_clients(server.url))
    stayers = [r for r in results if not r["leaver"]]
    leavers = [r for r in results if r["leaver"]]
    assert len(stayers) == 48 and len(leavers) == 16
    for r in stayers:
        assert r["done"] and r["finish"] == "length"
        assert r["tokens"] == MAX_TOKENS
        assert r["usage"]["completion_tokens"] == MAX_TOKENS
    assert all(not r["done"] and r["tokens"] < LEAVER_MAX_TOKENS for r in leavers)

    stats = _wait_idle_and_check(async_engine)
    assert stats["generated_tokens"] - generated_before < 48 * MAX_TOKENS + 16 * 200
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_non_streaming_client_that_leaves_is_aborted(served):
    server, async_engine = served
    body = {"model": MODEL, "prompt": "Tell me everything", "max_tokens": LEAVER_MAX_TOKENS, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=httpx.Timeout(60, read=1.0))
    _wait_idle_and_check(async_engine)


def _wait_idle_and_check(async_engine, timeout_s: float = 30.0) -> dict:
    """Wait until the engine holds no request, then check its block accounting."""
    deadline = time.monotonic() + timeout_s
    while (stats := async_engine.run_on_engine(lambda e: e.stats()).result(60))["running"] or stats["waiting"]:
        assert time.monotonic() < deadline, f"aborted requests still in the engine: {stats}"
        time.sleep(0.1)
    async_engine.run_on_engine(lambda e: e.check_integrity()).result(60)
    assert stats["blocks_free"] + stats["blocks_cached"] == stats["blocks_total"]
    assert stats["blocks_evictable"] == stats["blocks_cached"]  # no request holds a cached block either
    assert async_engine.num_in_flight == 0 and async_engine.num_queued == 0
    return stats
