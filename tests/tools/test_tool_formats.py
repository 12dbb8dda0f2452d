"""The tool-call formats (tools/formats/), each without a server: a chat template per
family (tests/templates/) renders that family's documented prompt byte for byte;
parsing streamed in token-sized pieces (markers split anywhere) equals parsing whole;
rendering what was parsed gives back the generated text; the grammar of forced and auto
calls accepts the canonical calls and refuses ones that break the schema; `auto` picks the
format from the template; --chat-template and the registry's errors."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import jsonschema
import pytest

from radixserve.server.chat_template import load_chat_template
from radixserve.tools import (
    ArgumentsDelta, CallStarted, ChatRenderer, ContentDelta, HistoryCall, HistoryMessage, NamedToolChoice,
    ParsedCall, ToolCallParser, ToolDefinition, parse_tool_calls, tool_call_structural_tag, tool_spec,
)
from radixserve.tools.formats import FORMATS, PARSER_CHOICES, detect_format, format_named
from radixserve.tools.formats.mistral import MistralFormat
from radixserve.tools.rendering import fallback_messages

TEMPLATES = Path(__file__).parents[1] / "templates"
FAMILIES = ["hermes", "llama3_json", "pythonic", "mistral", "qwen3_coder", "deepseek_v3", "harmony"]
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                  "required": ["city", "unit"]}
ADD_SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
              "required": ["a", "b"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                            "parameters": WEATHER_SCHEMA}}
ADD = {"type": "function", "function": {"name": "add", "parameters": ADD_SCHEMA}}
SCHEMAS = {"get_weather": WEATHER_SCHEMA, "add": ADD_SCHEMA}
CALLS = [("get_weather", '{"city": "Paris", "unit": "c"}'), ("add", '{"a": 1, "b": 2}')]
NAMED_MISTRAL = MistralFormat(named=True)


def every_format():
    """Every registered format (mistral in both of its forms)."""
    return [format_named(name) for name in FORMATS] + [NAMED_MISTRAL]


def ids(formats):
    return [f.name + ("_named" if f is NAMED_MISTRAL else "") for f in formats]


def tools(*raw):
    return [ToolDefinition.model_validate(t) for t in raw]


def template(family: str) -> str:
    return (TEMPLATES / f"{family}.jinja").read_text(encoding="utf-8")


# ---- the families' prompts, byte for byte --------------------------------------------------

WEATHER_JSON = ('{"name": "get_weather", "description": "Current weather in a city", "parameters": {"type": "object", '
                '"properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"]}}')
EXPECTED = {
    "hermes": (
        "<|im_start|>system\nYou are terse.\n\n# Tools\n\nYou may call one or more functions to assist with the user "
        "query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        '{"type": "function", "function": ' + WEATHER_JSON + "}\n</tools>\n\nFor each function call, return a json "
        "object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n18 C\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    ),
    "qwen3_coder": (
        "<|im_start|>system\nYou are terse.\n\n# Tools\n\nYou have access to the following functions:\n\n<tools>\n"
        "<function>\n<name>get_weather</name>\n<description>Current weather in a city</description>\n<parameters>\n"
        "<parameter>\n<name>city</name>\n<type>string</type>\n</parameter>\n<parameter>\n<name>unit</name>\n"
        "<type>enum</type>\n</parameter>\n</parameters>\n</function>\n</tools>\n\nIf you choose to call a function "
        "ONLY reply in the following format with NO suffix:\n\n<tool_call>\n<function=example_function_name>\n"
        "<parameter=example_parameter_1>\nvalue_1\n</parameter>\n</function>\n</tool_call><|im_end|>\n"
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        "<|im_start|>assistant\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=unit>\nc\n</parameter>\n</function>\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n18 C\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    ),
    "llama3_json": (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\nCutting Knowledge Date: "
        "December 2023\nToday Date: 26 Jul 2024\n\nYou are terse.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nGiven the following functions, please respond with a JSON for a "
        "function call with its proper arguments that best answers the given prompt.\n\nRespond in the format "
        '{"name": function name, "parameters": dictionary of argument name and its value}.Do not use variables.\n\n'
        + json.dumps(WEATHER, indent=4) + "\n\nWeather in Paris?<|eot_id|>"
        '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "get_weather", "parameters": {"city": "Paris", '
        '"unit": "c"}}<|eot_id|>'
        "<|start_header_id|>ipython<|end_header_id|>\n\n18 C<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    ),
    "pythonic": (
        "<|begin_of_text|><|header_start|>system<|header_end|>\n\nYou are terse.\n\nYou can call these functions; to "
        "call them, reply with [func_name1(params_name1=params_value1, params_name2=params_value2...), "
        "func_name2(params)] and nothing else:\n\n" + WEATHER_JSON + "<|eot|>"
        "<|header_start|>user<|header_end|>\n\nWeather in Paris?<|eot|>"
        '<|header_start|>assistant<|header_end|>\n\n[get_weather(city="Paris", unit="c")]<|eot|>'
        "<|header_start|>ipython<|header_end|>\n\n18 C<|eot|><|header_start|>assistant<|header_end|>\n\n"
    ),
    "mistral": (
        "<s>[SYSTEM_PROMPT]You are terse.[/SYSTEM_PROMPT][AVAILABLE_TOOLS]"
        '[{"type": "function", "function": ' + WEATHER_JSON + "}][/AVAILABLE_TOOLS][INST]Weather in Paris?[/INST]"
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "c"}</s>[TOOL_RESULTS]18 C[/TOOL_RESULTS]'
    ),
    "deepseek_v3": (
        "<｜begin▁of▁sentence｜>You are terse.\n\n## Tools\nYou can call these functions:\n" + WEATHER_JSON +
        "<｜User｜>Weather in Paris?<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
        'get_weather\n```json\n{"city": "Paris", "unit": "c"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
        "<｜end▁of▁sentence｜><｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>18 C<｜tool▁output▁end｜>"
        "<｜tool▁outputs▁end｜><｜Assistant｜>"
    ),
    "harmony": (
        "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\nKnowledge cutoff: "
        "2024-06\n\nReasoning: medium\n\n# Valid channels: analysis, commentary, final. Channel must be included for "
        "every message.\nCalls to these tools must go to the commentary channel: 'functions'.<|end|>"
        "<|start|>developer<|message|># Instructions\n\nYou are terse.\n\n# Tools\n\n## functions\n\nnamespace "
        'functions {\n\n// Current weather in a city\ntype get_weather = (_: {\ncity: string,\nunit: "c" | "f",\n}) '
        "=> any;\n\n} // namespace functions<|end|><|start|>user<|message|>Weather in Paris?<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        '{"city": "Paris", "unit": "c"}<|call|>'
        "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>18 C<|end|><|start|>assistant"
    ),
}


@pytest.fixture(scope="module")
def tokenizer(real_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(real_model_dir)


def conversation() -> list[HistoryMessage]:
    call = HistoryCall("call_1", "get_weather", CALLS[0][1], "messages[2].tool_calls[0].function.arguments")
    return [HistoryMessage("system", "You are terse."), HistoryMessage("user", "Weather in Paris?"),
            HistoryMessage("assistant", None, (call,)), HistoryMessage("tool", "18 C", tool_call_id="call_1")]


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_template_renders_its_documented_prompt(tokenizer, family):
    text = template(family)
    fmt = detect_format(text)
    assert fmt.name == family  # auto follows the template
    renderer = ChatRenderer(tokenizer, fmt, text)
    assert renderer.native
    assert renderer.render(conversation(), tools(WEATHER)) == EXPECTED[family]
    # the template writes an earlier call exactly as the format generates (and renders) it
    assert fmt.render_calls(CALLS[:1]) in EXPECTED[family]


@pytest.mark.parametrize("family", FAMILIES)
def test_the_next_turn_extends_the_prompt_by_the_reply_as_generated(tokenizer, family):
    """The reply re-sent as a message renders as the bytes the model generated (what the
    grammar forces), right after the earlier prompt: the prefix cache can hit through it."""
    text = template(family)
    fmt = detect_format(text)
    renderer = ChatRenderer(tokenizer, fmt, text)
    for calls in (CALLS[:1], CALLS):
        history = conversation()[:2]
        before = renderer.render(history, tools(WEATHER, ADD))
        generated = fmt.render_calls(calls)
        parsed = parse_tool_calls(generated, fmt, SCHEMAS, SCHEMAS)
        sent_back = tuple(HistoryCall(f"call_{i}", c.name, c.arguments, "x") for i, c in enumerate(parsed.calls))
        results = [HistoryMessage("tool", "ok", tool_call_id=c.id) for c in sent_back]
        after = renderer.render(history + [HistoryMessage("assistant", parsed.content, sent_back)] + results,
                                tools(WEATHER, ADD))
        if family == "llama3_json" and len(calls) > 1:
            continue  # Llama 3.1's template writes one call a turn
        assert after.startswith(before + generated), family


def test_gemma3_template_gets_the_fallback_rendering(tokenizer):
    text = template("gemma3")
    fmt = detect_format(text)
    renderer = ChatRenderer(tokenizer, fmt, text)
    assert fmt.name == "hermes" and not renderer.native
    plain = [HistoryMessage("system", "You are terse."), HistoryMessage("user", "Hi"), HistoryMessage("assistant", "Hello."),
             HistoryMessage("user", "Bye")]
    assert renderer.render(plain, []) == ("<bos><start_of_turn>user\nYou are terse.\n\nHi<end_of_turn>\n"
                                          "<start_of_turn>model\nHello.<end_of_turn>\n<start_of_turn>user\nBye<end_of_turn>\n"
                                          "<start_of_turn>model\n")
    with_tools = renderer.render(conversation(), tools(WEATHER))
    assert with_tools.startswith("<bos><start_of_turn>user\nYou are terse.\n\n# Tools\n")
    assert ("<start_of_turn>model\n" + fmt.render_calls(CALLS[:1]) + "<end_of_turn>\n") in with_tools


# ---- parsing: whole, streamed, rendered back ------------------------------------------------


def outputs(fmt) -> list[str]:
    """Generated texts: calls alone, after content, one call, and every cut of them (max_tokens)."""
    starts_only = fmt.name in ("pythonic", "llama3_json")
    texts = [fmt.render_message(None, CALLS), fmt.render_message(None, CALLS[:1])]
    if not starts_only:
        texts += [fmt.render_message("Let me check. ", CALLS), fmt.render_message("Checking.", CALLS[1:]) + " Done."]
    return texts


def streamed(fmt, text: str, pieces: list[str]):
    parser = ToolCallParser(fmt, SCHEMAS, SCHEMAS)
    events = [e for piece in pieces for e in parser.feed(piece)] + parser.finish()
    return parser.result(), events


def assemble(events) -> tuple[str, list[ParsedCall]]:
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    names = [e.name for e in events if isinstance(e, CallStarted)]
    args = ["".join(e.text for e in events if isinstance(e, ArgumentsDelta) and e.index == i) for i in range(len(names))]
    return content, [ParsedCall(n, a) for n, a in zip(names, args)]


def token_pieces(tokenizer, text: str) -> list[str]:
    """The text as a model emits it: one token's text at a time (multi-byte characters whole)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces, done = [], ""
    for end in range(1, len(ids) + 1):
        now = tokenizer.decode(ids[:end])
        if not now.endswith("\ufffd"):
            pieces.append(now[len(done):])
            done = now
    assert "".join(pieces) == text
    return pieces


@pytest.mark.parametrize("fmt", every_format(), ids=ids(every_format()))
def test_streamed_equals_whole_for_every_split(tokenizer, fmt):
    for text in outputs(fmt):
        for cut in [len(text)] + list(range(0, len(text), 7)):  # whole outputs and outputs cut short
            prefix = text[:cut]
            whole = parse_tool_calls(prefix, fmt, SCHEMAS, SCHEMAS)
            splits = [token_pieces(tokenizer, prefix)] if cut == len(text) else []
            splits += [[prefix[i:i + n] for i in range(0, len(prefix), n)] for n in (1, 3)] if cut == len(text) else []
            splits += [[prefix[:cut // 2], prefix[cut // 2:]]]
            for pieces in splits:
                result, events = streamed(fmt, prefix, pieces)
                assert result == whole, (fmt.name, prefix, pieces)
                content, calls = assemble(events)
                assert calls == whole.calls
                assert (content or None if whole.calls else content) == whole.content
                for index in range(len(calls)):  # a call's name comes before its arguments
                    start = next(i for i, e in enumerate(events) if isinstance(e, CallStarted) and e.index == index)
                    assert all(i > start for i, e in enumerate(events) if isinstance(e, ArgumentsDelta) and e.index == index)


@pytest.mark.parametrize("fmt", every_format(), ids=ids(every_format()))
def test_whole_parse_and_render_back_byte_for_byte(fmt):
    for text in outputs(fmt):
        parsed = parse_tool_calls(text, fmt, SCHEMAS, SCHEMAS)
        assert [c.name for c in parsed.calls] and all(c.name in SCHEMAS for c in parsed.calls)
        for call in parsed.calls:
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
        assert [json.loads(c.arguments) for c in parsed.calls] == [json.loads(a) for n, a in CALLS if n in
                                                                   {c.name for c in parsed.calls}]
        if text.endswith(" Done."):  # content after the calls joins the content before them
            assert parsed.content.startswith("Checking.") and parsed.content.endswith(" Done.")
            continue
        assert fmt.render_message(parsed.content, [(c.name, c.arguments) for c in parsed.calls]) == text


@pytest.mark.parametrize("fmt", every_format(), ids=ids(every_format()))
def test_a_call_cut_by_max_tokens_returns_its_arguments_so_far(tokenizer, fmt):
    """Every format returns a cut call's arguments as the JSON text written so far (as the
    JSON formats always did; pythonic and qwen3_coder returned none before the first whole
    argument), streamed or whole, and renders them back as written into the next turn."""
    text = fmt.render_calls(CALLS[:1])
    in_value = text.index("Paris") + 3
    in_key = text.index("unit") + 2
    in_second_value = text.index("c", text.index("unit") + 4) + 1
    for cut, expected in ((in_value, '{"city": "Par'), (in_key, '{"city": "Paris", "un'),
                          (in_second_value, '{"city": "Paris", "unit": "c')):
        prefix = text[:cut]
        whole = parse_tool_calls(prefix, fmt, SCHEMAS, SCHEMAS)
        assert whole.calls == [ParsedCall("get_weather", expected)] and whole.content is None, (fmt.name, prefix)
        for pieces in (token_pieces(tokenizer, prefix), [prefix[i:i + 2] for i in range(0, len(prefix), 2)]):
            result, events = streamed(fmt, prefix, pieces)
            assert result == whole and assemble(events)[1] == whole.calls
        turn = HistoryMessage("assistant", None, (HistoryCall("call_1", "get_weather", expected, "m"),))
        (rendered,) = fallback_messages([turn], [], fmt)
        assert rendered["content"] == prefix, fmt.name
    if fmt.name == "pythonic":  # a Python string in single quotes becomes the start of a JSON string
        cut = parse_tool_calls("[get_weather(city='Par", fmt, SCHEMAS, SCHEMAS)
        assert cut.calls == [ParsedCall("get_weather", '{"city": "Par')]


def test_a_named_tool_gives_exactly_one_call_even_with_parallel_calls_on(compiler):
    declared = tools(WEATHER, ADD)
    for fmt in every_format():
        one = tool_call_structural_tag(tool_spec(declared, named("add"), None), fmt)
        assert accepts(compiler, one, fmt.render_calls(CALLS[1:])), fmt.name
        assert not accepts(compiler, one, fmt.render_calls([CALLS[1], CALLS[1]])), fmt.name
        required = tool_call_structural_tag(tool_spec(declared, "required", None), fmt)
        assert accepts(compiler, required, fmt.render_calls([CALLS[1], CALLS[1]])), fmt.name


@pytest.mark.parametrize("fmt", every_format(), ids=ids(every_format()))
def test_undeclared_tools_and_plain_text_stay_content(fmt):
    other = fmt.render_calls([("delete_everything", "{}")])
    for text in ["Just an answer, no call.", other, "[1, 2, 3] are numbers", ""]:
        parsed = parse_tool_calls(text, fmt, SCHEMAS, SCHEMAS)
        assert parsed.calls == [] and parsed.content == text


def test_format_specific_readings():
    py = format_named("pythonic")
    out = parse_tool_calls("[add(a=1, b=-2), get_weather(city='Oslo', unit=\"f\", extra=[True, None, {'k': 1.5}])]", py)
    assert [json.loads(c.arguments) for c in out.calls] == [
        {"a": 1, "b": -2}, {"city": "Oslo", "unit": "f", "extra": [True, None, {"k": 1.5}]}]
    assert out.calls[0].arguments == '{"a": 1, "b": -2}'  # JSON values kept as written
    assert parse_tool_calls("<|python_start|>[add(a=1, b=2)]<|python_end|>", py).calls == [ParsedCall("add", '{"a": 1, "b": 2}')]
    assert parse_tool_calls("[add(a=__import__('os'))]", py).calls[0].arguments == '{"a": "__import__(\'os\')"}'

    qwen = format_named("qwen3_coder")
    text = ("<tool_call>\n<function=f>\n<parameter=s>\n123\n</parameter>\n<parameter=n>\n123\n</parameter>\n"
            "<parameter=o>\n{\"k\": [1, 2]}\n</parameter>\n<parameter=free>\nnot json\n</parameter>\n</function>\n</tool_call>")
    schemas = {"f": {"type": "object", "properties": {"s": {"type": "string"}, "n": {"type": "integer"},
                                                      "o": {"type": "object"}}}}
    (call,) = parse_tool_calls(text, qwen, None, schemas).calls
    assert json.loads(call.arguments) == {"s": "123", "n": 123, "o": {"k": [1, 2]}, "free": "not json"}

    mistral = format_named("mistral")  # no template: the list form
    out = parse_tool_calls('[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1, "b": 2}, "id": "abcDEF123"}]', mistral)
    assert out.calls == [ParsedCall("add", '{"a": 1, "b": 2}')] and out.content is None
    assert format_named("mistral", template("mistral")).named

    harmony = format_named("harmony")
    text = ("<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant to=functions.get_weather"
            '<|channel|>commentary json<|message|>{"city": "Oslo"}<|call|>')
    out = parse_tool_calls(text, harmony)
    assert out.calls == [ParsedCall("get_weather", '{"city": "Oslo"}')] and out.content == "Need weather."
    final = parse_tool_calls("<|channel|>final<|message|>It is 18 C.<|return|>", harmony)
    assert final == parse_tool_calls("It is 18 C.", harmony) and final.content == "It is 18 C."

    deepseek = format_named("deepseek_v3")
    out = parse_tool_calls("Sure." + deepseek.render_calls(CALLS) + " Anything else?", deepseek)
    assert out.content == "Sure. Anything else?" and len(out.calls) == 2


def test_parsers_never_raise_and_stream_equals_whole_on_arbitrary_text():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    markers = ['<tool_call>', '</tool_call>', '<function=add>', '<parameter=a>', '</parameter>', '</function>',
               '[TOOL_CALLS]', '[ARGS]', '<｜tool▁calls▁begin｜>', '<｜tool▁call▁begin｜>', 'function<｜tool▁sep｜>add',
               '\n```json\n', '\n```', '<｜tool▁call▁end｜>', '<｜tool▁calls▁end｜>', '<|channel|>', 'commentary',
               ' to=functions.add', '<|message|>', '<|call|>', '<|end|>', '<|start|>assistant', '[', ']', 'add(',
               'a=1', ')', ', ', '{"name": "add", "arguments": ', '{', '}', '"', "'", '\\', ' ', '\n', 'text', '1']

    @settings(max_examples=150, deadline=None)
    @given(st.lists(st.sampled_from(markers), max_size=24), st.lists(st.integers(0, 120), max_size=6),
           st.sampled_from(every_format()))
    def check(parts, cuts, fmt):
        text = "".join(parts)
        whole = parse_tool_calls(text, fmt, {"add"})
        bounds = sorted(c for c in cuts if c <= len(text)) + [len(text)]
        pieces = [text[a:b] for a, b in zip([0] + bounds, bounds)]
        parser = ToolCallParser(fmt, {"add"})
        events = [e for p in pieces for e in parser.feed(p)] + parser.finish()
        assert parser.result() == whole
        content, calls = assemble(events)
        assert calls == whole.calls and (content or None if whole.calls else content) == whole.content

    check()


# ---- grammars -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compiler(tokenizer):
    import xgrammar as xgr

    return xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=49152, stop_token_ids=[2]))


def accepts(compiler, tag, text) -> bool:
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(compiler.compile_structural_tag(json.dumps(tag)))
    return matcher.accept_string(text) and (matcher.is_terminated() or matcher.accept_token(2))


def named(name):
    return NamedToolChoice.model_validate({"type": "function", "function": {"name": name}})


@pytest.mark.parametrize("fmt", every_format(), ids=ids(every_format()))
def test_forced_and_auto_grammars(compiler, fmt):
    declared = tools(WEATHER, ADD)
    required = tool_call_structural_tag(tool_spec(declared, "required", None), fmt)
    assert accepts(compiler, required, fmt.render_calls(CALLS))
    assert accepts(compiler, required, fmt.render_calls(CALLS[:1]))
    assert not accepts(compiler, required, "Sure!")
    assert not accepts(compiler, required, fmt.render_calls([("get_weather", '{"city": "Paris", "unit": "k"}')]))
    assert not accepts(compiler, required, fmt.render_calls([("add", '{"a": "x", "b": 2}')]))
    assert not accepts(compiler, required, fmt.render_calls([("sub", '{"a": 1, "b": 2}')]))
    one = tool_call_structural_tag(tool_spec(declared, named("add"), False), fmt)
    assert accepts(compiler, one, fmt.render_calls(CALLS[1:]))
    assert not accepts(compiler, one, fmt.render_calls(CALLS[:1])) and not accepts(compiler, one, fmt.render_calls(CALLS))
    auto = tool_call_structural_tag(tool_spec(declared, "auto", None), fmt)
    assert accepts(compiler, auto, "Just text, no call.")
    content = None if fmt.name in ("pythonic", "llama3_json") else "Let me check."
    assert accepts(compiler, auto, fmt.render_message(content, CALLS))
    assert not accepts(compiler, auto, fmt.render_message(content, [("add", '{"a": "x", "b": 2}')]))
    assert tool_call_structural_tag(tool_spec(declared, "none", None), fmt) is None


@pytest.fixture(scope="module")
def forced_outputs(real_engine) -> dict[str, list]:
    """Every format's three forced generations (greedy one call, sampled one call, sampled
    parallel calls), all formats in one batch: one decode step serves them all."""
    from radixserve import SamplingParams

    real_engine.flush_cache()
    prompt = real_engine.apply_chat_template([{"role": "user", "content": "Weather in Paris, and add 2 and 3."}])
    params = {}
    for name, fmt in zip(ids(every_format()), every_format()):
        single = tool_call_structural_tag(tool_spec(tools(WEATHER, ADD), "required", False), fmt)
        parallel = tool_call_structural_tag(tool_spec(tools(WEATHER, ADD), "required", None), fmt)
        params[name] = [SamplingParams(max_tokens=160, temperature=t, seed=s, structural_tag=tag)
                        for t, s, tag in ((0.0, 0, single), (1.0, 1, single), (1.0, 2, parallel))]
    every = [p for name in params for p in params[name]]
    outs = iter(real_engine.generate([prompt] * len(every), every, use_tqdm=False))
    real_engine.check_integrity()
    return {name: [next(outs) for _ in params[name]] for name in params}


@pytest.mark.parametrize("fmt", every_format(), ids=ids(every_format()))
def test_grammar_forced_calls_on_the_model_parse_and_validate(forced_outputs, fmt):
    """The real model generating under each format's grammar (greedy and sampled): every
    output parses into calls whose arguments validate against the schema."""
    outs = forced_outputs[ids([fmt])[0]]
    assert outs[0].finish_reason == "stop"  # greedy, one call: closed, and the grammar ends there
    for out in outs:
        parsed = parse_tool_calls(out.text, fmt, SCHEMAS, SCHEMAS)
        assert parsed.calls, out.text
        assert parsed.content is None or out.finish_reason == "length", out.text  # a header cut short is content
        complete = parsed.calls if out.finish_reason == "stop" else parsed.calls[:-1]  # the last may be cut
        for call in complete:
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    assert len(parse_tool_calls(outs[0].text, fmt, SCHEMAS, SCHEMAS).calls) == 1


# ---- the registry, --tool-call-parser, --chat-template --------------------------------------


def test_registry_names_aliases_and_errors():
    assert set(FAMILIES) <= set(PARSER_CHOICES) and "auto" in PARSER_CHOICES
    assert format_named("qwen").name == "hermes" and format_named("llama3").name == "llama3_json"
    assert format_named("openai").name == "harmony"
    with pytest.raises(ValueError, match="unknown tool-call parser 'nope'; choose one of auto, hermes, llama3_json"):
        format_named("nope")
    assert detect_format(None).name == "hermes"
    assert detect_format("{{ '<|python_tag|>' }}").name == "llama3_json"
    assert detect_format(template("gemma3")).name == "hermes"


def test_flags(tmp_path):
    import argparse

    from radixserve.server.launch import add_server_args, server_options
    from radixserve.server.options import ServerOptions

    parser = argparse.ArgumentParser()
    add_server_args(parser)
    for name in FAMILIES:
        assert server_options(parser.parse_args(["--tool-call-parser", name])).tool_call_parser == name
    with pytest.raises(SystemExit):
        parser.parse_args(["--tool-call-parser", "nope"])
    with pytest.raises(ValueError, match="tool_call_parser must be one of auto, hermes"):
        ServerOptions(tool_call_parser="nope")
    path = tmp_path / "t.jinja"
    path.write_text(template("harmony"), encoding="utf-8")
    options = server_options(parser.parse_args(["--chat-template", str(path), "--trust-request-chat-template"]))
    assert options.chat_template == template("harmony") and options.trust_request_chat_template
    inline = "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert server_options(parser.parse_args(["--chat-template", inline])).chat_template == inline
    assert server_options(parser.parse_args([])).chat_template is None
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        server_options(parser.parse_args(["--chat-template", str(tmp_path / "missing.jinja")]))
    with pytest.raises(ValueError, match="not a valid Jinja template"):
        load_chat_template("{% for m in messages %}")


def test_the_template_in_force_picks_format_and_rendering(tokenizer):
    from radixserve.engine.prompt_builder import ChatPrompt, PromptBuilder
    from radixserve.server.errors import APIError
    from radixserve.server.tool_calling import ToolCalling

    builder = PromptBuilder(tokenizer)  # the engine's: builds what a prepare worker builds
    spec = tool_spec(tools(WEATHER), None, None)
    own = ToolCalling(tokenizer, "auto")
    prompt = own.prompt(conversation(), spec)
    assert own.fmt.name == "hermes" and isinstance(prompt, ChatPrompt) and not own.renderer.native
    assert "# Tools" in tokenizer.decode(builder.token_ids(prompt))  # the fallback, through the model's own template
    served = ToolCalling(tokenizer, "auto", template("deepseek_v3"))
    ids = builder.token_ids(served.prompt(conversation(), spec))
    assert served.fmt.name == "deepseek_v3" and tokenizer.decode(ids) == EXPECTED["deepseek_v3"]
    with pytest.raises(APIError) as refused:
        own.for_template(template("harmony"))
    assert refused.value.status == 400 and refused.value.param == "chat_template"
    trusting = ToolCalling(tokenizer, "auto", None, trust_request_templates=True)
    per_request = trusting.for_template(template("harmony"))
    assert per_request.fmt.name == "harmony" and trusting.fmt.name == "hermes"
    assert trusting.for_template(template("harmony")) is per_request and trusting.for_template(None) is trusting
    assert tokenizer.decode(builder.token_ids(per_request.prompt(conversation(), spec))) == EXPECTED["harmony"]
    assert ToolCalling(tokenizer, "mistral", template("mistral")).fmt.named
    with pytest.raises(APIError, match="not a valid Jinja template"):
        trusting.for_template("{% if %}")


def test_a_copied_tokenizer_template_is_left_alone(tokenizer):
    """--chat-template never changes the tokenizer (the engine's template stays the model's)."""
    from radixserve.server.tool_calling import ToolCalling

    before = copy.copy(tokenizer.chat_template)
    ToolCalling(tokenizer, "auto", template("hermes")).renderer.render(conversation(), tools(WEATHER))
    assert tokenizer.chat_template == before


@pytest.mark.parametrize("fmt", every_format(), ids=ids(every_format()))
def test_long_arguments_stream_in_linear_time(fmt):
    """A call with 60,000 characters of arguments, fed 4 characters at a time: scanning again
    from the start on every piece would take minutes; reading on takes well under a second."""
    import time

    arguments = '{"a": [' + ", ".join(["7"] * 10_000) + '], "b": "' + "x" * 30_000 + '"}'
    text = fmt.render_calls([("add", arguments)])
    parser = ToolCallParser(fmt, {"add"})
    started = time.perf_counter()
    for at in range(0, len(text), 4):
        parser.feed(text[at:at + 4])
    parser.finish()
    assert time.perf_counter() - started < 10
    assert json.loads(parser.result().calls[0].arguments) == json.loads(arguments)


def test_special_token_markers_stay_in_the_text(tokenizer):
    """Where a format's markers are special tokens of the model, decoding keeps them (else the
    parser would never see a call); where they are plain text nothing changes."""
    from radixserve.tools.grammar import tool_constraint

    spec = tool_spec(tools(ADD), "required", None)
    mistral, hermes = format_named("mistral"), format_named("hermes")
    assert "skip_special_tokens" not in tool_constraint(spec, mistral, tokenizer)
    mistral_vocab = copy.deepcopy(tokenizer)
    mistral_vocab.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]", "[ARGS]"]})
    assert tool_constraint(spec, mistral, mistral_vocab)["skip_special_tokens"] is False
    assert "skip_special_tokens" not in tool_constraint(spec, hermes, mistral_vocab)
    assert tool_constraint(tool_spec(tools(ADD), "none", None), mistral, mistral_vocab) == {}
