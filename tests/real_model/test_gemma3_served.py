"""Gemma 3 270M (a base model whose GGUF carries no chat template) served over HTTP through
the official openai client: completions as it is; chat through the built-in Gemma template
(model/builtin_template.py: its turn format, exact prompt ids), said so at startup, with tool
calls through the fallback rendering; --chat-template overrides it; a second turn reuses the
first's KV past the sliding window (hybrid KV)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from radixserve import Engine, SamplingParams
from radixserve.model.builtin_template import builtin_name
from radixserve.server import ServerOptions, create_app
from radixserve.server.chat_template import template_in_force
from radixserve.server.testing import BackgroundServer
from subprocess_server import free_port, wait_healthy

pytestmark = [pytest.mark.real_model, pytest.mark.slow]

GEMMA_TEMPLATE = (Path(__file__).parents[1] / "templates" / "gemma3.jinja").read_text(encoding="utf-8")
WINDOW = 512
TWO_TURNS = ("<bos><start_of_turn>user\nYou are terse.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n"
             "<start_of_turn>user\nWhat is 2 + 2?<end_of_turn>\n<start_of_turn>model\n")
PLAIN_TEMPLATE = ("{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
                  "{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}")


@pytest.fixture(scope="module")
def gemma_engine():
    engine = Engine("gemma3-270m", max_model_len=4096)
    assert engine.runner.pool.hybrid
    return engine


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def test_completions_and_chat_through_the_builtin_gemma_template(gemma_engine):
    assert builtin_name(gemma_engine.tokenizer.chat_template) == "gemma3"
    with BackgroundServer(create_app(gemma_engine, ServerOptions())) as server:
        client = _client(server)
        out = client.completions.create(model="gemma3-270m", prompt="The capital of France is", max_tokens=8,
                                        temperature=0)
        assert out.choices[0].text.startswith(" the capital of the country of France")
        messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "What is 2 + 2?"}]
        chat = client.chat.completions.create(model="gemma3-270m", messages=messages, max_tokens=6, temperature=0,
                                              extra_body={"return_token_ids": True})
        ids = chat.model_extra["prompt_token_ids"]
        assert gemma_engine.tokenizer.decode(ids) == TWO_TURNS
        assert ids == gemma_engine.tokenizer.encode(TWO_TURNS, add_special_tokens=False)
        assert ids[:1] == [gemma_engine.tokenizer.bos_token_id] and ids[-3:] == [105, 4368, 107]  # <start_of_turn>model\n
        assert chat.usage.prompt_tokens == len(ids) and chat.choices[0].finish_reason in ("stop", "length")
        tools = [{"type": "function", "function": {"name": "add", "parameters": {
            "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"], "additionalProperties": False}}}]
        called = client.chat.completions.create(model="gemma3-270m", messages=messages[3:], tools=tools,
                                                tool_choice="required", max_tokens=40, temperature=0)
        (call,) = called.choices[0].message.tool_calls  # hermes, through the fallback rendering
        assert call.function.name == "add" and set(json.loads(call.function.arguments)) == {"a", "b"}
    (local,) = gemma_engine.chat(messages, SamplingParams(max_tokens=6, temperature=0))  # in-process alike
    assert local.prompt_token_ids == ids and local.text == chat.choices[0].message.content
    with BackgroundServer(create_app(gemma_engine, ServerOptions(chat_template=PLAIN_TEMPLATE))) as server:
        chat = _client(server).chat.completions.create(model="gemma3-270m", messages=messages, max_tokens=1,
                                                       extra_body={"return_token_ids": True})
        assert gemma_engine.tokenizer.decode(chat.model_extra["prompt_token_ids"]) == \
            "system: You are terse.\nuser: Hi\nassistant: Hello!\nuser: What is 2 + 2?\nassistant:"
    gemma_engine.check_integrity()


def test_the_startup_line_says_which_template(gemma_engine):
    """`serve` prints the template in force at start (one real start: the built-in one); what
    the line says under --chat-template is the same function on the same tokenizer."""
    port = free_port()
    command = [sys.executable, "-m", "radixserve", "serve", "--model", "gemma3-270m", "--port", str(port),
               "--num-kv-blocks", "256", "--max-model-len", "1024", "--log-level", "warning"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", process, process.stdout.read)
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        output = process.stdout.read()
    line = next(line for line in output.splitlines() if line.startswith("radixserve: serving gemma3-270m"))
    assert "chat template: built-in gemma3 (the model file has none" in line, output
    assert template_in_force(gemma_engine.tokenizer, None) in line
    assert template_in_force(gemma_engine.tokenizer, PLAIN_TEMPLATE) == "--chat-template"


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
