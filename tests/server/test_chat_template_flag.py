"""--chat-template (ServerOptions.chat_template): the server renders every chat prompt through
the given template instead of the model's own (here Gemma 3's turns, which know no function
calling, on the default model), tool calls included (the fallback rendering, in the format
`auto` picks for it), and a request cannot bring its own template unless the server trusts it."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import openai
import pytest

from radixserve.server import ServerOptions

pytestmark = pytest.mark.real_model

MODEL = "SmolLM2-135M-Instruct"
GEMMA = (Path(__file__).parents[1] / "templates" / "gemma3.jinja").read_text(encoding="utf-8")
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
          "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}]


@pytest.fixture(scope="module")
def server_options() -> ServerOptions:
    return ServerOptions(enable_debug_endpoints=True, chat_template=GEMMA)


def test_plain_chat_renders_through_the_flag_template(client, engine):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    expected = ("<bos><start_of_turn>user\nYou are terse.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn>\n"
                "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n")
    assert out.usage.prompt_tokens == len(engine.tokenizer.encode(expected, add_special_tokens=False))
    assert out.usage.prompt_tokens != len(engine.apply_chat_template(messages))  # not the model's own


def test_tool_calls_through_the_flag_template(client):
    ask = [{"role": "user", "content": "Weather in Rome?"}]
    kwargs = dict(model=MODEL, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, temperature=0,
                  max_tokens=60)
    out = client.chat.completions.create(messages=ask, **kwargs)
    (call,) = out.choices[0].message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), SCHEMA)
    history = ask + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": "21 C"}]
    again = client.chat.completions.create(messages=history, **{**kwargs, "max_tokens": 1})
    assert again.usage.prompt_tokens_details.cached_tokens >= out.usage.prompt_tokens - 16


def test_a_request_template_is_refused_without_trust(client, server):
    """Refused before anything renders it (a template is code the server would run): neither the
    tool calling nor the reasoning keeps a parser for it."""
    thinking = "{{ '<think>' }}{% for m in messages %}{{ m.content }}{% endfor %}{{ '</think>' }}"
    for template in (GEMMA.replace("<bos>", ""), thinking):
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=1,
                                           extra_body={"chat_template": template})
        assert refused.value.body["param"] == "chat_template"
        assert "--trust-request-chat-template" in refused.value.body["message"]
    state = server.app.state.server
    assert not state.tools._derived and not state.reasoning._derived


def test_anthropic_messages_render_through_the_flag_template(server, engine):
    import anthropic

    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=300)
    out = client.messages.create(model=MODEL, max_tokens=1, system="You are terse.",
                                 messages=[{"role": "user", "content": "Hi"}])
    expected = "<bos><start_of_turn>user\nYou are terse.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    used = out.usage.input_tokens + (out.usage.cache_read_input_tokens or 0) + (out.usage.cache_creation_input_tokens or 0)
    assert used == len(engine.tokenizer.encode(expected, add_special_tokens=False))


def test_anthropic_forced_tool_use_through_the_flag_template(server):
    import anthropic

    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=300)
    out = client.messages.create(model=MODEL, max_tokens=60,
                                 messages=[{"role": "user", "content": "Weather in Rome?"}],
                                 tools=[{"name": "get_weather", "input_schema": SCHEMA}],
                                 tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True})
    (use,) = [block for block in out.content if block.type == "tool_use"]
    assert use.name == "get_weather" and out.stop_reason == "tool_use"
    jsonschema.validate(use.input, SCHEMA)
