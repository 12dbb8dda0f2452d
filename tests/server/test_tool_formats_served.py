"""Every tool-call format through the official openai client against the default model: each
request brings its family's chat template (`chat_template`, vLLM's field; the server trusts
request templates here), `auto` picks the format from it, the forced call parses into
arguments that validate against the tool's schema, the stream assembles to the whole answer,
and the next turn, rendered through the same template, hits the cache for everything the
first turn computed."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from radixserve.server import ServerOptions
from tool_fixtures import ADD_SCHEMA, FORMAT_FAMILIES, SCHEMAS, TEMPLATES, TOOLS

pytestmark = pytest.mark.real_model

MODEL = "SmolLM2-135M-Instruct"
FAMILIES = FORMAT_FAMILIES
BLOCK = 16
CHATML = ("hermes", "qwen3_coder")  # templates whose turn markers are the default model's special tokens


@pytest.fixture(scope="module")
def server_options() -> ServerOptions:
    # reasoning_parser none: these tests are about calls (gpt-oss's analysis channel needs its tokens in the vocabulary)
    return ServerOptions(enable_debug_endpoints=True, trust_request_chat_template=True, reasoning_parser="none")


def template(family: str) -> str:
    return (TEMPLATES / f"{family}.jinja").read_text(encoding="utf-8")


def ask(client, family: str, messages: list[dict], **kwargs):
    values = dict(model=MODEL, messages=messages, tools=TOOLS, temperature=0, max_tokens=200,
                  extra_body={"chat_template": template(family)})
    values.update(kwargs)
    return client.chat.completions.create(**values)


@pytest.mark.parametrize("family", FAMILIES)
def test_forced_call_streamed_whole_and_next_turn(client, family):
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "What is the weather in Paris? Use celsius."}]
    forced = dict(tool_choice="required", parallel_tool_calls=False)

    def streamed() -> tuple[dict, dict]:
        names, arguments = {}, {}
        for chunk in ask(client, family, messages, stream=True, **forced):
            for delta in chunk.choices[0].delta.tool_calls or []:
                if delta.function.name:
                    names[delta.index] = delta.function.name
                arguments[delta.index] = arguments.get(delta.index, "") + (delta.function.arguments or "")
        return names, arguments

    with ThreadPoolExecutor(1) as pool:  # the whole answer and the stream side by side
        stream = pool.submit(streamed)
        out = ask(client, family, messages, **forced)
        names, arguments = stream.result()
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name in SCHEMAS and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])

    assert names == {0: call.function.name} and arguments == {0: call.function.arguments}

    history = messages + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                             "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 C"},
    ]
    again = ask(client, family, history, max_tokens=1)
    first = out.usage.prompt_tokens + out.usage.completion_tokens
    assert again.usage.prompt_tokens > first
    cached = again.usage.prompt_tokens_details.cached_tokens
    if family in CHATML:  # the reply's ids are reused: at most the last partial block is computed again
        assert cached >= first - first % BLOCK - BLOCK
    else:  # these markers are plain text to SmolLM2's tokenizer: the reply's first token may merge across them
        assert cached >= out.usage.prompt_tokens - out.usage.prompt_tokens % BLOCK - BLOCK


def each_at_once(call, cases: list) -> list:
    """call(case) for every case, all in flight together (the engine batches them); answers in order."""
    with ThreadPoolExecutor(len(cases)) as pool:
        return list(pool.map(call, cases))


def test_named_call_under_each_template(client):
    answers = each_at_once(lambda family: ask(
        client, family, [{"role": "user", "content": "Add 12 and 30."}],
        tool_choice={"type": "function", "function": {"name": "add"}}, parallel_tool_calls=False), FAMILIES)
    for family, out in zip(FAMILIES, answers):
        (call,) = out.choices[0].message.tool_calls
        assert call.function.name == "add", family
        jsonschema.validate(json.loads(call.function.arguments), ADD_SCHEMA)


def test_auto_calls_under_each_template_parse_or_stay_text(client):
    """tool_choice auto: free text, but a call the model opens is the format's, constrained."""
    cases = [(family, seed) for family in FAMILIES for seed in (1, 2)]
    answers = each_at_once(lambda case: ask(
        client, case[0], [{"role": "user", "content": "Use a tool: what is 2 plus 3?"}],
        tool_choice="auto", temperature=1.0, seed=case[1], max_tokens=60), cases)
    for (family, _), out in zip(cases, answers):
        choice = out.choices[0]
        assert choice.finish_reason in ("stop", "length", "tool_calls"), family
        if choice.finish_reason == "tool_calls":
            for call in choice.message.tool_calls:
                jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        else:
            assert choice.message.tool_calls is None or choice.finish_reason == "length"


def test_a_request_template_renders_plain_chat(client, engine):
    gemma = template("gemma3")
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1,
                                         extra_body={"chat_template": gemma})
    expected = "<bos><start_of_turn>user\nYou are terse.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    assert out.usage.prompt_tokens == len(engine.tokenizer.encode(expected, add_special_tokens=False))
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert plain.usage.prompt_tokens == len(engine.apply_chat_template(messages))


def test_a_bad_request_template_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=1,
                                       extra_body={"chat_template": "{% for m in messages %}"})
    assert refused.value.status_code == 400
    assert refused.value.body["param"] == "chat_template" and "not a valid Jinja template" in refused.value.body["message"]


def test_a_forced_call_cut_by_max_tokens_returns_its_arguments_so_far(client):
    """Each format: a named call cut inside its first argument's value (max_tokens, found from
    the whole answer's tokens) answers finish_reason length, one call, and the arguments as
    the JSON text written so far: a prefix of the whole call's, holding the value's start,
    streamed and whole alike. A named call is one call even with parallel calls on."""
    messages = [{"role": "user", "content": "What is the weather in Paris? Use celsius."}]
    named = {"type": "function", "function": {"name": "get_weather"}}

    def check(family: str) -> None:
        whole = ask(client, family, messages, tool_choice=named, logprobs=True)
        (call,) = whole.choices[0].message.tool_calls
        arguments = call.function.arguments
        city = json.loads(arguments)["city"]
        assert len(city) >= 2, family
        tokens = [entry.token for entry in whole.choices[0].logprobs.content]
        value_at = "".join(tokens).index(city, "".join(tokens).index("city") + 4)
        cut = next(k for k in range(1, len(tokens)) if len("".join(tokens[:k])) > value_at)
        out = ask(client, family, messages, tool_choice=named, max_tokens=cut)
        choice = out.choices[0]
        assert choice.finish_reason == "length" and out.usage.completion_tokens == cut, family
        (partial,) = choice.message.tool_calls
        written = partial.function.arguments
        assert partial.function.name == "get_weather" and arguments.startswith(written), (family, written)
        assert written != arguments and written.startswith('{"city": "' + city[0]), (family, written)
        streamed = ""
        for chunk in ask(client, family, messages, tool_choice=named, max_tokens=cut, stream=True):
            for delta in chunk.choices[0].delta.tool_calls or []:
                assert delta.index == 0
                streamed += delta.function.arguments or ""
        assert streamed == written, family

    each_at_once(check, FAMILIES)  # each family's three requests in turn, the families side by side
