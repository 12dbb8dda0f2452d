"""Turns that reuse every token, through the official openai client on the default model: the
next turn's cached tokens are every whole block of what the earlier turn computed (its prompt
and its reply), for text replies, forced tool calls, a call cut by max_tokens and a Responses
API conversation continued by previous_response_id; and one key never gets another's ids."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from radixserve.server import ServerOptions, create_app
from radixserve.server.middleware import key_digest
from radixserve.server.protocol import ChatCompletionRequest
from radixserve.server.testing import BackgroundServer
from radixserve.tools.rendering import fallback_messages
from test_tools import ASK, TOOLS, chat

pytestmark = pytest.mark.real_model

MODEL = "SmolLM2-135M-Instruct"
BLOCK = 16


def expected_cached(earlier_prompt: int, earlier_reply: int, prompt: int) -> int:
    """Every whole block the earlier turn computed (all its tokens but the last sampled one),
    within what this prompt may take from the cache (all but its last token)."""
    return min((earlier_prompt + earlier_reply - 1) // BLOCK, (prompt - 1) // BLOCK) * BLOCK


def cached(reply) -> int:
    return reply.usage.prompt_tokens_details.cached_tokens


def assistant_turn(message) -> dict[str, Any]:
    turn: dict[str, Any] = {"role": "assistant", "content": message.content}
    if message.tool_calls:
        turn["tool_calls"] = [{"id": c.id, "type": "function",
                               "function": {"name": c.function.name, "arguments": c.function.arguments}}
                              for c in message.tool_calls]
    return turn


def test_a_text_reply_is_cached_whole_on_the_next_turn(client):
    history = [{"role": "user", "content": "Write two sentences about the sea."}]
    first = client.chat.completions.create(model=MODEL, messages=history, max_tokens=40, temperature=0)
    history += [assistant_turn(first.choices[0].message), {"role": "user", "content": "Now one about rivers."}]
    second = client.chat.completions.create(model=MODEL, messages=history, max_tokens=4, temperature=0)
    assert cached(second) == expected_cached(first.usage.prompt_tokens, first.usage.completion_tokens,
                                             second.usage.prompt_tokens)


def test_forced_calls_are_cached_whole_over_turns(client):
    """Three turns of forced calls (the grammar makes the model split tokens its own way):
    each turn's cached tokens cover every whole block of the turn before."""
    history: list[dict[str, Any]] = list(ASK)
    earlier = None
    for turn in range(3):
        out = chat(client, messages=history, tool_choice="required", parallel_tool_calls=False, max_tokens=48)
        if earlier is not None:
            assert cached(out) == expected_cached(earlier.usage.prompt_tokens, earlier.usage.completion_tokens,
                                                  out.usage.prompt_tokens)
        message = out.choices[0].message
        history.append(assistant_turn(message))
        for call in message.tool_calls:
            history.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 18 + turn})})
        earlier = out


def test_a_call_cut_by_max_tokens_comes_back_as_generated(client, server):
    """A reply cut inside a call is returned as written (finish_reason length), re-sent as
    written, rendered as the bytes the model generated (no close it never wrote), and the
    next turn hits every whole block of it."""
    history: list[dict[str, Any]] = list(ASK)
    for max_tokens in range(16, 48, 4):
        out = chat(client, messages=history, tool_choice="required", parallel_tool_calls=False, max_tokens=max_tokens)
        if out.choices[0].message.tool_calls:
            break
    assert out.choices[0].finish_reason == "length"
    call = out.choices[0].message.tool_calls[0]
    with pytest.raises(ValueError):
        json.loads(call.function.arguments)
    history.append(assistant_turn(out.choices[0].message))
    history.append({"role": "tool", "tool_call_id": call.id, "content": "error: your call was cut off; try again"})
    again = chat(client, messages=history, tool_choice="required", parallel_tool_calls=False, max_tokens=48)
    assert again.choices[0].finish_reason == "tool_calls"
    assert cached(again) == expected_cached(out.usage.prompt_tokens, out.usage.completion_tokens,
                                            again.usage.prompt_tokens)
    state = server.app.state.server
    body = ChatCompletionRequest.model_validate({"model": MODEL, "messages": history, "tools": TOOLS})
    messages = fallback_messages(body.history(), list(body.tool_spec().tools), state.tools.fmt)
    text = state.tools.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    fmt = state.tools.fmt
    written = fmt.block_open + fmt.call_begin(call.function.name) + fmt.render_arguments(call.function.arguments)
    assert f"<|im_start|>assistant\n{written}<|im_end|>" in text


def test_previous_response_id_continues_from_the_stored_ids(client):
    first = client.responses.create(model=MODEL, input="Name three colours of the rainbow.", max_output_tokens=30,
                                    temperature=0)
    second = client.responses.create(model=MODEL, input="And two more.", previous_response_id=first.id,
                                     max_output_tokens=4, temperature=0)
    assert second.usage.input_tokens_details.cached_tokens == expected_cached(
        first.usage.input_tokens, first.usage.output_tokens, second.usage.input_tokens)


def test_one_key_never_gets_another_keys_reply_ids(engine):
    """A's reply ids are stored under A's namespace alone (even where keys share the cache):
    B re-sending A's conversation is prompted with its text tokenized as ever, A with its ids."""
    options = ServerOptions(api_keys=("key-a", "key-b"), shared_cache_across_keys=True, enable_debug_endpoints=True)
    ns_a, ns_b = f"key:{key_digest('key-a')}", f"key:{key_digest('key-b')}"
    ids = {"return_token_ids": True}
    with BackgroundServer(create_app(engine, options)) as server:
        a = openai.OpenAI(base_url=server.url + "/v1", api_key="key-a", max_retries=0, timeout=300)
        b = openai.OpenAI(base_url=server.url + "/v1", api_key="key-b", max_retries=0, timeout=300)
        out = chat(a, tool_choice="required", parallel_tool_calls=False, max_tokens=48, extra_body=ids)
        generated = out.model_extra["prompt_token_ids"] + out.choices[0].model_extra["token_ids"]
        replies = server.app.state.server.replies
        [text] = replies.texts(ns_a)
        assert replies.texts(ns_b) == [] and replies.texts(None) == []
        history = list(ASK) + [assistant_turn(out.choices[0].message), {"role": "user", "content": "Thanks."}]
        answers = {name: client.chat.completions.create(
            model=MODEL, messages=history, tools=TOOLS, tool_choice="none", max_tokens=4, temperature=0, extra_body=ids)
            for name, client in (("b", b), ("a", a))}
        prompt_b = answers["b"].model_extra["prompt_token_ids"]
        assert prompt_b == engine.tokenizer.encode(engine.tokenizer.decode(prompt_b), add_special_tokens=False)
        assert answers["a"].model_extra["prompt_token_ids"][: len(generated)] == generated
        assert replies.texts(ns_b) == [answers["b"].choices[0].message.content]
        assert text in replies.texts(ns_a)


def test_a_template_in_place_of_the_models_own_reuses_the_reply_ids(engine):
    """--chat-template (Qwen 2.5's tool template, rendered in the server): the turn marks come
    from the template in force, and the next prompt begins with the earlier prompt and every id
    generated."""
    from pathlib import Path

    template = (Path(__file__).parents[1] / "templates" / "hermes.jinja").read_text()
    ids = {"return_token_ids": True}
    with BackgroundServer(create_app(engine, ServerOptions(chat_template=template))) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        history: list[dict[str, Any]] = list(ASK)
        earlier: list[int] | None = None
        for turn in range(2):
            out = chat(client, messages=history, tool_choice="required", parallel_tool_calls=False, max_tokens=48,
                       extra_body=ids)
            prompt = out.model_extra["prompt_token_ids"]
            if earlier is not None:
                assert prompt[: len(earlier)] == earlier
            earlier = prompt + out.choices[0].model_extra["token_ids"]
            history.append(assistant_turn(out.choices[0].message))
            history += [{"role": "tool", "tool_call_id": c.id, "content": "{\"temperature_c\": 18}"}
                        for c in out.choices[0].message.tool_calls]


def test_anthropic_messages_reuse_the_reply_ids(server):
    """Forced tool use over /v1/messages through the anthropic client, three turns: each turn
    reads from the cache every whole block of the turn before (its prompt and its reply)."""
    import anthropic

    from test_anthropic_api import TOOLS as ANTHROPIC_TOOLS

    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=300)
    history: list[dict[str, Any]] = [{"role": "user", "content": "What is the weather in Paris? Use celsius."}]
    earlier = None
    for turn in range(3):
        out = client.messages.create(model=MODEL, max_tokens=48, messages=history, tools=ANTHROPIC_TOOLS,
                                     tool_choice={"type": "any", "disable_parallel_tool_use": True})
        usage = out.usage
        prompt = usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens
        if earlier is not None:
            assert usage.cache_read_input_tokens == expected_cached(earlier[0], earlier[1], prompt)
        earlier = (prompt, usage.output_tokens)
        history.append({"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in out.content]})
        history.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": block.id, "content": json.dumps({"temperature_c": 18 + turn})}
            for block in out.content if block.type == "tool_use"]})
