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

from radixserve.model import builtin_template as builtin_module
from radixserve.model import registry
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
PLAIN = ("gemma3", "chatml", "llama3", "mistral", "llama2")  # the templates that know no tools


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
    ("qwen3_moe", [], "qwen3"),
    ("qwen3_5_text", MARKERS["chatml"], "qwen3_5"),
    ("qwen3_5", [], "qwen3_5"),
    ("lfm2", MARKERS["chatml"], "lfm2"),
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


@pytest.mark.parametrize("name", PLAIN)
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



# ---- the families whose templates know tools and reasoning ----------------------------------

ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}
# an agent's tool loop: a call with its reasoning, its result, the next generation prompt
LOOP = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Add 2."},
        {"role": "assistant", "content": None, "reasoning_content": "Use add.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": {"a": 2}}}]},
        {"role": "tool", "tool_call_id": "call_1", "name": "add", "content": "4"}]
ADD_JSON = '{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": ' \
           '{"a": {"type": "integer"}}, "required": ["a"]}}}'
LOOP_RENDERED = {
    "qwen3": "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions to help with the user "
             "query. Their signatures, within <tools></tools> XML tags:\n<tools>\n" + ADD_JSON + "\n</tools>\n\n"
             "For each call, answer with a JSON object of the function name and its arguments within "
             "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
             "<args-json-object>}\n</tool_call><|im_end|>\n<|im_start|>user\nAdd 2.<|im_end|>\n"
             "<|im_start|>assistant\n<think>\nUse add.\n</think>\n\n<tool_call>\n{\"name\": \"add\", \"arguments\": "
             "{\"a\": 2}}\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n4\n</tool_response><|im_end|>\n"
             "<|im_start|>assistant\n",
    "qwen3_5": "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou have access to these functions, within "
               "<tools></tools> XML tags:\n\n<tools>\n" + ADD_JSON + "\n</tools>\n\nTo call a function, answer in "
               "exactly this form, one <parameter> element per argument and nothing after the last call:\n\n"
               "<tool_call>\n<function=example_function>\n<parameter=example_parameter>\nexample value\n</parameter>\n"
               "</function>\n</tool_call><|im_end|>\n<|im_start|>user\nAdd 2.<|im_end|>\n<|im_start|>assistant\n"
               "<think>\nUse add.\n</think>\n\n<tool_call>\n<function=add>\n<parameter=a>\n2\n</parameter>\n"
               "</function>\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n4\n</tool_response><|im_end|>\n"
               "<|im_start|>assistant\n<think>\n",
    "lfm2": "<s><|im_start|>system\nBe brief.\nList of tools: <|tool_list_start|>[{\"name\": \"add\", \"parameters\": "
            "{\"type\": \"object\", \"properties\": {\"a\": {\"type\": \"integer\"}}, \"required\": [\"a\"]}}]"
            "<|tool_list_end|><|im_end|>\n<|im_start|>user\nAdd 2.<|im_end|>\n<|im_start|>assistant\n"
            "<think>Use add.</think><|tool_call_start|>[add(a=2)]<|tool_call_end|><|im_end|>\n<|im_start|>tool\n"
            "<|tool_response_start|>4<|tool_response_end|><|im_end|>\n<|im_start|>assistant\n",
    "harmony": "<|start|>system<|message|>You are a helpful assistant.\n\nReasoning: medium\n\n# Valid channels: "
               "analysis, commentary, final. Channel must be included for every message.\nCalls to these tools must "
               "go to the commentary channel: 'functions'.<|end|><|start|>developer<|message|># Instructions\n\n"
               "Be brief.\n\n# Tools\n\n## functions\n\nnamespace functions {\n\ntype add = (_: {\na: number,\n}) "
               "=> any;\n\n} // namespace functions<|end|><|start|>user<|message|>Add 2.<|end|><|start|>assistant"
               "<|channel|>analysis<|message|>Use add.<|end|><|start|>assistant<|channel|>commentary "
               "to=functions.add <|constrain|>json<|message|>{\"a\": 2}<|call|><|start|>functions.add to=assistant"
               "<|channel|>commentary<|message|>4<|end|><|start|>assistant",
}
THINKING_OFF = {"qwen3": "<|im_start|>assistant\n<think>\n\n</think>\n\n",
                "qwen3_5": "<|im_start|>assistant\n<think>\n\n</think>\n\n",
                "lfm2": "<|im_start|>assistant\n", "harmony": "<|start|>assistant"}
# the built-in template -> what `auto` picks under it: (tool-call format, reasoning parser)
PICKS = {"qwen3": ("hermes", "qwen3"), "qwen3_5": ("qwen3_coder", "qwen3"), "lfm2": ("lfm2", "qwen3"),
         "harmony": ("harmony", "gpt_oss")}


@pytest.mark.parametrize("name", list(LOOP_RENDERED))
def test_a_tool_loop_renders_as_the_family_writes_it(tmp_path, name):
    text = builtin_template(name)
    check_chat_template(text, name)
    assert template_supports_tools(text)  # tools, calls and results go to the template as they are
    tokenizer = load_tokenizer(config_dir(tmp_path, "qwen3_moe", []))
    rendered = tokenizer.apply_chat_template(LOOP, tools=[ADD], tokenize=False, add_generation_prompt=True,
                                             chat_template=text)
    assert rendered == LOOP_RENDERED[name]
    # the loop's first prompt, then what the model wrote after it: the call's turn re-renders as generated
    first = tokenizer.apply_chat_template(LOOP[:2], tools=[ADD], tokenize=False, add_generation_prompt=True,
                                          chat_template=text)
    assert rendered.startswith(first)
    off = tokenizer.apply_chat_template(LOOP[:2], tokenize=False, add_generation_prompt=True, chat_template=text,
                                        enable_thinking=False)
    assert off.endswith("Add 2." + ("<|end|>" if name == "harmony" else "<|im_end|>\n") + THINKING_OFF[name])
    fmt, parser = PICKS[name]
    assert detected_name(text) == fmt and detect_parser(None, text).name == parser


def test_each_family_names_what_auto_picks_under_its_template():
    named = {f.name: (f.chat_template, f.tool_call_format, f.reasoning_parser)
             for f in registry.FAMILIES if f.chat_template in PICKS}
    assert named == {"qwen3_moe": ("qwen3", *PICKS["qwen3"]), "qwen3_5": ("qwen3_5", *PICKS["qwen3_5"]),
                     "qwen3_5_moe": ("qwen3_5", *PICKS["qwen3_5"]), "lfm2": ("lfm2", *PICKS["lfm2"]), "gpt_oss": ("harmony", *PICKS["harmony"])}
    # an edited copy is no built-in: `auto` reads its text (the same format here)
    edited = builtin_template("qwen3_5") + "{# edited #}"
    assert builtin_module.builtin_defaults(edited) == (None, None) and detected_name(edited) == "qwen3_coder"
    assert builtin_module.builtin_defaults(builtin_template("chatml")) == (None, None)
    assert builtin_module.builtin_defaults("{{ messages }}") == (None, None)


def test_the_gpt_oss_entry_gets_the_harmony_defaults(tmp_path):
    """The gpt_oss entry (`**HARMONY`): the built-in harmony template, the harmony calls and the
    gpt_oss reasoning parser."""
    tokenizer = load_tokenizer(config_dir(tmp_path, "gpt_oss", ["<|start|>", "<|channel|>", "<|message|>", "<|end|>"]))
    assert builtin_name(tokenizer.chat_template) == "harmony"
    assert builtin_module.builtin_defaults(tokenizer.chat_template) == ("harmony", "gpt_oss")
    assert detected_name(tokenizer.chat_template) == "harmony" and detect_parser(tokenizer).name == "gpt_oss"


@pytest.mark.parametrize("name, reply, reasoning, content", [
    ("qwen3_5", "Use add.\n</think>\n\nIt is 4.", "Use add.\n", "It is 4."),  # the prompt opened the block
    ("qwen3", "<think>\nUse add.\n</think>\n\nIt is 4.", "\nUse add.\n", "It is 4."),
    ("lfm2", "<think>Use add.</think>It is 4.", "Use add.", "It is 4."),
])
def test_each_familys_parser_reads_a_reply_to_its_prompt(tmp_path, name, reply, reasoning, content):
    """The parser `auto` picks, on the template's own generation prompt: thinking on splits the
    reply into reasoning and content; thinking off closes the Qwen templates' block in the prompt
    (the server then reads no reasoning); LFM2's leaves the block to the model either way."""
    tokenizer = load_tokenizer(config_dir(tmp_path, "qwen3_moe", []))
    parser = detect_parser(None, builtin_template(name))
    for thinking in (True, False):
        prompt = tokenizer.apply_chat_template(LOOP[:2], tokenize=False, add_generation_prompt=True,
                                               chat_template=builtin_template(name), enable_thinking=thinking)
        opened = parser.opens_in_prompt(prompt)
        assert opened == (name == "qwen3_5" and thinking)
        if not thinking and name != "lfm2":
            assert prompt.endswith("<think>\n\n</think>\n\n") and parser.follows_enable_thinking
            continue
        splitter = parser.splitter(opened)
        pieces = [p for ch in reply for p in splitter.feed(ch)] + splitter.finish()  # streamed a character at a time
        got = ("".join(p.text for p in pieces if p.reasoning), "".join(p.text for p in pieces if not p.reasoning))
        assert got == (reasoning, content)
