"""Reasoning through the official clients, on the default model with a chat template written
for these tests in DeepSeek R1's way (the generation prompt opens `<think>`, so `auto` reads
it with deepseek_r1: everything up to `</think>` is reasoning). Greedy answers make the
reasoning known: the model's own first tokens for the prompt, computed beforehand by the
engine. A budget forces `</think>` after that many tokens, and a JSON schema or a forced
tool applies only after it."""

from __future__ import annotations

import copy
import json

import anthropic
import openai
import pytest

from radixserve.sampling_params import SamplingParams
from radixserve.server import ServerOptions, create_app
from radixserve.server.testing import BackgroundServer

THINK_TEMPLATE = (
    "{% if reasoning_effort is defined %}<|im_start|>system\nReasoning: {{ reasoning_effort }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m.get('reasoning_content') %}<think>\n{{ m['reasoning_content'] }}</think>{% endif %}"
    "{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}"
    "{% endif %}"
)
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Madrid"]}}, "required": ["city"]}
BUDGET = 4
TOOL = {"name": "pick_city", "description": "Pick a city", "input_schema": CITY}


@pytest.fixture(scope="module")
def think(real_model_dir):
    """A server on its own engine with THINK_TEMPLATE, and the greedy continuations of the
    question (thinking on and off) computed before it starts."""
    from radixserve import Engine

    engine = Engine(str(real_model_dir), num_kv_blocks=512, max_model_len=2048)
    engine.tokenizer.chat_template = THINK_TEMPLATE
    greedy = SamplingParams(max_tokens=12, temperature=0)
    on = engine.generate([engine.apply_chat_template(QUESTION)], greedy)[0]
    off_ids = engine.apply_chat_template(QUESTION, template_kwargs={"enable_thinking": False})
    off = engine.generate([off_ids], greedy)[0]
    tokenizer = copy.deepcopy(engine.tokenizer)  # the engine's own belongs to its thread once serving
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    with BackgroundServer(create_app(engine, ServerOptions(enable_debug_endpoints=True))) as server:
        yield server, engine.model_name, on.token_ids, off.text, decode, tokenizer
    engine.check_integrity()
    assert not engine.has_unfinished_requests()


def clients(think):
    server, model = think[0], think[1]
    return (model, openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=300),
            anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=300))


def test_chat_reasons_within_the_budget_then_answers_the_schema(think):
    model, client, _ = clients(think)
    on_ids, decode = think[2], think[4]
    body = dict(model=model, messages=QUESTION, max_tokens=40, temperature=0, logprobs=True,
                response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}},
                extra_body={"thinking_token_budget": BUDGET})
    whole = client.chat.completions.create(**body)
    message = whole.choices[0].message
    assert message.reasoning_content == decode(on_ids[:BUDGET])  # the model's own first tokens
    assert json.loads(message.content)["city"] in ("Paris", "Rome", "Madrid")
    assert "</think>" not in message.content and whole.choices[0].finish_reason == "stop"
    tokens = [t.token for t in whole.choices[0].logprobs.content]
    closed = next(i for i in range(len(tokens)) if "</think>" in "".join(tokens[: i + 1])) + 1
    assert closed > BUDGET and whole.usage.completion_tokens_details.reasoning_tokens == closed

    stream = client.chat.completions.create(**{**body, "logprobs": False}, stream=True,
                                            stream_options={"include_usage": True})
    reasoning, content, usage = "", "", None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            reasoning += getattr(choice.delta, "reasoning_content", None) or ""
            content += choice.delta.content or ""
    assert (reasoning, content) == (message.reasoning_content, message.content)
    assert usage.completion_tokens_details.reasoning_tokens == closed
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_chat_with_thinking_off_answers_as_content(think):
    model, client, _ = clients(think)
    off_text = think[3]
    body = dict(model=model, messages=QUESTION, max_tokens=12, temperature=0,
                extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    message = client.chat.completions.create(**body).choices[0].message
    assert message.content == off_text and getattr(message, "reasoning_content", None) is None
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**{**body, "extra_body": {"chat_template_kwargs": {"enable_thinking": 0}}})
    assert "enable_thinking" in str(caught.value)


def test_responses_reasoning_items_and_exact_reasoning_tokens(think):
    model, client, _ = clients(think)
    on_ids, decode = think[2], think[4]
    body = dict(model=model, input=QUESTION[0]["content"], max_output_tokens=5, temperature=0,
                reasoning={"summary": "auto"})
    whole = client.responses.create(**body)
    assert [item.type for item in whole.output] == ["reasoning"]  # cut inside the block: nothing else
    assert whole.output[0].content[0].text == decode(on_ids[:5])
    assert whole.usage.output_tokens_details.reasoning_tokens == whole.usage.output_tokens == 5
    assert whole.status == "incomplete"

    deltas, final = [], None
    for event in client.responses.create(**body, stream=True):
        if event.type == "response.reasoning_text.delta":
            deltas.append(event.delta)
        if event.type in ("response.completed", "response.incomplete"):
            final = event.response
    assert "".join(deltas) == whole.output[0].content[0].text
    assert [i.content[0].text for i in final.output] == [whole.output[0].content[0].text]
    assert final.usage.output_tokens_details.reasoning_tokens == 5


def test_responses_reasoning_then_a_schema_answer(think):
    model, client, _ = clients(think)
    on_ids, decode = think[2], think[4]
    body = dict(model=model, input=QUESTION[0]["content"], max_output_tokens=40, temperature=0,
                text={"format": {"type": "json_schema", "name": "city", "schema": CITY}},
                extra_body={"thinking_token_budget": BUDGET})
    response = client.responses.create(**body)
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.output[0].content[0].text == decode(on_ids[:BUDGET])
    assert json.loads(response.output[1].content[0].text)["city"] in ("Paris", "Rome", "Madrid")
    chat = client.chat.completions.create(  # the same conversation and constraint through chat
        model=model, messages=QUESTION, max_tokens=40, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}},
        extra_body={"thinking_token_budget": BUDGET})
    reasoning_tokens = chat.usage.completion_tokens_details.reasoning_tokens
    assert BUDGET < reasoning_tokens == response.usage.output_tokens_details.reasoning_tokens < response.usage.output_tokens
    final = None
    for event in client.responses.create(**body, stream=True):
        if event.type == "response.completed":
            final = event.response
    assert [i.model_dump(exclude={"id"}) for i in final.output] == [i.model_dump(exclude={"id"}) for i in response.output]
    assert final.usage == response.usage


def test_anthropic_thinking_blocks_whole_and_streamed(think):
    model, _, client = clients(think)
    on_ids, decode = think[2], think[4]
    body = dict(model=model, max_tokens=30, messages=QUESTION, extra_body={"temperature": 0},
                thinking={"type": "enabled", "budget_tokens": BUDGET})
    whole = client.messages.create(**body)
    assert whole.content[0].type == "thinking" and whole.content[0].thinking == decode(on_ids[:BUDGET])
    assert [b.type for b in whole.content[1:]] == ["text"] and "</think>" not in whole.content[1].text
    with client.messages.stream(**body) as stream:
        kinds = [e.content_block.type for e in stream if e.type == "content_block_start"]
        final = stream.get_final_message()
    assert kinds == ["thinking", "text"]
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in whole.content]


def test_anthropic_forced_tool_after_thinking_matches_chat(think):
    model, chat, client = clients(think)
    body = dict(model=model, max_tokens=60, messages=QUESTION, extra_body={"temperature": 0},
                thinking={"type": "enabled", "budget_tokens": BUDGET}, tools=[TOOL],
                tool_choice={"type": "tool", "name": "pick_city", "disable_parallel_tool_use": True})
    message = client.messages.create(**body)
    assert [b.type for b in message.content] == ["thinking", "tool_use"]
    assert message.content[1].input["city"] in ("Paris", "Rome", "Madrid") and message.stop_reason == "tool_use"
    same = chat.chat.completions.create(
        model=model, messages=QUESTION, max_tokens=60, temperature=0, parallel_tool_calls=False,
        tools=[{"type": "function", "function": {"name": "pick_city", "description": "Pick a city", "parameters": CITY}}],
        tool_choice={"type": "function", "function": {"name": "pick_city"}},
        extra_body={"thinking_token_budget": BUDGET, "chat_template_kwargs": {"enable_thinking": True}},
    ).choices[0].message
    assert same.reasoning_content == message.content[0].thinking  # one conversation, one rendering
    assert json.loads(same.tool_calls[0].function.arguments) == message.content[1].input
    with client.messages.stream(**body) as stream:
        final = stream.get_final_message()
    assert [b.model_dump() for b in final.content][0] == message.content[0].model_dump()
    assert final.content[1].input == message.content[1].input


def test_anthropic_thinking_disabled_and_bad_budgets(think):
    model, _, client = clients(think)
    off_text = think[3]
    message = client.messages.create(model=model, max_tokens=12, messages=QUESTION, extra_body={"temperature": 0},
                                     thinking={"type": "disabled"})
    assert [b.type for b in message.content] == ["text"] and message.content[0].text == off_text
    for thinking, max_tokens in (({"type": "enabled", "budget_tokens": 20}, 20), ({"type": "enabled"}, 20),
                                 ({"type": "adaptive"}, 20)):
        with pytest.raises(anthropic.BadRequestError) as caught:
            client.messages.create(model=model, max_tokens=max_tokens, messages=QUESTION, thinking=thinking)
        assert "thinking" in str(caught.value)


@pytest.fixture(scope="module")
def served_template(real_model_dir):
    """A server whose --chat-template is THINK_TEMPLATE (the model's own template unchanged):
    `auto` reads deepseek_r1 from the template in force."""
    from radixserve import Engine

    engine = Engine(str(real_model_dir), num_kv_blocks=256, max_model_len=2048)
    text = engine.tokenizer.apply_chat_template(QUESTION, chat_template=THINK_TEMPLATE, tokenize=False,
                                                add_generation_prompt=True)
    greedy = engine.generate([engine.tokenizer.encode(text, add_special_tokens=False)],
                             SamplingParams(max_tokens=6, temperature=0))[0]
    options = ServerOptions(chat_template=THINK_TEMPLATE)
    with BackgroundServer(create_app(engine, options)) as server:
        yield server, engine.model_name, greedy.text
    assert not engine.has_unfinished_requests()


def test_the_reasoning_parser_follows_the_served_template(served_template):
    server, model, text = served_template
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=300)
    whole = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=6, temperature=0)
    assert whole.choices[0].message.reasoning_content == text and whole.choices[0].message.content is None
    assert whole.usage.completion_tokens_details.reasoning_tokens == 6


def test_reasoning_sent_back_reaches_the_template(think):
    """An earlier turn's reasoning, sent back in each API's way (Anthropic's thinking block,
    chat's reasoning_content, a Responses reasoning item), renders as the template writes it."""
    model, chat, client = clients(think)
    tokenizer = think[5]
    reply = {"role": "assistant", "content": "Paris.", "reasoning_content": "France's capital"}
    conversation = QUESTION + [reply, {"role": "user", "content": "And Italy?"}]
    expected = len(tokenizer.encode(tokenizer.apply_chat_template(conversation, tokenize=False,
                                                                  add_generation_prompt=True), add_special_tokens=False))
    without = len(tokenizer.encode(tokenizer.apply_chat_template(
        QUESTION + [{"role": "assistant", "content": "Paris."}, conversation[2]], tokenize=False,
        add_generation_prompt=True), add_special_tokens=False))
    assert expected > without
    blocks = [{"type": "thinking", "thinking": "France's capital", "signature": ""}, {"type": "text", "text": "Paris."}]
    counted = client.messages.count_tokens(model=model, messages=[QUESTION[0], {"role": "assistant", "content": blocks},
                                                                   conversation[2]])
    assert counted.input_tokens == expected
    answer = chat.chat.completions.create(model=model, messages=conversation, max_tokens=1, temperature=0)
    assert answer.usage.prompt_tokens == expected
    response = chat.responses.create(model=model, max_output_tokens=1, temperature=0, input=[
        QUESTION[0], {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "France's capital"}]},
        {"role": "assistant", "content": "Paris."}, conversation[2]])
    assert response.usage.input_tokens == expected
    with pytest.raises(openai.BadRequestError):
        chat.chat.completions.create(model=model, max_tokens=1, messages=[
            {"role": "user", "content": "x", "reasoning_content": "not a user's"}])


def test_reasoning_effort_reaches_the_template(think):
    model, chat, _ = clients(think)
    tokenizer = think[5]
    expected = len(tokenizer.encode(tokenizer.apply_chat_template(
        QUESTION, tokenize=False, add_generation_prompt=True, reasoning_effort="high"), add_special_tokens=False))
    plain = chat.chat.completions.create(model=model, messages=QUESTION, max_tokens=1, temperature=0)
    high = chat.chat.completions.create(model=model, messages=QUESTION, max_tokens=1, temperature=0,
                                        reasoning_effort="high")
    assert high.usage.prompt_tokens == expected > plain.usage.prompt_tokens
    response = chat.responses.create(model=model, input=QUESTION[0]["content"], max_output_tokens=1, temperature=0,
                                     reasoning={"effort": "high"})
    assert response.usage.input_tokens == expected
