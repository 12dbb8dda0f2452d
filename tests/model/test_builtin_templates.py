"""Built-in chat templates (model/builtin_template.py): a model directory whose tokenizer has
no chat template gets its family's, chosen by the family and, in the Llama family, by the
turn markers its tokenizer has as tokens of their own; a template of its own is kept; each
renders its family's turn format byte for byte; Engine.chat answers through it, tools
included (the fallback rendering, hermes format); the startup line says which is in force."""

from __future__ import annotations

import json
import string
from pathlib import Path

import pytest

from radixserve.model.builtin_template import BUILTIN_NAMES, builtin_name, builtin_template, choose_builtin
from radixserve.model.tokenizer import load_tokenizer
from radixserve.reasoning.registry import detect_parser
from radixserve.server.chat_template import check_chat_template, template_in_force
from radixserve.tools.formats import detected_name
from radixserve.tools.rendering import template_supports_tools
from tiny_models import build_tiny_model

CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
                {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Add 2 and 3."}]
EXPECTED = {
    "gemma3": "<s><start_of_turn>user\nBe brief.\n\nHi there<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n"
              "<start_of_turn>user\nAdd 2 and 3.<end_of_turn>\n<start_of_turn>model\n",
    "chatml": "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
              "Hello!<|im_end|>\n<|im_start|>user\nAdd 2 and 3.<|im_end|>\n<|im_start|>assistant\n",
    "llama3": "<s><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|><|start_header_id|>user<|end_header_id|>"
              "\n\nHi there<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>"
              "<|start_header_id|>user<|end_header_id|>\n\nAdd 2 and 3.<|eot_id|>"
              "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "mistral": "<s>[INST] Be brief.\n\nHi there [/INST] Hello!</s>[INST] Add 2 and 3. [/INST]",
    "llama2": "<s>[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi there [/INST] Hello! </s><s>[INST] Add 2 and 3. [/INST]",
}
MARKERS = {"gemma3": ["<start_of_turn>", "<end_of_turn>"], "chatml": ["<|im_start|>", "<|im_end|>"],
           "llama3": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"], "mistral": ["[INST]", "[/INST]"]}
VOCAB = 160  # the tiny models' vocabulary: a character-level tokenizer's and its special tokens


def write_tokenizer(directory: Path, markers: list[str], chat_template: str | None = None) -> Path:
    """A character-level tokenizer (every printable character one token) with `markers` as
    special tokens, saved into `directory` beside its config.json; no chat template unless given."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    specials = ["<unk>", "<s>", "</s>", *markers]
    chars = sorted(set(string.printable) - set("\x0b\x0c\r"))
    tokenizer = Tokenizer(models.WordLevel({t: i for i, t in enumerate(specials + chars)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), "isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    if chat_template is not None:
        config["chat_template"] = chat_template
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def config_dir(tmp_path: Path, model_type: str, markers: list[str], chat_template: str | None = None) -> Path:
    directory = tmp_path / f"{model_type}-{len(markers)}"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"model_type": model_type}))
    return write_tokenizer(directory, markers, chat_template)


@pytest.mark.parametrize("model_type, markers, expected", [
    ("gemma3_text", MARKERS["gemma3"], "gemma3"),
    ("gemma3_text", [], "gemma3"),  # the family decides, whatever the vocabulary
    ("gemma3", MARKERS["chatml"], "gemma3"),
    ("qwen2", MARKERS["chatml"], "chatml"),
    ("qwen3", [], "chatml"),
    ("mistral", [], "mistral"),
    ("mistral", MARKERS["mistral"], "mistral"),
    ("llama", MARKERS["llama3"], "llama3"),
    ("llama", MARKERS["chatml"], "chatml"),  # SmolLM2-like: a Llama with ChatML turns
    ("llama", MARKERS["gemma3"], "gemma3"),
    ("llama", MARKERS["mistral"], "mistral"),
    ("llama", [], "llama2"),
])
def test_a_tokenizer_without_a_template_gets_its_familys(tmp_path, model_type, markers, expected):
    tokenizer = load_tokenizer(config_dir(tmp_path, model_type, markers))
    assert builtin_name(tokenizer.chat_template) == expected
    assert tokenizer.chat_template == builtin_template(expected)
    assert template_in_force(tokenizer, None) == f"built-in {expected} (the model file has none; --chat-template overrides it)"
    assert template_in_force(tokenizer, "{{ messages }}") == "--chat-template"


def test_a_template_of_its_own_is_kept_and_an_unknown_family_gets_none(tmp_path):
    own = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tokenizer = load_tokenizer(config_dir(tmp_path, "llama", MARKERS["chatml"], chat_template=own))
    assert tokenizer.chat_template == own and builtin_name(own) is None
    assert template_in_force(tokenizer, None) == "the model's own"
    bare = load_tokenizer(config_dir(tmp_path, "gpt2", []))
    assert bare.chat_template is None and choose_builtin({"model_type": "gpt2"}, bare) is None
    assert template_in_force(bare, None).startswith("none (chat is refused")


@pytest.mark.parametrize("name", BUILTIN_NAMES)
def test_each_builtin_renders_its_turn_format_and_leaves_tools_to_the_fallback(tmp_path, name):
    text = builtin_template(name)
    check_chat_template(text, name)
    # no tool syntax of its own: `auto` picks hermes and the fallback rendering carries the tools;
    # no reasoning markers: all is content
    assert not template_supports_tools(text) and detected_name(text) == "hermes"
    model_type = {"gemma3": "gemma3_text", "chatml": "qwen2", "llama3": "llama", "mistral": "mistral", "llama2": "llama"}
    tokenizer = load_tokenizer(config_dir(tmp_path, model_type[name], MARKERS.get(name, [])))
    assert builtin_name(tokenizer.chat_template) == name and detect_parser(tokenizer) is None
    rendered = tokenizer.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    assert rendered == EXPECTED[name]
    # turn k+1 extends turn k's prompt by the reply (the radix cache hits the whole history)
    first = tokenizer.apply_chat_template(CONVERSATION[:2], tokenize=False, add_generation_prompt=True)
    assert rendered.startswith(first)


@pytest.mark.parametrize("kind, name", [("gemma3", "gemma3"), ("qwen3", "chatml")])
def test_engine_chat_answers_through_the_builtin_template_tools_included(tmp_path, kind, name):
    from radixserve import Engine, SamplingParams

    directory = build_tiny_model(kind, tmp_path / kind, vocab_size=VOCAB, max_position_embeddings=1024)
    write_tokenizer(directory, MARKERS[name])
    engine = Engine(str(directory), max_model_len=1024, num_kv_blocks=160, enable_prefix_cache=True)
    (out,) = engine.chat(CONVERSATION, SamplingParams(max_tokens=4, temperature=0))
    assert out.prompt_token_ids == engine.tokenizer.encode(EXPECTED[name], add_special_tokens=False)
    assert len(out.token_ids) == 4
    weather = {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                         "b": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["a", "b"], "additionalProperties": False}}}
    (called,) = engine.chat(CONVERSATION, SamplingParams(max_tokens=60, temperature=0), tools=[weather],
                            tool_choice={"type": "function", "function": {"name": "add"}})
    prompt = engine.tokenizer.decode(called.prompt_token_ids)
    assert "# Tools" in prompt and '"name": "add"' in prompt  # the fallback: the tools in the system turn
    (call,) = called.tool_calls
    assert call.name == "add" and set(json.loads(call.arguments)) == {"a", "b"}
    engine.check_integrity()
