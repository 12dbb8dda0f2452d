"""POST /v1/responses through the official openai client against the default model: plain
and streamed text (greedy equals chat completions), required function calls whose
arguments validate, streaming == non-streaming, a tool loop continued by re-sending the
items and by previous_response_id (the second turn hits the first's cache), and bad
inputs (a 400 naming the field, nothing left allocated)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import pytest


pytestmark = pytest.mark.real_model

MODEL = "SmolLM2-135M-Instruct"
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Current weather in a city", "parameters": SCHEMA}]
QUESTION = "What is the weather in Paris?"


def create(client, **kwargs: Any):
    values = dict(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=40)
    values.update(kwargs)
    return client.responses.create(**values)


def test_plain_text_equals_chat_completions(client):
    out = create(client, input="Say hello.", max_output_tokens=8)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hello."}],
                                          temperature=0, max_tokens=8)
    assert out.output_text == chat.choices[0].message.content and out.output_text
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    assert out.usage.output_tokens == 8 and out.usage.input_tokens == chat.usage.prompt_tokens
    assert out.usage.input_tokens_details.cached_tokens >= 0 and out.object == "response"


def test_instructions_are_a_system_turn(client):
    with_instructions = create(client, input="Say hello.", instructions="Answer in French.", max_output_tokens=6)
    chat = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=6,
        messages=[{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Say hello."}],
    )
    assert with_instructions.output_text == chat.choices[0].message.content


def test_stream_assembles_to_the_response(client):
    for kwargs in ({"input": "Say hello.", "max_output_tokens": 8},
                   {"tools": TOOLS, "tool_choice": "required", "temperature": 0.7, "extra_body": {"seed": 3}}):
        whole = create(client, **kwargs)
        events = list(create(client, stream=True, **kwargs))
        kinds = [e.type for e in events]
        assert kinds[:2] == ["response.created", "response.in_progress"]
        assert kinds[-1] in ("response.completed", "response.incomplete")
        assert [e.sequence_number for e in events] == list(range(len(events)))
        final = events[-1].response
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
        assert text == whole.output_text == final.output_text
        assert arguments == "".join(i.arguments for i in whole.output if i.type == "function_call")
        assert [(i.type, getattr(i, "name", None)) for i in final.output] == [
            (i.type, getattr(i, "name", None)) for i in whole.output]
        done = [e.item for e in events if e.type == "response.output_item.done"]
        assert [i.id for i in done] == [i.id for i in final.output]


def test_streaming_helper_gets_the_final_response(client):
    with client.responses.stream(model=MODEL, input="Say hello.", temperature=0, max_output_tokens=60) as stream:
        for _ in stream:
            pass
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_text


def test_required_call_and_a_loop_by_previous_response_id(client):
    first = create(client, instructions="Use the tools.", tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), SCHEMA)
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "18 C, sunny"}
    second = create(client, instructions="Use the tools.", tools=TOOLS, tool_choice="none",
                    previous_response_id=first.id, input=[result], max_output_tokens=8)
    assert second.output_text and all(i.type == "message" for i in second.output)
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 16
    # the same turn with the history re-sent as items renders to the same prompt
    items = [{"role": "user", "content": QUESTION},
             {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
             result]
    resent = create(client, instructions="Use the tools.", tools=TOOLS, tool_choice="none", input=items,
                    max_output_tokens=8)
    assert resent.output_text == second.output_text
    assert resent.usage.input_tokens == second.usage.input_tokens
    assert resent.usage.input_tokens_details.cached_tokens >= second.usage.input_tokens - 16


def test_store_false_is_not_kept(client, server):
    out = create(client, input="Hi", store=False, max_output_tokens=2)
    assert out.store is False
    answer = httpx.post(server.url + "/v1/responses", timeout=60,
                        json={"model": MODEL, "input": "again", "previous_response_id": out.id})
    assert answer.status_code == 404 and answer.json()["error"]["param"] == "previous_response_id"
    unknown = httpx.post(server.url + "/v1/responses", timeout=60,
                         json={"model": MODEL, "input": "again", "previous_response_id": "resp_nope"})
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "response_not_found"


BAD = [
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"tools": [{"type": "function", "name": "x", "parameters": {"type": "bogus"}}]}, "tools[0].parameters"),
    ({"tools": TOOLS * 2}, "tools[1].name"),
    ({"input": [{"type": "function_call_output", "call_id": "call_x", "output": "1"}]}, "input[0].call_id"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0]"),
    ({"input": []}, "input"),
    ({"background": True}, "background"),
    ({"tools": TOOLS, "tool_choice": "required", "text": {"format": {"type": "json_object"}}}, "text.format"),
]


@pytest.mark.parametrize("change, param", BAD, ids=[p for _, p in BAD])
def test_bad_input_is_a_400_naming_the_field(server, client, change, param):
    body = {"model": MODEL, "input": QUESTION, "max_output_tokens": 4}
    body.update(change)
    answer = httpx.post(server.url + "/v1/responses", json=body, timeout=60)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error


def test_a_call_cut_inside_its_arguments_is_accepted_back_as_written(client):
    """An agent re-sends a call a max_output_tokens limit cut off: it renders as written."""
    out = create(client, input=[
        {"role": "user", "content": QUESTION},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Par'},
        {"type": "function_call_output", "call_id": "c1", "output": "error: the call was cut off"},
    ], max_output_tokens=4)
    assert out.status == "incomplete" and out.output
