"""Qwen3-MoE, Qwen 3.5 and LFM2 served from a model file that carries no chat template, through
the official openai client on tiny random-weight configs: the family's built-in template is in
force and `auto` picks the family's tool-call format and reasoning parser. Random weights write
noise, so what is checked is what the server decides: the prompt as rendered, a forced call
(required, named) parsed into arguments that validate, streamed and whole alike, reasoning
forced by a budget read out of the reply, and the next turn re-rendered to the previous prompt
and every id the model generated, its prompt hitting the cache."""

from __future__ import annotations

import json
import string
from pathlib import Path

import jsonschema
import openai
import pytest
import torch

from radixserve import Engine
from radixserve.model.builtin_template import builtin_name
from radixserve.server import ServerOptions, create_app
from radixserve.server.testing import BackgroundServer
from tiny_models import build_tiny_model
from tool_fixtures import ADD_SCHEMA, SCHEMAS, TOOLS

MODEL = "tiny"
VOCAB = 160
BLOCK = 16
CHATML = ["<|im_start|>", "<|im_end|>"]
QWEN_TEXT = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
# family -> (its built-in template, tool-call format, special tokens, added plain-text tokens), as its vocabulary has them
FAMILIES = {
    "qwen3_moe": ("qwen3", "hermes", CHATML, QWEN_TEXT),
    "qwen3_5": ("qwen3_5", "qwen3_coder", CHATML, QWEN_TEXT),
    "lfm2": ("lfm2", "lfm2", CHATML + ["<|tool_list_start|>", "<|tool_list_end|>", "<|tool_call_start|>",
                                      "<|tool_call_end|>", "<|tool_response_start|>", "<|tool_response_end|>"],
             ["<think>", "</think>"]),
}
QUESTION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


def write_tokenizer(directory: Path, specials: list[str], plain: list[str]) -> None:
    """A character-level tokenizer: every printable character one token, `specials` special
    tokens (dropped from text unless asked for), `plain` tokens of their own that stay in the
    text (as Qwen's <think> and <tool_call>); no chat template; <|im_end|> ends a turn."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    specials = ["<unk>", "<s>", "</s>", *specials]
    chars = sorted(set(string.printable) - set("\x0b\x0c\r"))
    vocab = {t: i for i, t in enumerate(specials + plain + chars)}
    assert len(vocab) <= VOCAB
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), "isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    tokenizer.add_tokens([AddedToken(s, special=False, normalized=False) for s in plain])
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "<|im_end|>", "unk_token": "<unk>"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


def build_model(family: str, directory: Path) -> Path:
    if family != "qwen3_moe":
        return build_tiny_model(family, directory, vocab_size=VOCAB, max_position_embeddings=4096)
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
                            num_experts=4, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, initializer_range=0.5,
                            tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module", params=list(FAMILIES))
def served(request, tmp_path_factory):
    """(family, engine, client) of a tiny model of the family, its directory without a chat template."""
    family = request.param
    _, _, specials, plain = FAMILIES[family]
    directory = build_model(family, tmp_path_factory.mktemp(family))
    write_tokenizer(directory, specials, plain)
    engine = Engine(str(directory), max_model_len=4096, num_kv_blocks=600,
                    enable_prefix_cache=True)
    with BackgroundServer(create_app(engine, ServerOptions(served_model_name=MODEL))) as server:
        yield family, engine, openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=300)
    engine.check_integrity()
    assert not engine.has_unfinished_requests()


def ask(client, messages, **kwargs):
    extra = {"return_token_ids": True, **kwargs.pop("extra_body", {})}
    values = dict(model=MODEL, messages=messages, tools=TOOLS, temperature=0, max_tokens=300, extra_body=extra)
    return client.chat.completions.create(**{**values, **kwargs})


def ids_of(obj, name):
    return (obj.model_extra or {}).get(name)


def next_turn(call, reasoning=None):
    assistant = {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": call.function.arguments}}]}
    if reasoning is not None:
        assistant["reasoning_content"] = reasoning
    return QUESTION + [assistant, {"role": "tool", "tool_call_id": call.id, "content": "18 C"}]


def test_the_builtin_template_renders_the_prompt(served):
    family, engine, client = served
    name = FAMILIES[family][0]
    assert builtin_name(engine.tokenizer.chat_template) == name
    out = ask(client, QUESTION, max_tokens=1, extra_body=NO_THINKING)
    expected = engine.tokenizer.apply_chat_template(QUESTION, tools=TOOLS, tokenize=False, add_generation_prompt=True,
                                                    enable_thinking=False)
    assert ids_of(out, "prompt_token_ids") == engine.tokenizer.encode(expected, add_special_tokens=False)
    marks = {"qwen3": '<tools>\n{"type": "function"', "qwen3_5": "<function=example_function>",
             "lfm2": 'List of tools: <|tool_list_start|>[{"name": "get_weather"'}
    assert marks[name] in expected and expected.endswith("assistant\n" + ("<think>\n\n</think>\n\n" if "qwen" in name else ""))


def test_a_forced_call_streamed_whole_and_the_next_turn_hits(served):
    family, engine, client = served
    forced = dict(tool_choice="required", parallel_tool_calls=False, extra_body=NO_THINKING)
    out = ask(client, QUESTION, **forced)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert getattr(choice.message, "reasoning_content", None) is None
    (call,) = choice.message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    reply = engine.tokenizer.decode(ids_of(choice, "token_ids"), skip_special_tokens=False)
    assert FAMILIES[family][1] == {"qwen3": "hermes", "qwen3_5": "qwen3_coder", "lfm2": "lfm2"}[FAMILIES[family][0]]
    opening = {"hermes": '<tool_call>\n{"name": "', "qwen3_coder": "<tool_call>\n<function=",
               "lfm2": "<|tool_call_start|>["}[FAMILIES[family][1]]
    assert reply.startswith(opening + call.function.name)

    names, arguments = {}, {}
    for chunk in ask(client, QUESTION, stream=True, **forced):
        for delta in chunk.choices[0].delta.tool_calls or []:
            if delta.function.name:
                names[delta.index] = delta.function.name
            arguments[delta.index] = arguments.get(delta.index, "") + (delta.function.arguments or "")
    assert names == {0: call.function.name} and arguments == {0: call.function.arguments}

    again = ask(client, next_turn(call), max_tokens=1, extra_body=NO_THINKING)
    before = ids_of(out, "prompt_token_ids") + ids_of(choice, "token_ids")
    assert ids_of(again, "prompt_token_ids")[: len(before)] == before  # the reply re-rendered as generated
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached >= len(before) - len(before) % BLOCK - BLOCK, (cached, len(before))


def test_a_named_call_validates(served):
    _, _, client = served
    out = ask(client, [{"role": "user", "content": "Add 12 and 30."}], parallel_tool_calls=False,
              tool_choice={"type": "function", "function": {"name": "add"}}, extra_body=NO_THINKING)
    (call,) = out.choices[0].message.tool_calls
    assert call.function.name == "add"
    jsonschema.validate(json.loads(call.function.arguments), ADD_SCHEMA)


def test_reasoning_then_a_call_and_the_next_turn_hits(served):
    """Thinking on, a budget of 4 tokens: the reply's block is read out as reasoning_content,
    the call after it parsed; sent back with its reasoning, the turn re-renders its block."""
    family, engine, client = served
    out = ask(client, QUESTION, tool_choice="required", parallel_tool_calls=False,
              extra_body={"thinking_token_budget": 4})
    choice = out.choices[0]
    reply = engine.tokenizer.decode(ids_of(choice, "token_ids"), skip_special_tokens=False)
    opened = family == "qwen3_5"  # its generation prompt opens the block; the others' models open it
    reasoning = reply.split("</think>")[0].removeprefix("" if opened else "<think>")
    assert choice.message.reasoning_content == reasoning and len(ids_of(choice, "token_ids")) > 4
    (call,) = choice.message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    prompt = engine.tokenizer.decode(ids_of(out, "prompt_token_ids"), skip_special_tokens=False)
    assert prompt.endswith("<think>\n" if opened else "assistant\n")

    again = ask(client, next_turn(call, choice.message.reasoning_content), max_tokens=1)
    rendered = engine.tokenizer.decode(ids_of(again, "prompt_token_ids"), skip_special_tokens=False)
    assert (reasoning.strip("\n") + "\n</think>" if "qwen" in family else "<think>" + reasoning + "</think>") in rendered
    first = len(ids_of(out, "prompt_token_ids"))
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached >= first - first % BLOCK - BLOCK, (cached, first)


def test_the_anthropic_client_thinks_then_uses_a_tool_and_the_next_turn_hits(served):
    """The same through the official anthropic client: a thinking block of the budget's tokens,
    then a forced tool_use whose input validates, streamed alike; the next turn (the thinking
    block, the tool_use and its result sent back) reads the first prompt from the cache."""
    import anthropic

    family, _, client = served
    messages = anthropic.Anthropic(base_url=str(client.base_url).removesuffix("/v1/"), api_key="x", max_retries=0,
                                   timeout=300).messages
    tools = [{"name": name, "input_schema": schema} for name, schema in SCHEMAS.items()]
    ask = dict(model=MODEL, max_tokens=300, tools=tools, tool_choice={"type": "any", "disable_parallel_tool_use": True},
               thinking={"type": "enabled", "budget_tokens": 4}, extra_body={"temperature": 0})
    question = [{"role": "user", "content": "Weather in Paris?"}]
    out = messages.create(messages=question, **ask)
    thinking, use = out.content[0], out.content[-1]
    assert out.stop_reason == "tool_use" and thinking.type == "thinking" and thinking.thinking
    assert use.type == "tool_use"
    jsonschema.validate(use.input, SCHEMAS[use.name])
    with messages.stream(messages=question, **ask) as stream:
        streamed = stream.get_final_message()
    assert [(b.type, getattr(b, "thinking", None), getattr(b, "input", None)) for b in streamed.content] == \
           [(b.type, getattr(b, "thinking", None), getattr(b, "input", None)) for b in out.content]

    first = out.usage.input_tokens + out.usage.cache_read_input_tokens + out.usage.cache_creation_input_tokens
    follow = messages.create(messages=question + [
        {"role": "assistant", "content": [{"type": "thinking", "thinking": thinking.thinking, "signature": ""},
                                          {"type": "tool_use", "id": use.id, "name": use.name, "input": use.input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "18 C"}]},
    ], **{**ask, "max_tokens": 5, "tool_choice": {"type": "auto"}})
    assert follow.usage.cache_read_input_tokens >= first - first % BLOCK - BLOCK, (family, follow.usage, first)
