"""Every tool-call format through the official anthropic client: a server per family renders
with that family's template (--chat-template; the Messages API takes no per-request template),
a forced tool_use parses into input that validates against the tool's schema, the stream
assembles to the same call, and the tool result's turn reads the first turn's prompt from the
cache."""

from __future__ import annotations

import json
from pathlib import Path

import anthropic
import httpx
import jsonschema
import pytest

from radixserve.server import ServerOptions, create_app
from radixserve.server.testing import BackgroundServer

pytestmark = pytest.mark.real_model

MODEL = "SmolLM2-135M-Instruct"
TEMPLATES = Path(__file__).parents[1] / "templates"
FAMILIES = ["hermes", "llama3_json", "pythonic", "mistral", "qwen3_coder", "deepseek_v3", "harmony"]
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["c", "f"]}},
          "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"name": "get_weather", "description": "Current weather in a city", "input_schema": SCHEMA}]
BLOCK = 16


@pytest.mark.parametrize("family", FAMILIES)
def test_forced_tool_use_whole_streamed_and_next_turn(served_engine, family):
    options = ServerOptions(enable_debug_endpoints=True, reasoning_parser="none",
                            chat_template=(TEMPLATES / f"{family}.jinja").read_text(encoding="utf-8"))
    with BackgroundServer(create_app(served_engine, options)) as server:
        client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=300)
        ask = dict(model=MODEL, max_tokens=200, tools=TOOLS, extra_body={"temperature": 0},
                   tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True})
        messages = [{"role": "user", "content": "What is the weather in Paris? Use celsius."}]
        out = client.messages.create(messages=messages, **ask)
        (use,) = [block for block in out.content if block.type == "tool_use"]
        assert out.stop_reason == "tool_use" and use.name == "get_weather"
        jsonschema.validate(use.input, SCHEMA)

        with client.messages.stream(messages=messages, **ask) as stream:
            streamed = stream.get_final_message()
        (again,) = [block for block in streamed.content if block.type == "tool_use"]
        assert (again.name, again.input) == (use.name, use.input)

        first_prompt = out.usage.input_tokens + out.usage.cache_read_input_tokens + out.usage.cache_creation_input_tokens
        follow = client.messages.create(messages=messages + [
            {"role": "assistant", "content": [{"type": "tool_use", "id": use.id, "name": use.name, "input": use.input}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "18 C"}]},
        ], model=MODEL, max_tokens=1, tools=TOOLS)
        total = follow.usage.input_tokens + follow.usage.cache_read_input_tokens + follow.usage.cache_creation_input_tokens
        assert total > first_prompt
        assert follow.usage.cache_read_input_tokens >= first_prompt - first_prompt % BLOCK - BLOCK
        stats = httpx.post(server.url + "/debug/check_integrity", timeout=60).json()["stats"]
        assert stats["running"] == 0 and stats["waiting"] == 0
    json.dumps(use.input)  # plain JSON values
