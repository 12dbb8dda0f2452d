"""OpenAI's prompt_cache_retention over HTTP (the default model, the official openai client):
"24h" holds the request's prefix as an agent hint's ttl_s does (in the caller's namespace,
capped by --hint-max-ttl-s), "in_memory" is the default caching, anything else a 400 naming
the field; an explicit agent hint's TTL wins."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from radixserve import Engine
from radixserve.server import ServerOptions, create_app
from radixserve.server.testing import BackgroundServer

pytestmark = pytest.mark.real_model

KEYS = ServerOptions(api_keys=("key-a",), admin_api_keys=("key-admin",), enable_debug_endpoints=True)
ADMIN = {"Authorization": "Bearer key-admin"}


@pytest.fixture(scope="module")
def served(real_model_dir):
    engine = Engine(str(real_model_dir), num_kv_blocks=256, hint_max_ttl_s=3600)
    with BackgroundServer(create_app(engine, KEYS)) as running:
        yield running, engine
    engine.close()


def _chat(server, content: str, **extra):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="key-a", max_retries=0, timeout=300)
    return client.chat.completions.create(model="SmolLM2-135M-Instruct", max_tokens=4, temperature=0,
                                          messages=[{"role": "user", "content": content}], extra_body=extra or None)


def _holds(server, engine) -> list[float]:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        stats = httpx.get(server.url + "/debug/stats", headers=ADMIN, timeout=30).json()
        if stats["running"] == 0 and stats["waiting"] == 0:
            break
        time.sleep(0.05)
    return sorted(h.ttl_s for h in engine.kv.sessions.holds._holds.values())


def test_retention_24h_is_a_capped_ttl_hold_and_in_memory_holds_nothing(served):
    server, engine = served
    before = _holds(server, engine)
    _chat(server, "Keep this prefix for a day. " * 6, prompt_cache_retention="in_memory")
    assert _holds(server, engine) == before
    _chat(server, "Keep this prefix for a day. " * 6, prompt_cache_retention="24h")
    assert _holds(server, engine) == sorted(before + [3600.0])  # 24 h, capped by hint_max_ttl_s
    _chat(server, "An explicit hint wins. " * 6, prompt_cache_retention="24h", agent_hints={"ttl_s": 60})
    assert _holds(server, engine) == sorted(before + [3600.0, 60.0])


def test_a_bad_retention_is_a_400_naming_it(served):
    server, _ = served
    with pytest.raises(openai.BadRequestError) as caught:
        _chat(server, "hi", prompt_cache_retention="forever")
    assert "prompt_cache_retention" in str(caught.value)
