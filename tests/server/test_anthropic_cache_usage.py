"""Anthropic's usage counts on a two-turn conversation, checked against the engine's own
counters: cache_read_input_tokens is what the prefix cache served (the engine's
cached_prompt_tokens), cache_creation_input_tokens what the request computed and wrote to
the cache (the whole blocks the cache grew by), input_tokens the rest; the three add up to
the prompt. cache_control marks pin the prefixes they end."""

from __future__ import annotations

import anthropic
import httpx
import pytest

MODEL = "SmolLM2-135M-Instruct"
BLOCK = 16
SYSTEM = ("You are a patient geography tutor. You answer questions about capitals, rivers and mountains in "
          "one short sentence, and you never make up facts you are unsure about.")


@pytest.fixture
def claude(server):
    httpx.post(server.url + "/flush_cache", timeout=60).raise_for_status()
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=300)


def stats(server) -> dict:
    return httpx.get(server.url + "/debug/stats", timeout=60).json()


def ask(client, messages, **extra):
    return client.messages.create(model=MODEL, max_tokens=8, system=SYSTEM, messages=messages,
                                  extra_body={"temperature": 0}, **extra)


def prompt_tokens(client, messages) -> int:
    return client.messages.count_tokens(model=MODEL, system=SYSTEM, messages=messages).input_tokens


def written(prompt: int, output: int) -> int:
    """Prompt tokens in the whole blocks a finished request leaves in the cache (every token
    but the last generated one is computed)."""
    return min(prompt, (prompt + output - 1) // BLOCK * BLOCK)


def test_two_turns_count_exactly_what_the_cache_served_and_stored(claude, server):
    before = stats(server)
    first_turn = [{"role": "user", "content": "What is the capital of France?"}]
    first = ask(claude, first_turn)
    after_first = stats(server)
    p1, u1 = prompt_tokens(claude, first_turn), first.usage
    assert u1.cache_read_input_tokens == after_first["cached_prompt_tokens"] - before["cached_prompt_tokens"] == 0
    assert u1.cache_creation_input_tokens == written(p1, u1.output_tokens) > 0
    assert u1.input_tokens == p1 - u1.cache_creation_input_tokens
    assert after_first["blocks_cached"] == (p1 + u1.output_tokens - 1) // BLOCK  # what it wrote, all of it

    second_turn = first_turn + [{"role": "assistant", "content": first.content[0].text},
                                {"role": "user", "content": "And of Italy?"}]
    second = ask(claude, second_turn)
    after_second = stats(server)
    p2, u2 = prompt_tokens(claude, second_turn), second.usage
    read = after_second["cached_prompt_tokens"] - after_first["cached_prompt_tokens"]
    assert u2.cache_read_input_tokens == read and read % BLOCK == 0
    assert read >= p1 // BLOCK * BLOCK  # the first turn's prompt, and into its reply
    assert u2.cache_creation_input_tokens == written(p2, u2.output_tokens) - read
    assert u2.input_tokens + u2.cache_read_input_tokens + u2.cache_creation_input_tokens == p2
    new_blocks = after_second["blocks_cached"] - after_first["blocks_cached"]
    assert new_blocks == (p2 + u2.output_tokens - 1) // BLOCK - read // BLOCK

    with claude.messages.stream(model=MODEL, max_tokens=8, system=SYSTEM, messages=second_turn,
                                extra_body={"temperature": 0}) as stream:
        final = stream.get_final_message()
    again = stats(server)
    assert final.usage.cache_read_input_tokens == again["cached_prompt_tokens"] - after_second["cached_prompt_tokens"]
    # The same prompt again: all of it is cached but its last token, which is always computed.
    assert final.usage.cache_read_input_tokens == (p2 - 1) // BLOCK * BLOCK
    assert (final.usage.input_tokens + final.usage.cache_read_input_tokens
            + final.usage.cache_creation_input_tokens) == p2


def test_cache_control_pins_the_marked_prefixes(claude, server):
    pins = stats(server)["pins"]
    system = [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    question = [{"role": "user", "content": [
        {"type": "text", "text": "What is the capital of Spain?", "cache_control": {"type": "ephemeral"}}]}]
    message = claude.messages.create(model=MODEL, max_tokens=4, system=system, messages=question,
                                     extra_body={"temperature": 0})
    assert message.content[0].text
    assert stats(server)["pins"] == pins + 2  # one per mark, each on the prefix it ends
    claude.messages.create(model=MODEL, max_tokens=4, system=system, messages=question, extra_body={"temperature": 0})
    assert stats(server)["pins"] == pins + 2  # the same marks again soon after: the pins they have hold
    tiny = [{"type": "text", "text": "Hi.", "cache_control": {"type": "ephemeral", "ttl": "5m"}}]
    claude.messages.create(model=MODEL, max_tokens=2, system=tiny, messages=question[:1],
                           extra_body={"temperature": 0})
    assert stats(server)["pins"] == pins + 2 + 1  # the question's mark; "Hi." is less than a cached block
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "text", "text": "x", "cache_control": {"type": "ephemeral", "ttl": "2h"}}]}])


def test_a_prefix_pinned_lately_is_not_pinned_again_until_a_sixteenth_of_its_ttl():
    from radixserve.server.api.anthropic_pins import RecentPins

    now = [0.0]
    recent = RecentPins(capacity=2, clock=lambda: now[0])
    assert recent.due(("a",), 300.0) and not recent.due(("a",), 300.0)
    assert recent.due(("a",), 3600.0)  # a longer TTL than the pin it has: pinned again
    now[0] = 3600.0 / 16
    assert recent.due(("a",), 3600.0)
    assert recent.due(("b",), 300.0) and recent.due(("c",), 300.0)
    assert recent.due(("a",), 3600.0)  # the oldest key left the bounded ledger


@pytest.fixture(scope="module")
def small_cache(real_model_dir):
    """A server whose KV pool holds 48 blocks (768 tokens), so that a few prompts evict."""
    from radixserve import Engine
    from radixserve.server import ServerOptions, create_app
    from radixserve.server.testing import BackgroundServer

    engine = Engine(str(real_model_dir), num_kv_blocks=48, max_model_len=1024)
    with BackgroundServer(create_app(engine, ServerOptions(enable_debug_endpoints=True))) as server:
        yield server
    assert not engine.has_unfinished_requests()


def test_a_marked_prefix_outlasts_eviction_an_unmarked_one_does_not(small_cache):
    claude = anthropic.Anthropic(base_url=small_cache.url, api_key="unused", max_retries=0, timeout=300)
    question = [{"role": "user", "content": "What is the capital of Spain?"}]

    def run(system) -> int:
        return claude.messages.create(model=MODEL, max_tokens=1, system=system, messages=question,
                                      extra_body={"temperature": 0}).usage.cache_read_input_tokens

    def crowd() -> None:  # other prompts, enough to evict every unprotected block
        for topic in ("rivers", "mountains", "deserts", "oceans", "forests", "islands"):
            text = f"Tell me about {topic}. " + " ".join(f"{topic} fact {i}." for i in range(40))
            claude.messages.create(model=MODEL, max_tokens=1, messages=[{"role": "user", "content": text}],
                                   extra_body={"temperature": 0})

    plain_system = ("You are a cheerful travel agent. You suggest one city to visit for each question and say "
                    "why in a single sentence, never more.")
    assert run(plain_system) == 0
    crowd()
    assert run(plain_system) == 0  # evicted: computed again
    marked = [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    assert run(marked) == 0
    crowd()
    assert run(marked) >= BLOCK * 2  # the pinned system turn was kept ahead of the crowd
