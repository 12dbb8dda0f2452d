"""Gemma 3 270M (a base model whose GGUF carries no chat template) served over HTTP through
the official openai client: completions as it is; chat refused with a clear 400 until a
template is given (--chat-template), then served, a second turn reusing the first's KV
past the sliding window (hybrid KV)."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from radixserve import Engine
from radixserve.server import ServerOptions, create_app
from radixserve.server.testing import BackgroundServer

pytestmark = [pytest.mark.real_model, pytest.mark.slow]

GEMMA_TEMPLATE = (Path(__file__).parent.parent / "server" / "templates" / "gemma3.jinja").read_text(encoding="utf-8")
WINDOW = 512


@pytest.fixture(scope="module")
def gemma_engine():
    engine = Engine("gemma3-270m", max_model_len=4096)
    assert engine.runner.pool.hybrid
    return engine


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def test_completions_serve_and_chat_without_a_template_is_a_clear_400(gemma_engine):
    with BackgroundServer(create_app(gemma_engine, ServerOptions())) as server:
        client = _client(server)
        out = client.completions.create(model="gemma3-270m", prompt="The capital of France is", max_tokens=8,
                                        temperature=0)
        assert out.choices[0].text.startswith(" the capital of the country of France")
        with pytest.raises(openai.BadRequestError, match="has no chat template: serve it with --chat-template"):
            client.chat.completions.create(model="gemma3-270m", messages=[{"role": "user", "content": "Hi"}])
        out = client.completions.create(model="gemma3-270m", prompt="1, 2, 3,", max_tokens=4, temperature=0)
        assert out.choices[0].finish_reason == "length"  # still serving after the 400
    gemma_engine.check_integrity()


def test_chat_with_a_template_reuses_a_turn_longer_than_the_window(gemma_engine):
    with BackgroundServer(create_app(gemma_engine, ServerOptions(chat_template=GEMMA_TEMPLATE))) as server:
        client = _client(server)
        context = " ".join(f"Fact {i}: the number {i} squared is {i * i}." for i in range(90))
        messages = [{"role": "user", "content": f"{context}\nWhat is 7 squared?"}]
        first = client.chat.completions.create(model="gemma3-270m", messages=messages, max_tokens=12, temperature=0)
        assert first.usage.prompt_tokens > 2 * WINDOW
        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "And 8 squared?"}]
        second = client.chat.completions.create(model="gemma3-270m", messages=messages, max_tokens=12, temperature=0)
        cached = second.usage.prompt_tokens_details.cached_tokens
        assert cached >= first.usage.prompt_tokens // 16 * 16 > 2 * WINDOW
    gemma_engine.check_integrity()
