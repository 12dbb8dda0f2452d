"""--tool-call-parser llama3 end to end: the default model (whose template has no tool
support) is told the Llama 3 JSON format in the fallback system turn, the grammar forces
`{"name": ..., "parameters": ...}` calls, and the server reads them back as tool_calls,
streamed and not."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from radixserve.server import ServerOptions

pytestmark = pytest.mark.real_model

MODEL = "SmolLM2-135M-Instruct"
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
          "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}]


@pytest.fixture(scope="module")
def server_options() -> ServerOptions:
    return ServerOptions(enable_debug_endpoints=True, tool_call_parser="llama3")


def test_llama3_calls_streamed_and_not(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Weather in Rome?"}], tools=TOOLS,
                  tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=40)
    out = client.chat.completions.create(**kwargs).choices[0]
    assert out.finish_reason == "tool_calls" and out.message.content is None
    (call,) = out.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMA)
    arguments = "".join(
        c.function.arguments or ""
        for chunk in client.chat.completions.create(stream=True, **kwargs)
        for choice in chunk.choices for c in choice.delta.tool_calls or []
    )
    assert arguments == call.function.arguments
    assert httpx.post(server.url + "/debug/check_integrity", timeout=60).json()["ok"]
