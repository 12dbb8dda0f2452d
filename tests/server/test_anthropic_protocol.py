"""Anthropic's wire format without a model: error bodies and statuses, the event framing
(an error mid-stream included), and how a body becomes chat turns and a ToolSpec."""

from __future__ import annotations

import asyncio
import json

import pytest

from radixserve.server.api.anthropic import AnthropicEventStream
from radixserve.server.errors import APIError, bad_request, error_response, unavailable
from radixserve.server.protocol.anthropic import MessagesRequest, parse


def _body(response) -> dict:
    return json.loads(response.body)


def test_errors_take_anthropic_shape_and_statuses_on_its_routes_only():
    full = error_response("/v1/messages", unavailable("the queue is full", "queue_full", retry_after_s=2))
    assert full.status_code == 529 and full.headers["retry-after"] == "2"
    assert _body(full) == {"type": "error", "error": {"type": "overloaded_error", "message": "the queue is full"}}
    timeout = error_response("/v1/messages/count_tokens", APIError(504, "slow", type="timeout_error"))
    assert timeout.status_code == 504 and _body(timeout)["error"]["type"] == "timeout_error"
    assert _body(error_response("/v1/messages", APIError(500, "boom")))["error"]["type"] == "api_error"
    assert _body(error_response("/v1/messages", APIError(413, "big")))["error"]["type"] == "request_too_large"
    openai = error_response("/v1/chat/completions", bad_request("no", param="x"))
    assert openai.status_code == 400 and _body(openai)["error"]["param"] == "x"
    assert error_response("/v1/messagesX", bad_request("no")).status_code == 400
    assert "param" in _body(error_response("/v1/messagesX", bad_request("no")))["error"]


def test_event_stream_frames_events_and_an_error_without_done():
    async def events():
        yield {"type": "message_start", "message": {}}
        raise unavailable("the server is shutting down", "shutting_down")

    sent: list[bytes] = []
    closed: list[bool] = []

    async def run():
        async def receive():
            await asyncio.sleep(10)
            return {"type": "http.disconnect"}

        async def send(message):
            if message["type"] == "http.response.body":
                sent.append(message["body"])

        await AnthropicEventStream(events(), on_close=lambda: closed.append(True))({}, receive, send)

    asyncio.run(run())
    text = b"".join(sent).decode()
    assert text == (
        'event: message_start\ndata: {"type": "message_start", "message": {}}\n\n'
        'event: error\ndata: {"type": "error", "error": {"type": "overloaded_error", '
        '"message": "the server is shutting down"}}\n\n'
    )
    assert closed == [True]


def test_history_and_tool_spec():
    body = parse(MessagesRequest, {
        "model": "m", "max_tokens": 1, "system": [{"type": "text", "text": "A"}, {"type": "text", "text": "B"}],
        "tools": [{"name": "f", "input_schema": {"properties": {"x": {"type": "integer"}}, "type": "object"}}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "messages": [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {"x": 1, "y": "é"}}]},
            {"role": "user", "content": [{"type": "text", "text": "before"},
                                         {"type": "tool_result", "tool_use_id": "t1", "is_error": True,
                                          "content": [{"type": "text", "text": "bad "}, {"type": "text", "text": "x"}]},
                                         {"type": "text", "text": "after"}]},
        ],
    })
    turns = [(m.role, m.content, [(c.id, c.name, c.arguments) for c in m.tool_calls], m.tool_call_id)
             for m in body.history()]
    assert turns == [
        ("system", "AB", [], None), ("user", "q", [], None),
        ("assistant", None, [("t1", "f", '{"x": 1, "y": "é"}')], None),
        ("user", "before", [], None), ("tool", "Error: bad x", [], "t1"), ("user", "after", [], None),
    ]
    spec = body.tool_spec()
    assert (spec.mode, spec.named, spec.parallel, spec.names) == ("required", None, False, ["f"])
    # the schema is kept as given (its key order is part of the rendered tools)
    assert list(spec.tools[0].parameters) == ["properties", "type"]
    assert body.uses_tools


def test_a_session_id_reaches_the_job_as_on_chat():
    from radixserve.server.protocol.common import ServedModel

    served = ServedModel(("m",), 4, 4, 16)
    body = {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "q"}]}
    assert parse(MessagesRequest, {**body, "session_id": "s1"}).to_job(served, "q").session_id == "s1"
    assert parse(MessagesRequest, body).to_job(served, "q").session_id is None
    with pytest.raises(APIError, match="session_id"):
        parse(MessagesRequest, {**body, "session_id": ""})


@pytest.mark.parametrize("choice, mode, named, parallel", [
    (None, "auto", None, True), ({"type": "auto"}, "auto", None, True),
    ({"type": "auto", "disable_parallel_tool_use": True}, "auto", None, False),
    ({"type": "tool", "name": "f"}, "named", "f", True), ({"type": "none"}, "none", None, True),
])
def test_tool_choice_modes(choice, mode, named, parallel):
    body = {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "q"}],
            "tools": [{"name": "f", "input_schema": {"type": "object"}}]}
    if choice is not None:
        body["tool_choice"] = choice
    spec = parse(MessagesRequest, body).tool_spec()
    assert (spec.mode, spec.named, spec.parallel) == (mode, named, parallel)


@pytest.mark.parametrize("kind", [{}, [], 3, None])
def test_a_block_type_that_is_not_a_string_is_a_400(kind):
    """The schemathesis fuzz found a dict as a block's type answered 500 (unhashable)."""
    body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": kind, "text": "x"}]}]}
    with pytest.raises(APIError) as refused:
        parse(MessagesRequest, body)
    assert refused.value.status == 400
