"""return_token_ids (vLLM's extension) through the official openai client: the prompt's ids and
each choice's ids, whole and streamed (a stream's chunks add up to the whole answer's ids), on
completions and chat; with tools the next turn's prompt begins with the earlier prompt and every
id the model generated."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from test_tools import ASK, TOOLS, chat

pytestmark = pytest.mark.real_model

MODEL = "SmolLM2-135M-Instruct"
IDS = {"return_token_ids": True}


def extra(obj: Any, name: str) -> Any:
    return (obj.model_extra or {}).get(name)


def test_completions_carry_each_choices_prompt_and_output_ids(client, engine):
    out = client.completions.create(model=MODEL, prompt=["The sea is", "Rivers are"], max_tokens=6, temperature=0,
                                    extra_body=IDS)
    for choice, prompt in zip(out.choices, ["The sea is", "Rivers are"]):
        assert extra(choice, "prompt_token_ids") == engine.tokenizer.encode(prompt)
        ids = extra(choice, "token_ids")
        assert len(ids) == 6 and engine.tokenizer.decode(ids) == choice.text
    plain = client.completions.create(model=MODEL, prompt="The sea is", max_tokens=2, temperature=0)
    assert extra(plain.choices[0], "token_ids") is None and extra(plain.choices[0], "prompt_token_ids") is None


def test_streamed_completion_ids_add_up_to_the_whole(client):
    whole = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0,
                                      extra_body=IDS).choices[0]
    chunks = list(client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0,
                                            stream=True, extra_body=IDS))
    prompts = [extra(c.choices[0], "prompt_token_ids") for c in chunks if c.choices]
    assert prompts[0] == extra(whole, "prompt_token_ids") and not any(prompts[1:])
    assert sum((extra(c.choices[0], "token_ids") for c in chunks if c.choices), []) == extra(whole, "token_ids")


def test_chat_carries_the_prompt_ids_beside_the_choices(client, engine):
    messages = [{"role": "user", "content": "Say hi."}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0, extra_body=IDS)
    text = engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt = engine.tokenizer.encode(text, add_special_tokens=False)
    assert extra(out, "prompt_token_ids") == list(prompt)
    assert len(extra(out.choices[0], "token_ids")) == out.usage.completion_tokens
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                                 stream=True, extra_body=IDS))
    assert extra(chunks[0], "prompt_token_ids") == list(prompt)
    assert not any(extra(c, "prompt_token_ids") for c in chunks[1:])
    assert sum((extra(c.choices[0], "token_ids") or [] for c in chunks if c.choices), []) == \
        extra(out.choices[0], "token_ids")


def test_a_tool_turn_is_prompted_with_every_id_generated_before(client):
    """Forced calls, with token ids: the parsed calls are intact, and the next turn's
    prompt ids begin with this turn's prompt ids and every id it generated."""
    history: list[dict[str, Any]] = list(ASK)
    earlier: list[int] | None = None
    for turn in range(2):
        out = chat(client, messages=history, tool_choice="required", parallel_tool_calls=False, max_tokens=48,
                   extra_body=IDS)
        prompt, ids = extra(out, "prompt_token_ids"), extra(out.choices[0], "token_ids")
        if earlier is not None:
            assert prompt[: len(earlier)] == earlier
        earlier = prompt + ids
        call = out.choices[0].message.tool_calls[0]
        json.loads(call.function.arguments)
        history.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                             "arguments": call.function.arguments}}]})
        history.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 18})})


def test_prompt_ids_on_chat_are_used_as_given_with_calls_parsed(client):
    """A trainer's tokens in: the ids are the prompt as given (and hit the cache the earlier
    turn left), the forced call is parsed out of the answer as ever."""
    first = chat(client, tool_choice="required", parallel_tool_calls=False, max_tokens=48, extra_body=IDS)
    given = extra(first, "prompt_token_ids")
    again = chat(client, tool_choice="required", parallel_tool_calls=False, max_tokens=48,
                 extra_body={**IDS, "prompt_token_ids": given})
    assert extra(again, "prompt_token_ids") == given
    assert again.usage.prompt_tokens_details.cached_tokens == (len(given) - 1) // 16 * 16
    call = again.choices[0].message.tool_calls[0]
    assert call.function.name in {"get_weather", "add"} and isinstance(json.loads(call.function.arguments), dict)


def test_prompt_ids_on_chat_keep_the_reasoning_split(engine):
    """With a reasoning parser (deepseek_r1: everything before </think> is reasoning), an answer
    to given ids still splits: what the model wrote before </think> is reasoning_content."""
    import openai

    from radixserve.server import ServerOptions, create_app
    from radixserve.server.testing import BackgroundServer

    think = engine.tokenizer.encode("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n",
                                    add_special_tokens=False)
    with BackgroundServer(create_app(engine, ServerOptions(reasoning_parser="deepseek_r1"))) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=12,
                                             temperature=0, extra_body={"prompt_token_ids": think, **IDS})
    message = out.choices[0].message
    assert extra(out, "prompt_token_ids") == think
    reasoning = extra(message, "reasoning_content")
    assert reasoning.strip() and reasoning.strip() in engine.tokenizer.decode(extra(out.choices[0], "token_ids"))
    assert not message.content  # cut by max_tokens before </think>: all of it is reasoning


@pytest.mark.parametrize("ids, fragment", [([], "empty"), ([-1], "prompt_token_ids"), ([10**9], "token ids")])
def test_bad_prompt_ids_on_chat_are_refused(client, ids, fragment):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                       extra_body={"prompt_token_ids": ids})
    assert fragment in str(refused.value)


def test_streamed_forced_calls_carry_every_id(client):
    whole = chat(client, tool_choice="required", max_tokens=48, extra_body=IDS)
    chunks = list(chat(client, tool_choice="required", max_tokens=48, stream=True, extra_body=IDS))
    assert extra(chunks[0], "prompt_token_ids") == extra(whole, "prompt_token_ids")
    streamed = sum((extra(c.choices[0], "token_ids") or [] for c in chunks if c.choices), [])
    assert streamed == extra(whole.choices[0], "token_ids")
    names = [t.function.name for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or [] if t.function.name]
    assert names == [t.function.name for t in whole.choices[0].message.tool_calls]
