"""Suffix drafting through the server with two API keys: key B sending the prompt key A had
answered drafts exactly as on an empty cache (the same drafts proposed and accepted, counted
in /metrics), while key A sending it again drafts its cached reply; with keys sharing the
cache, the tree feeds no drafts at all. Real model, loopback."""

from __future__ import annotations

import httpx
import pytest

from radixserve import Engine
from radixserve.server import ServerOptions, create_app
from radixserve.server.testing import BackgroundServer

pytestmark = [pytest.mark.real_model, pytest.mark.slow]

MODEL = "SmolLM2-135M-Instruct"
A = {"Authorization": "Bearer key-a"}
B = {"Authorization": "Bearer key-b"}
ADMIN = {"Authorization": "Bearer key-admin"}
PROMPT = "Write a Python function that returns the squares of the numbers from 1 to n, with a docstring.\n"
COUNTERS = ("radixserve_spec_drafts_total", "radixserve_spec_draft_tokens_total", "radixserve_spec_accepted_tokens_total")


@pytest.fixture(scope="module")
def suffix_engine(real_model_dir):
    engine = Engine(str(real_model_dir), speculative="suffix", speculative_adaptive=False)  # exact counts
    yield engine
    engine.check_integrity()


def _counters(server: BackgroundServer) -> tuple[float, ...]:
    text = httpx.get(server.url + "/metrics", headers=ADMIN, timeout=60).text
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line.startswith("radixserve_spec")}
    return tuple(values[name] for name in COUNTERS)


def _ask(server: BackgroundServer, headers: dict) -> tuple[str, tuple[float, ...]]:
    before = _counters(server)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 48, "temperature": 0}
    answer = httpx.post(server.url + "/v1/completions", json=body, headers=headers, timeout=300)
    assert answer.status_code == 200, answer.text
    after = _counters(server)
    return answer.json()["choices"][0]["text"], tuple(a - b for a, b in zip(after, before))


def test_another_keys_cached_reply_never_feeds_a_draft(suffix_engine):
    keys = ServerOptions(api_keys=("key-a", "key-b"), admin_api_keys=("key-admin",))
    with BackgroundServer(create_app(suffix_engine, keys)) as server:
        text_a, first = _ask(server, A)
        text_b, other = _ask(server, B)
        text_a2, again = _ask(server, A)
    assert text_a == text_b == text_a2 and len(text_a) > 40
    assert other == first  # B drafted as on an empty cache: A's reply fed none of its drafts
    assert again[2] > first[2] + 20  # A's own cached reply feeds A's drafts
    suffix_engine.check_integrity()
    suffix_engine.flush_cache()

    shared = ServerOptions(api_keys=("key-a", "key-b"), admin_api_keys=("key-admin",), shared_cache_across_keys=True)
    with BackgroundServer(create_app(suffix_engine, shared)) as server:
        text_a, shared_first = _ask(server, A)
        text_b, shared_other = _ask(server, B)
    assert text_a == text_b == text_a2
    assert shared_other == shared_first == first  # keys share the cache: no draft reads it
    suffix_engine.flush_cache()
