"""POST /v1/messages and /v1/messages/count_tokens through the official anthropic client
against the default model: plain text (greedy equals chat completions), forced tool use
whose input validates and a tool_result round trip that hits the cache up to the reply,
streaming equal to non-streaming in Anthropic's event order, cache_read_input_tokens on a
repeated system prompt, a conversation rendering to the same token ids (and cache) through
either API, x-api-key auth, and every refusal as an Anthropic-shaped 400."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import anthropic
import httpx
import jsonschema
import openai
import pytest

from radixserve.server import ServerOptions, create_app
from radixserve.server.api.anthropic import messages_job
from radixserve.server.api.chat import chat_job
from radixserve.server.protocol import ChatCompletionRequest
from radixserve.engine.prompt_builder import ChatPrompt
from radixserve.server.testing import BackgroundServer

pytestmark = pytest.mark.real_model

MODEL = "SmolLM2-135M-Instruct"
BLOCK = 16  # tokens per KV block: the cache hits whole blocks
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [{"name": "get_weather", "description": "Current weather in a city", "input_schema": SCHEMA}]
OPENAI_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                                   "parameters": SCHEMA}}]
QUESTION = "What is the weather in Paris?"
SYSTEM = ("You are a careful assistant for a travel agency. You answer questions about cities, weather, "
          "trains and museums in one or two short sentences, and you never invent prices or opening hours.")
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def server(served_engine):
    served_engine.flush_cache()
    app = create_app(served_engine, ServerOptions(enable_debug_endpoints=True))
    with BackgroundServer(app) as running:
        running.app = app
        yield running
    served_engine.check_integrity()
    assert not served_engine.has_unfinished_requests()
    served_engine.flush_cache()


@pytest.fixture
def client(server):
    yield anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=300)
    stats = httpx.post(server.url + "/debug/check_integrity", timeout=60).json()["stats"]
    assert stats["running"] == 0 and stats["waiting"] == 0


def create(client, **kwargs: Any):
    values: dict[str, Any] = dict(model=MODEL, max_tokens=24, messages=[{"role": "user", "content": QUESTION}],
                                  extra_body=dict(GREEDY))
    values.update(kwargs)
    return client.messages.create(**values)


def forced_call(client, **kwargs: Any):
    return create(client, system="Use the tools.", tools=TOOLS, max_tokens=40,
                  tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}, **kwargs)


def test_plain_text_equals_chat_completions(client, server):
    out = create(client, messages=[{"role": "user", "content": "Say hello."}], max_tokens=8)
    chat = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hello."}], temperature=0, max_tokens=8)
    assert out.type == "message" and out.role == "assistant" and out.model == MODEL and out.id.startswith("msg_")
    assert [b.type for b in out.content] == ["text"] and out.content[0].text == chat.choices[0].message.content
    assert out.stop_reason == "max_tokens" and out.stop_sequence is None and out.usage.output_tokens == 8
    prompt = out.usage.input_tokens + out.usage.cache_read_input_tokens + out.usage.cache_creation_input_tokens
    assert prompt == chat.usage.prompt_tokens  # exact cache counts: test_anthropic_cache_usage.py
    counted = client.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "Say hello."}])
    assert counted.input_tokens == prompt


def test_end_turn_stop_sequence_and_sampling_fields(client):
    short = [{"role": "user", "content": "What is 2 + 2? Answer with a number."}]  # greedy: "The answer is 4."
    whole = create(client, messages=short, max_tokens=40)
    assert whole.stop_reason == "end_turn" and whole.stop_sequence is None, whole  # the model's own end (EOS)
    text = whole.content[0].text
    word = text.split()[2]
    stopped = create(client, messages=short, max_tokens=40, stop_sequences=["zzz", word], metadata={"user_id": "u-1"})
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == word
    assert stopped.content[0].text == text[: text.index(word)]
    # top_k 1 is greedy at any temperature; top_p and top_k ride in the body (newer clients have no arguments)
    sampled = create(client, messages=short, max_tokens=40, extra_body={"temperature": 1.0, "top_k": 1, "top_p": 0.9})
    assert sampled.content[0].text == text


def test_forced_tool_use_and_a_tool_result_round_trip(client):
    first = forced_call(client)
    assert first.stop_reason == "tool_use"
    (call,) = first.content
    assert call.type == "tool_use" and call.name == "get_weather" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, SCHEMA)
    result = {"type": "tool_result", "tool_use_id": call.id, "content": [{"type": "text", "text": "18 C, sunny"}]}
    history = [{"role": "user", "content": QUESTION}, first.to_param(), {"role": "user", "content": [result]}]
    second = create(client, system="Use the tools.", tools=TOOLS, messages=history, max_tokens=12)
    assert [b.type for b in second.content] == ["text"] and second.content[0].text
    assert second.stop_reason in ("end_turn", "max_tokens")
    # the reply re-sent as a tool_use block renders to the text generated, so the cache reaches into it (as
    # for chat completions: the re-tokenized call text parts from the generated ids within its first block)
    first_prompt = first.usage.input_tokens + first.usage.cache_read_input_tokens + first.usage.cache_creation_input_tokens
    reached = first_prompt + first.usage.output_tokens
    assert second.usage.cache_read_input_tokens >= (reached - 1) // BLOCK * BLOCK - BLOCK
    assert second.usage.cache_read_input_tokens > first_prompt
    # an error result renders differently (its text starts with "Error: ") and still answers the call
    failed = dict(result, is_error=True, content="no such city")
    third = create(client, system="Use the tools.", tools=TOOLS, max_tokens=4,
                   messages=history[:2] + [{"role": "user", "content": [failed]}])
    assert third.content and third.usage.cache_read_input_tokens >= first_prompt - BLOCK


def test_tool_choice_any_auto_and_none(client):
    forced = create(client, tools=TOOLS, max_tokens=40, tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert [b.type for b in forced.content] == ["tool_use"] and forced.stop_reason == "tool_use"
    jsonschema.validate(forced.content[0].input, SCHEMA)
    none = create(client, tools=TOOLS, max_tokens=12, tool_choice={"type": "none"})
    assert all(b.type == "text" for b in none.content)
    auto = create(client, tools=TOOLS, max_tokens=40, tool_choice={"type": "auto"})
    assert auto.content and auto.stop_reason in ("tool_use", "end_turn", "max_tokens")
    if auto.stop_reason == "tool_use":
        jsonschema.validate([b for b in auto.content if b.type == "tool_use"][0].input, SCHEMA)


@pytest.mark.parametrize("case", ["text", "tool"])
def test_stream_assembles_to_the_message(client, server, case):
    kwargs: dict[str, Any] = {"max_tokens": 10} if case == "text" else {
        "system": "Use the tools.", "tools": TOOLS, "max_tokens": 40,
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True}}
    whole = create(client, **kwargs)
    with client.messages.stream(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                extra_body=dict(GREEDY), **kwargs) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert _without_ids(final.content) == _without_ids(whole.content)
    assert (final.stop_reason, final.stop_sequence) == (whole.stop_reason, whole.stop_sequence)
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert (final.usage.input_tokens + final.usage.cache_read_input_tokens + final.usage.cache_creation_input_tokens
            == whole.usage.input_tokens + whole.usage.cache_read_input_tokens + whole.usage.cache_creation_input_tokens)
    # the raw sequence, as Anthropic sends it
    body = {"model": MODEL, "messages": [{"role": "user", "content": QUESTION}], "stream": True, **GREEDY, **kwargs}
    kinds, data = _raw_events(server, body)
    assert kinds[:3] == ["message_start", "content_block_start", "ping"]
    assert kinds[-2:] == ["message_delta", "message_stop"] and kinds.count("ping") == 1
    assert all(k == d["type"] for k, d in zip(kinds, data))
    starts = [d["index"] for d in data if d["type"] == "content_block_start"]
    stops = [d["index"] for d in data if d["type"] == "content_block_stop"]
    assert starts == stops == list(range(len(whole.content)))
    delta = "text_delta" if case == "text" else "input_json_delta"
    assert {d["delta"]["type"] for d in data if d["type"] == "content_block_delta"} == {delta}
    assert data[0]["message"]["stop_reason"] is None and data[0]["message"]["content"] == []
    assert data[-2]["delta"]["stop_reason"] == whole.stop_reason
    assert any(e.type == "content_block_delta" for e in events)


def test_repeated_system_prompt_is_read_from_the_cache(client):
    first = create(client, system=SYSTEM, messages=[{"role": "user", "content": "Is Lyon far from Paris?"}],
                   max_tokens=2)
    second = create(client, system=[{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}],
                    messages=[{"role": "user", "content": "Which museum opens first?"}], max_tokens=2)
    system_tokens = client.messages.count_tokens(model=MODEL, system=SYSTEM, messages=[
        {"role": "user", "content": ""}]).input_tokens
    assert second.usage.cache_read_input_tokens >= (system_tokens - 8) // BLOCK * BLOCK
    assert second.usage.cache_read_input_tokens >= 2 * BLOCK
    assert second.usage.input_tokens < first.usage.input_tokens + first.usage.cache_read_input_tokens


def test_a_conversation_renders_to_the_same_tokens_through_either_api(server, client):
    """The same tool conversation as an Anthropic and as an OpenAI chat request: identical
    prompt token ids; sent one after the other, the second is served from the first's cache."""
    state = server.app.state.server
    anthropic_body = {
        "model": MODEL, "max_tokens": 4, "temperature": 0, "system": "Use the tools.", "tools": TOOLS,
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "What is the weather "}, {"type": "text", "text": "in Paris?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "Let me look."},
                                              {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C"},
                                         {"type": "tool_result", "tool_use_id": "toolu_1", "content": "down", "is_error": True},
                                         {"type": "text", "text": "And tomorrow?"}]},
        ],
    }
    openai_body = {
        "model": MODEL, "max_tokens": 4, "temperature": 0, "tools": OPENAI_TOOLS,
        "messages": [
            {"role": "system", "content": "Use the tools."},
            {"role": "user", "content": [{"type": "text", "text": "What is the weather "}, {"type": "text", "text": "in Paris?"}]},
            {"role": "assistant", "content": "Let me look.", "tool_calls": [
                {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "toolu_1", "content": "18 C"},
            {"role": "tool", "tool_call_id": "toolu_1", "content": "Error: down"},
            {"role": "user", "content": "And tomorrow?"},
        ],
    }
    plain_anthropic = {"model": MODEL, "max_tokens": 4, "system": "Be brief.",
                       "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                                    {"role": "user", "content": [{"type": "text", "text": "Bye"}]}]}
    plain_openai = {"model": MODEL, "max_tokens": 4, "messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}]}
    ids = []
    for a_body, o_body in ((anthropic_body, openai_body), (plain_anthropic, plain_openai)):
        a_ids = _prompt_ids(state, asyncio.run(messages_job(a_body, state.served, state.tools))[0])
        o_job, _ = asyncio.run(chat_job(ChatCompletionRequest.model_validate(o_body), state.served, state.tools))
        assert a_ids == _prompt_ids(state, o_job) and len(a_ids) > BLOCK
        ids.append(a_ids)
    # through HTTP: OpenAI first, then the same conversation from the Anthropic client
    chat = httpx.post(server.url + "/v1/chat/completions", json=openai_body, timeout=120).json()
    prompt = chat["usage"]["prompt_tokens"]
    assert prompt == len(ids[0])
    body = {k: v for k, v in anthropic_body.items() if k != "temperature"}
    out = client.messages.create(**body, extra_body=dict(GREEDY))
    assert out.usage.input_tokens + out.usage.cache_read_input_tokens == prompt
    assert out.usage.cache_read_input_tokens >= (prompt - 1) // BLOCK * BLOCK
    assert out.content[0].text == chat["choices"][0]["message"]["content"]


def test_x_api_key_is_accepted_like_a_bearer_key(served_engine):
    served_engine.flush_cache()
    with BackgroundServer(create_app(served_engine, ServerOptions(api_key="sk-test"))) as keyed:
        good = anthropic.Anthropic(base_url=keyed.url, api_key="sk-test", max_retries=0, timeout=120)
        assert good.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "Hi"}]).input_tokens > 0
        bad = anthropic.Anthropic(base_url=keyed.url, api_key="sk-wrong", max_retries=0, timeout=120)
        with pytest.raises(anthropic.AuthenticationError) as raised:
            bad.messages.create(model=MODEL, max_tokens=1, messages=[{"role": "user", "content": "Hi"}])
        assert raised.value.status_code == 401
        assert raised.value.body["type"] == "error" and raised.value.body["error"]["type"] == "authentication_error"
        models = httpx.get(keyed.url + "/v1/models", headers={"x-api-key": "sk-test"})
        assert models.status_code == 200
        openai_shape = httpx.get(keyed.url + "/v1/models", headers={"x-api-key": "sk-wrong"})
        assert openai_shape.status_code == 401 and openai_shape.json()["error"]["code"] == "invalid_api_key"
    served_engine.flush_cache()


def test_unknown_model_is_a_404_not_found_error(client):
    with pytest.raises(anthropic.NotFoundError) as raised:
        create(client, model="claude-nope")
    assert raised.value.body["error"]["type"] == "not_found_error"


REFUSED = [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                             "data": "AAAA"}}]}]}, "image"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "document"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x", "content": [
        {"type": "image", "source": {}}]}]}]}, "image"),
    ({"messages": [{"role": "user", "content": [{"type": "bogus"}]}]}, "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x", "content": "1"}]}]},
     "matches no earlier tool call"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "get_weather", "input": {}}]}]},
     "cannot hold a 'tool_use' block"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "The answer is"}]}, "prefill"),
    ({"messages": []}, "messages"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search", "max_uses": 2}]}, "web_search_20250305"),
    ({"tools": [{"name": "f", "input_schema": {"type": "string"}}]}, "tools[0].input_schema"),
    ({"tools": [{"name": "f", "input_schema": {"type": "object", "properties": {"a": {"type": "bogus"}}}}]},
     "tools[0].input_schema"),
    ({"tools": TOOLS * 2}, "tools[1].name"),
    ({"tools": [{"name": "bad name!", "input_schema": SCHEMA}]}, "tools[0].name"),
    ({"tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "required"}}, "tool_choice"),
    ({"tool_choice": {"type": "any"}}, "needs at least one tool"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    ({"mcp_servers": [{"type": "url", "url": "http://127.0.0.1:1", "name": "x"}]}, "mcp_servers"),
    ({"container": "c"}, "container"),
    ({"output_config": {"effort": "low"}}, "output_config"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": 10**6}, "exceeds the model's context"),
    ({"temperature": 1.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"stop_sequences": [""]}, "stop_sequences[0]"),
    ({"system": [{"type": "image", "source": {}}]}, "system"),
    ({"no_such_field": 1}, "unknown field(s): no_such_field"),
]


@pytest.mark.parametrize("change, expected", REFUSED, ids=[e for _, e in REFUSED])
def test_refusals_are_anthropic_400s(client, change, expected):
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": QUESTION}]}
    body.update(change)
    with pytest.raises(anthropic.BadRequestError) as raised:
        client.post("/v1/messages", body=body, cast_to=httpx.Response)
    assert raised.value.status_code == 400
    error = raised.value.body
    assert set(error) == {"type", "error"} and error["type"] == "error", error
    assert error["error"]["type"] == "invalid_request_error" and expected in error["error"]["message"], error


def test_count_tokens_refuses_like_messages(client):
    with pytest.raises(anthropic.BadRequestError) as raised:
        client.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}])
    assert "image" in raised.value.body["error"]["message"]


def _prompt_ids(state, job) -> list[int]:
    (prompt,) = job.prompts
    if isinstance(prompt, ChatPrompt):
        return state.engine.engine.build_prompt(prompt).token_ids
    return list(prompt)


def _without_ids(blocks) -> list[dict[str, Any]]:
    return [{k: v for k, v in b.model_dump(exclude_none=True).items() if k != "id"} for b in blocks]


def _raw_events(server, body: dict[str, Any]) -> tuple[list[str], list[dict[str, Any]]]:
    text = httpx.post(server.url + "/v1/messages", json=body, timeout=120).text
    kinds = [line[len("event: "):] for line in text.splitlines() if line.startswith("event: ")]
    data = [json.loads(line[len("data: "):]) for line in text.splitlines() if line.startswith("data: ")]
    assert "[DONE]" not in text and len(kinds) == len(data)
    return kinds, data
