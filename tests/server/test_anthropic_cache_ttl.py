"""Anthropic's cache_control.ttl as a TTL hold, through the official anthropic client: under
pool pressure a marked prefix is demoted to the second tier and read back from it (an
unmarked one, pushed out of a full tier first, is computed again); the hold is the caller's
API key's alone; its TTL is capped by --hint-max-ttl-s, as prompt_cache_retention's is."""

from __future__ import annotations

from types import SimpleNamespace

import anthropic
import httpx
import pytest

from radixserve import Engine
from radixserve.server import ServerOptions, create_app
from radixserve.server.api.anthropic_pins import capped
from radixserve.server.testing import BackgroundServer

pytestmark = pytest.mark.real_model

MODEL = "SmolLM2-135M-Instruct"
BLOCK = 16
MARKED = ("You are a patient geography tutor. You answer questions about capitals, rivers and mountains in one "
          "short sentence, and you never make up facts you are unsure about. Cite the atlas page you used.")
PLAIN = ("You are a cheerful travel agent. You suggest one city to visit for each question and say why in one "
         "short sentence, never more, and you always name the best month to travel there as well.")
KEYS = ServerOptions(api_keys=("key-a", "key-b"), admin_api_keys=("key-admin",), enable_debug_endpoints=True)


@pytest.fixture(scope="module")
def served(real_model_dir):
    """A pool of 40 blocks (a crowd prompt of 39 blocks evicts every other block, pinned ones
    too) and a tier of 48 (the third crowd prompt makes room in it, in eviction order)."""
    engine = Engine(str(real_model_dir), num_kv_blocks=40, max_model_len=1024, kv_offload_memory=48 * 737_280,
                    hint_max_ttl_s=3600)
    with BackgroundServer(create_app(engine, KEYS)) as running:
        yield running, engine
    engine.check_integrity()
    assert not engine.has_unfinished_requests()
    engine.close()


def _client(server, key: str):
    return anthropic.Anthropic(base_url=server.url, api_key=key, max_retries=0, timeout=300)


def _ask(client, system) -> anthropic.types.Usage:
    return client.messages.create(model=MODEL, max_tokens=1, system=system, extra_body={"temperature": 0},
                                  messages=[{"role": "user", "content": "What is the capital of Spain?"}]).usage


def _crowd(client) -> None:
    """Unmarked prompts of 39 blocks each: each evicts the pool's other blocks (to the tier
    while it has room); the third's demotion takes the tier's least worth entries."""
    for topic in ("rivers", "mountains", "deserts"):
        text = f"Tell me about {topic}. " + " ".join(f"{topic} fact number {i} is here." for i in range(66))
        client.messages.create(model=MODEL, max_tokens=1, messages=[{"role": "user", "content": text}],
                               extra_body={"temperature": 0})


def _stats(server) -> dict:
    return httpx.get(server.url + "/debug/stats", headers={"Authorization": "Bearer key-admin"}, timeout=60).json()


def test_a_marked_prefix_is_demoted_to_the_tier_and_read_back_an_unmarked_one_is_dropped(served):
    server, _ = served
    a, b = _client(server, "key-a"), _client(server, "key-b")
    marked = [{"type": "text", "text": MARKED, "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    pins = _stats(server)["pins"]
    assert _ask(a, marked).cache_read_input_tokens == 0
    assert _ask(a, PLAIN).cache_read_input_tokens == 0
    assert _stats(server)["pins"] == pins + 1  # the marked system turn; the plain one has no mark
    _crowd(a)
    before = _stats(server)
    evicted = {k: v for k, v in before.items() if k.startswith("evicted_blocks_")}
    assert evicted.get("evicted_blocks_demoted", 0) > 0 and evicted.get("evicted_blocks_tier_dropped", 0) > 0, evicted
    again = _ask(a, marked)
    after = _stats(server)
    restored = after["restored_prompt_tokens"] - before["restored_prompt_tokens"]
    tier = {k: v for k, v in after.items() if "evict" in k or "tier" in k or "restor" in k}
    assert again.cache_read_input_tokens >= 2 * BLOCK, tier  # the marked system turn came back...
    # ...the blocks of it the crowd pushed out of the pool from the second tier: demoted, not dropped
    assert BLOCK <= restored <= again.cache_read_input_tokens, tier
    assert _ask(a, PLAIN).cache_read_input_tokens == 0, tier  # the unmarked one left the tier first
    # another key's request on the same text reads nothing of key-a's (its own namespace)
    assert _ask(b, marked).cache_read_input_tokens == 0


def test_a_marks_ttl_is_capped_by_the_engines_hold_bound():
    pins = [(3600.0, [1, 2, 3]), (300.0, [1, 2])]
    assert capped(pins, SimpleNamespace(config=SimpleNamespace(hint_max_ttl_s=600))) == [
        (600.0, [1, 2, 3]), (300.0, [1, 2])]
    assert capped(pins, SimpleNamespace(config=SimpleNamespace(hint_max_ttl_s=7200))) == pins
