"""Tool calling over HTTP with the official openai client against the default model:
constrained calls whose arguments validate (greedy and sampled), single and parallel
calls, streaming == non-streaming, a two-turn tool loop whose second turn hits the first
turn's cached prefix, and the bad inputs (a 400 naming the field, nothing left allocated).
The engine's integrity is checked after every test."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import pytest

from radixserve.tools import MAX_TOOLS

pytestmark = pytest.mark.real_model

MODEL = "SmolLM2-135M-Instruct"
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ADD_SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999}, "b": {"type": "integer", "minimum": 0, "maximum": 999}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                      "parameters": WEATHER_SCHEMA}},
    {"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": ADD_SCHEMA}},
]
SCHEMAS = {"get_weather": WEATHER_SCHEMA, "add": ADD_SCHEMA}
ASK = [{"role": "user", "content": "What is the weather in Paris and in Oslo? Use celsius."}]


def chat(client, **kwargs: Any):
    values = dict(model=MODEL, messages=ASK, tools=TOOLS, temperature=0, max_tokens=60)
    values.update(kwargs)
    return client.chat.completions.create(**values)


def assert_valid_calls(message) -> list[tuple[str, dict]]:
    calls = []
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        calls.append((call.function.name, arguments))
    return calls


def test_required_single_call_greedy(client):
    out = chat(client, tool_choice="required", parallel_tool_calls=False)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    calls = assert_valid_calls(choice.message)
    assert calls == [("get_weather", {"city": "Paris", "unit": "c"})]


def test_named_call_sampled_validates(client):
    for seed in (1, 2, 3):
        out = chat(client, tool_choice={"type": "function", "function": {"name": "add"}},
                   messages=[{"role": "user", "content": "Add 12 and 30."}], temperature=1.0, seed=seed)
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls"
        calls = assert_valid_calls(choice.message)
        assert calls and all(name == "add" for name, _ in calls)


def test_parallel_calls(client):
    out = chat(client, tool_choice="required", max_tokens=120)
    calls = assert_valid_calls(out.choices[0].message)
    assert len(calls) >= 2  # greedy: one call per city asked about
    assert len({c.id for c in out.choices[0].message.tool_calls}) == len(calls)


def test_stream_assembles_to_the_non_streamed_answer(client):
    kwargs = dict(tool_choice="required", max_tokens=120, temperature=0.8, seed=7)
    whole = chat(client, **kwargs).choices[0]
    content, calls, reasons = "", {}, []
    for chunk in chat(client, stream=True, **kwargs):
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for call in delta.tool_calls or []:
                if call.index not in calls:  # the first delta of a call has its id and name
                    assert call.id and call.function.name
                    calls[call.index] = {"id": call.id, "name": call.function.name, "arguments": ""}
                else:
                    assert call.id is None and not call.function.name
                calls[call.index]["arguments"] += call.function.arguments or ""
            if choice.finish_reason:
                reasons.append(choice.finish_reason)
    assert (content or None) == whole.message.content
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls
    ]
    assert reasons == [whole.finish_reason] == ["tool_calls"]


def test_tool_choice_none_and_auto_answer_in_text(client):
    out = chat(client, tool_choice="none", max_tokens=12)
    assert out.choices[0].message.tool_calls is None and out.choices[0].message.content
    auto = chat(client, max_tokens=40)
    message = auto.choices[0].message
    if message.tool_calls:  # auto: the model decides; whatever it wrote parses
        assert_valid_calls(message)
    else:
        assert message.content and auto.choices[0].finish_reason in ("stop", "length")


def test_two_turn_tool_loop_hits_the_cache(client):
    history: list[dict[str, Any]] = [{"role": "system", "content": "You are a weather assistant."}] + ASK
    previous_prompt = None
    for turn in range(3):
        out = chat(client, messages=history, tool_choice="required" if turn < 2 else "none",
                   parallel_tool_calls=False, max_tokens=60 if turn < 2 else 10)
        if previous_prompt is not None:  # everything the previous turn sent is cached, but the last partial block
            assert out.usage.prompt_tokens_details.cached_tokens >= previous_prompt - 16
        previous_prompt = out.usage.prompt_tokens
        message = out.choices[0].message
        if turn == 2:
            assert message.content and not message.tool_calls
            break
        (name, arguments), = assert_valid_calls(message)
        history.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": c.function.arguments}}
            for c in message.tool_calls
        ]})
        history.append({"role": "tool", "tool_call_id": message.tool_calls[0].id,
                        "content": json.dumps({"city": arguments["city"], "temperature_c": 18 + turn})})


def test_a_call_cut_by_max_tokens_is_returned_and_accepted_back_as_written(client):
    """An agent loop goes on after a reply cut inside its call: the arguments come back as
    written (finish_reason length), and the next turn, which re-sends them, is served."""
    history: list[dict[str, Any]] = list(ASK)
    for max_tokens in range(16, 48, 4):  # the first budget that ends inside the call's arguments
        out = chat(client, messages=history, tool_choice="required", parallel_tool_calls=False, max_tokens=max_tokens)
        choice = out.choices[0]
        if choice.message.tool_calls:
            break
    assert choice.finish_reason == "length"
    call = choice.message.tool_calls[0]
    with pytest.raises(ValueError):
        json.loads(call.function.arguments)  # cut inside the call
    history.append({"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                         "arguments": call.function.arguments}}]})
    history.append({"role": "tool", "tool_call_id": call.id, "content": "error: your call was cut off; try again"})
    again = chat(client, messages=history, tool_choice="required", parallel_tool_calls=False, max_tokens=60)
    assert again.choices[0].finish_reason == "tool_calls"
    assert_valid_calls(again.choices[0].message)
    assert again.usage.prompt_tokens_details.cached_tokens >= out.usage.prompt_tokens - 16


BAD = [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required", "tools": None}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "x", "parameters": {"type": "bogus"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(MAX_TOOLS + 1)]}, "tools"),
    ({"tools": TOOLS + [TOOLS[0]]}, "tools[2].function.name"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"response_format": {"type": "json_object"}, "tool_choice": "required"}, "response_format"),
    ({"messages": ASK + [
        {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function",
                                              "function": {"name": "add", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_2", "content": "3"}]}, "messages[2].tool_call_id"),
    ({"messages": [{"role": "tool", "content": "3"}]}, "messages[0].tool_call_id"),
]


@pytest.mark.parametrize("change, param", BAD, ids=[p for _, p in BAD])
def test_bad_input_is_a_400_naming_the_field(server, client, change, param):
    body = {"model": MODEL, "messages": ASK, "tools": TOOLS, "max_tokens": 4}
    body.update(change)
    body = {k: v for k, v in body.items() if v is not None}
    answer = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
