"""Tool calling pieces without a server: definitions and their 400s, the parsers (streamed
deltas assemble to the complete parse), the chat rendering (fallback and native, stable
across turns) and the grammars (valid calls accepted, invalid ones refused)."""

from __future__ import annotations

import copy
import json
import random

import pytest

from radixserve.request_error import InvalidRequest
from radixserve.server.errors import APIError
from radixserve.server.protocol.common import parse
from radixserve.tools import (
    HERMES, LLAMA3, MAX_PARALLEL_CALLS, MAX_TOOLS, ArgumentsDelta, CallStarted, ChatRenderer, ContentDelta,
    HistoryCall, HistoryMessage, NamedToolChoice, ParsedCall, ToolCallParser, ToolDefinition, check_history,
    detect_format, parse_tool_calls, tool_call_structural_tag, tool_spec,
)
from radixserve.tools.definitions import ToolList
from radixserve.tools.history import parsed_arguments

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                       "required": ["a", "b"], "additionalProperties": False},
    },
}


def tools(*raw):
    return [ToolDefinition.model_validate(t) for t in raw]


def named(name):
    return NamedToolChoice.model_validate({"type": "function", "function": {"name": name}})


# ---- definitions ----------------------------------------------------------------------------


def test_tool_spec_modes():
    spec = tool_spec(tools(WEATHER, ADD), None, None)
    assert (spec.mode, spec.parallel, spec.names) == ("auto", True, ["get_weather", "add"])
    assert tool_spec(None, None, None).parses_calls is False
    assert tool_spec(tools(WEATHER), "none", None).parses_calls is False
    spec = tool_spec(tools(WEATHER, ADD), named("add"), False)
    assert (spec.mode, spec.named, spec.parallel) == ("named", "add", False)
    assert [t.name for t, _ in spec.callable_tools()] == ["add"]


@pytest.mark.parametrize(
    "raw_tools, choice, param",
    [
        ([WEATHER], "named:nope", "tool_choice"),
        ([], "required", "tool_choice"),
        ([WEATHER, WEATHER], None, "tools[1].function.name"),
        ([{"type": "function", "function": {"name": "bad", "parameters": {"type": "object", "properties": {
            "x": {"type": "string", "pattern": "(unclosed"}}}}}], None, "tools[0].function.parameters"),
        ([{"type": "function", "function": {"name": "bad", "parameters": {"type": "no-such-type"}}}], None,
         "tools[0].function.parameters"),
    ],
)
def test_tool_spec_refuses_naming_the_field(raw_tools, choice, param):
    choice = named(choice.split(":")[1]) if isinstance(choice, str) and choice.startswith("named:") else choice
    with pytest.raises(InvalidRequest) as err:
        tool_spec(tools(*raw_tools), choice, None)
    assert err.value.param == param, err.value.message


def test_too_many_tools_and_bad_names_are_400s():
    from pydantic import BaseModel

    from radixserve.server.protocol.common import OpenAIModel

    class Body(OpenAIModel):
        tools: ToolList

    many = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(MAX_TOOLS + 1)]
    with pytest.raises(APIError) as err:
        parse(Body, {"tools": many})
    assert err.value.param == "tools" and str(MAX_TOOLS) in err.value.message
    with pytest.raises(APIError) as err:
        parse(Body, {"tools": [{"type": "function", "function": {"name": "has space"}}]})
    assert err.value.param == "tools[0].function.name"
    assert issubclass(Body, BaseModel)


def test_history_checks():
    call = HistoryCall("call_1", "add", '{"a": 1, "b": 2}', "messages[1].tool_calls[0].function.arguments")
    good = [
        HistoryMessage("user", "add 1 and 2"),
        HistoryMessage("assistant", None, (call,)),
        HistoryMessage("tool", "3", tool_call_id="call_1", tool_call_id_param="messages[2].tool_call_id"),
    ]
    assert set(check_history(good)) == {"call_1"}
    orphan = good[:2] + [HistoryMessage("tool", "3", tool_call_id="call_9", tool_call_id_param="messages[2].tool_call_id")]
    with pytest.raises(InvalidRequest) as err:
        check_history(orphan)
    assert err.value.param == "messages[2].tool_call_id"
    cut = HistoryCall("call_1", "add", '{"a": 1,', "messages[1].tool_calls[0].function.arguments")
    assert set(check_history([good[0], HistoryMessage("assistant", None, (cut,)), good[2]])) == {"call_1"}
    assert parsed_arguments(cut) == '{"a": 1,' and parsed_arguments(call) == {"a": 1, "b": 2}


# ---- parsers ----------------------------------------------------------------------------------

HERMES_TEXTS = [
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa}r\\"is", "unit": "c"}}\n</tool_call>',
    '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": [2, {"c": "]"}]}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "f"}}\n</tool_call>',
    '<tool_call>{"name":"add","arguments":{"a":1}}</tool_call> and more text',
    'no calls here, just < and <tool and <tool_cal',
    '<tool_call>\n{"name": "unknown_tool", "arguments": {}}\n</tool_call>',
    '<tool_call>\n{"oops": 1}\n</tool_call>',
    '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b"',  # cut short by max_tokens
    '<tool_call>\n{"name": "add", "arguments": {"a": 1}} garbage </tool_call>',
    "   \n  ",
    "",
]


def test_hermes_parse():
    out = parse_tool_calls(HERMES_TEXTS[0], HERMES, {"get_weather", "add"})
    assert out.content == "Let me check.\n"
    assert out.calls == [ParsedCall("get_weather", '{"city": "Pa}r\\"is", "unit": "c"}')]
    out = parse_tool_calls(HERMES_TEXTS[1], HERMES, {"get_weather", "add"})
    assert out.content is None
    assert [c.name for c in out.calls] == ["add", "get_weather"]
    assert json.loads(out.calls[0].arguments) == {"a": 1, "b": [2, {"c": "]"}]}
    out = parse_tool_calls(HERMES_TEXTS[2], HERMES, None)
    assert out.calls == [ParsedCall("add", '{"a":1}')] and out.content == " and more text"
    assert parse_tool_calls(HERMES_TEXTS[3], HERMES).content == HERMES_TEXTS[3]
    assert parse_tool_calls(HERMES_TEXTS[4], HERMES, {"add"}).content == HERMES_TEXTS[4]
    assert parse_tool_calls(HERMES_TEXTS[5], HERMES).content == HERMES_TEXTS[5]
    cut = parse_tool_calls(HERMES_TEXTS[6], HERMES)
    assert cut.calls == [ParsedCall("add", '{"a": 1, "b"')] and cut.content is None
    junk = parse_tool_calls(HERMES_TEXTS[7], HERMES)
    assert junk.calls == [ParsedCall("add", '{"a": 1}')] and junk.content == "} garbage </tool_call>"
    assert parse_tool_calls("   \n  ", HERMES).content == "   \n  "
    assert parse_tool_calls("", HERMES).content == ""


LLAMA_TEXTS = [
    '{"name": "add", "parameters": {"a": 1, "b": 2}}',
    '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "get_weather", "parameters": {"city": "x"}}',
    'The answer is {"name": "add", "parameters": {}}',
    '  {"name": "add", "parameters": {"a": 1}} then words',
    '{"not": "a call"}',
]


def test_llama3_parse():
    assert parse_tool_calls(LLAMA_TEXTS[0], LLAMA3).calls == [ParsedCall("add", '{"a": 1, "b": 2}')]
    out = parse_tool_calls(LLAMA_TEXTS[1], LLAMA3)
    assert [c.name for c in out.calls] == ["add", "get_weather"] and out.content is None
    assert parse_tool_calls(LLAMA_TEXTS[2], LLAMA3).calls == []
    out = parse_tool_calls(LLAMA_TEXTS[3], LLAMA3)
    assert out.calls == [ParsedCall("add", '{"a": 1}')] and out.content == " then words"
    assert parse_tool_calls(LLAMA_TEXTS[4], LLAMA3).content == LLAMA_TEXTS[4]


@pytest.mark.parametrize("fmt, texts", [(HERMES, HERMES_TEXTS), (LLAMA3, LLAMA_TEXTS)])
def test_streamed_deltas_assemble_to_the_complete_parse(fmt, texts):
    rng = random.Random(0)
    allowed = {"get_weather", "add"}
    for text in texts:
        whole = parse_tool_calls(text, fmt, allowed)
        for _ in range(20):
            parser = ToolCallParser(fmt, allowed)
            events = []
            at = 0
            while at < len(text):
                size = rng.randint(1, 6)
                events += parser.feed(text[at:at + size])
                at += size
            events += parser.finish()
            content = "".join(e.text for e in events if isinstance(e, ContentDelta))
            names = [e.name for e in events if isinstance(e, CallStarted)]
            args = ["".join(e.text for e in events if isinstance(e, ArgumentsDelta) and e.index == i)
                    for i in range(len(names))]
            assert (content or None if whole.calls else content) == whole.content, text
            assert [ParsedCall(n, a) for n, a in zip(names, args)] == whole.calls, text
            starts = [i for i, e in enumerate(events) if isinstance(e, CallStarted)]
            for index, start in enumerate(starts):  # a call's name comes before its arguments
                first_args = next((i for i, e in enumerate(events) if isinstance(e, ArgumentsDelta) and e.index == index), None)
                assert first_args is None or first_args > start


def test_detect_format():
    assert detect_format(None) is HERMES
    assert detect_format("{{ '<tool_call>' }}") is HERMES
    assert detect_format("{{ '<|python_tag|>' }} parameters") is LLAMA3


# ---- rendering --------------------------------------------------------------------------------

NATIVE_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTOOLS{% for t in tools %} {{ t.function.name }}{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}[{{ c.function.name }} {{ c.function.arguments | tojson }}]"
    "{% endfor %}{% endif %}{% if m.tool_call_id %}({{ m.tool_call_id }} {{ m.name }}){% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer(real_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(real_model_dir)


def conversation(turns: int) -> list[HistoryMessage]:
    messages = [HistoryMessage("system", "Be brief."), HistoryMessage("user", "Weather in Paris and Oslo?")]
    for k in range(turns):
        calls = (HistoryCall(f"call_{k}a", "get_weather", '{"city": "Paris", "unit": "c"}', "x"),
                 HistoryCall(f"call_{k}b", "add", f'{{"a": {k}, "b": 2}}', "x"))
        messages += [HistoryMessage("assistant", "Checking." if k else None, calls),
                     HistoryMessage("tool", "18 C", tool_call_id=f"call_{k}a"),
                     HistoryMessage("tool", str(k + 2), tool_call_id=f"call_{k}b")]
    return messages


def test_fallback_rendering_keeps_everything_and_is_stable(tokenizer):
    renderer = ChatRenderer(tokenizer, HERMES)
    assert not renderer.native
    defs = tools(WEATHER, ADD)
    one = renderer.render(conversation(1), defs)
    assert one.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert json.dumps(defs[0].template_entry()["function"]) in one
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}'
            '\n</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 0, "b": 2}}\n</tool_call><|im_end|>') in one
    assert ('<|im_start|>user\n<tool_response id="call_0a" name="get_weather">\n18 C\n</tool_response>\n'
            '<tool_response id="call_0b" name="add">\n2\n</tool_response><|im_end|>\n<|im_start|>assistant\n') in one
    for k in range(1, 4):
        before = renderer.render(conversation(k), defs)
        after = renderer.render(conversation(k + 1), defs)
        assert after.startswith(before)
        ids_before = tokenizer.encode(before, add_special_tokens=False)
        ids_after = tokenizer.encode(after, add_special_tokens=False)
        assert ids_after[: len(ids_before)] == ids_before
    # no system message: a new one holds the tools; no tools: calls and results still rendered
    text = renderer.render(conversation(1)[1:], defs)
    assert text.startswith("<|im_start|>system\n# Tools")
    assert "<tool_call>" in renderer.render(conversation(1), []) and "# Tools" not in renderer.render(conversation(1), [])


def test_generated_calls_render_back_byte_for_byte():
    generated = HERMES.render_calls([("add", '{"a": 1, "b": 2}')])
    parsed = parse_tool_calls(generated, HERMES)
    again = HERMES.render_calls([(c.name, c.arguments) for c in parsed.calls])
    assert again == generated


def test_native_template_gets_tools_and_calls(tokenizer):
    native = copy.copy(tokenizer)
    native.chat_template = NATIVE_TEMPLATE
    renderer = ChatRenderer(native, HERMES)
    assert renderer.native
    text = renderer.render(conversation(1), tools(WEATHER, ADD))
    assert text.startswith("<|im_start|>system\nTOOLS get_weather add<|im_end|>")
    assert '[get_weather {"city": "Paris", "unit": "c"}]' in text
    assert "(call_0a get_weather)" in text and "(call_0b add)" in text
    assert renderer.render(conversation(2), tools(WEATHER, ADD)).startswith(text)


def test_a_native_template_that_refuses_the_messages_is_a_400_naming_them(tokenizer):
    """A template's own raise_exception (as Llama 3.1's "single tool-calls only") is the
    client's error, not the server's: 400 on param messages."""
    from radixserve.engine.prompt_builder import PromptBuilder
    from radixserve.server.tool_calling import ToolCalling

    native = copy.copy(tokenizer)
    native.chat_template = ("{% for m in messages %}{% if m.tool_calls and m.tool_calls | length > 1 %}"
                            "{{ raise_exception('This model only supports single tool-calls at once!') }}{% endif %}"
                            "{% endfor %}" + NATIVE_TEMPLATE)
    calling = ToolCalling(native, "hermes")
    assert calling.renderer.native
    spec = tool_spec(tools(WEATHER, ADD), None, None)
    builder = PromptBuilder(native)  # the engine's, as a prepare worker builds the prompt
    assert builder.token_ids(calling.prompt(conversation(0), spec))  # one call per turn renders
    with pytest.raises(InvalidRequest) as refused:  # the server answers it as a 400 naming the param
        builder.build(calling.prompt(conversation(1), spec))  # two calls in one assistant turn
    assert refused.value.param == "messages"
    assert "only supports single tool-calls" in refused.value.message


# ---- grammars ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compiler(tokenizer):
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=49152, stop_token_ids=[2])
    return xgr.GrammarCompiler(info)


def accepts(compiler, tag, text) -> bool:
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(compiler.compile_structural_tag(json.dumps(tag)))
    return matcher.accept_string(text) and (matcher.is_terminated() or matcher.accept_token(2))


W = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
A = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'


def test_required_grammar(compiler):
    spec = tool_spec(tools(WEATHER, ADD), "required", None)
    tag = tool_call_structural_tag(spec, HERMES)
    assert accepts(compiler, tag, W) and accepts(compiler, tag, A + "\n" + W)
    assert not accepts(compiler, tag, "Sure!")  # a call is required
    assert not accepts(compiler, tag, W.replace("Paris", "Paris\", \"extra\": \"x"))  # additionalProperties
    assert not accepts(compiler, tag, W.replace('"c"', '"k"'))  # enum
    assert not accepts(compiler, tag, A.replace(": 2", ': "2"'))  # integer
    assert not accepts(compiler, tag, A.replace("add", "sub"))  # undeclared tool
    assert not accepts(compiler, tag, A.replace('{"a": 1, ', '{"a":1, '))  # compact separators only
    limit = "\n".join([A] * MAX_PARALLEL_CALLS)
    assert accepts(compiler, tag, limit) and not accepts(compiler, tag, limit + "\n" + A)


def test_named_and_single_call_grammars(compiler):
    tag = tool_call_structural_tag(tool_spec(tools(WEATHER, ADD), named("add"), False), HERMES)
    assert accepts(compiler, tag, A)
    assert not accepts(compiler, tag, W) and not accepts(compiler, tag, A + "\n" + A)
    tag = tool_call_structural_tag(tool_spec(tools(WEATHER, ADD), named("add"), None), LLAMA3)
    assert accepts(compiler, tag, '{"name": "add", "parameters": {"a": 1, "b": 2}}')
    assert not accepts(compiler, tag, '{"name": "add", "parameters": {"a": 1}}')  # b is required


def test_auto_grammar_constrains_only_inside_calls(compiler):
    tag = tool_call_structural_tag(tool_spec(tools(WEATHER, ADD), "auto", None), HERMES)
    assert accepts(compiler, tag, "Just text, no call.")
    assert accepts(compiler, tag, "Let me add. " + A + " Done.")
    assert not accepts(compiler, tag, "Let me add. " + A.replace("add", "sub"))
    assert not accepts(compiler, tag, '<tool_call>\n{"name": "add", "arguments": {"a": "x"}}\n</tool_call>')
    assert tool_call_structural_tag(tool_spec(tools(WEATHER), "none", None), HERMES) is None


def test_structural_tag_is_one_constraint_among_the_others():
    from radixserve.sampling_params import SamplingParams

    tag = tool_call_structural_tag(tool_spec(tools(ADD), "required", None), HERMES)
    params = SamplingParams(structural_tag=tag)
    assert params.constrained
    with pytest.raises(ValueError, match="at most one of"):
        SamplingParams(structural_tag=tag, regex="a+")
    with pytest.raises(ValueError, match="structural_tag must be"):
        SamplingParams(structural_tag=5)


def test_tool_call_parser_flag():
    import argparse

    from radixserve.server.launch import add_server_args, server_options
    from radixserve.server.options import ServerOptions

    parser = argparse.ArgumentParser()
    add_server_args(parser)
    assert server_options(parser.parse_args([])).tool_call_parser == "auto"
    assert server_options(parser.parse_args(["--tool-call-parser", "llama3"])).tool_call_parser == "llama3"
    with pytest.raises(SystemExit):
        parser.parse_args(["--tool-call-parser", "nope"])
    with pytest.raises(ValueError, match="tool_call_parser"):
        ServerOptions(tool_call_parser="nope")


def _assembled(fmt, text, cuts, allowed):
    parser = ToolCallParser(fmt, allowed)
    events, at = [], 0
    for cut in sorted(cuts) + [len(text)]:
        events += parser.feed(text[at:cut])
        at = max(at, cut)
    events += parser.finish()
    return parser.result(), events


def test_parser_never_raises_and_streams_equal_whole_on_arbitrary_text():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    pieces = st.sampled_from(['<tool_call>', '</tool_call>', '\n', '{"name": "add", "arguments": ', '{"name": ',
                              '"add"', '"x"', ', ', '{', '}', '[', ']', '"', '\\', ' ', 'text', ';', '<|python_tag|>',
                              '"parameters": ', '1', ':'])

    @settings(max_examples=300, deadline=None)
    @given(st.lists(pieces, max_size=30), st.lists(st.integers(0, 200), max_size=8), st.sampled_from([HERMES, LLAMA3]))
    def check(parts, cuts, fmt):
        text = "".join(parts)
        whole = parse_tool_calls(text, fmt, {"add"})
        result, events = _assembled(fmt, text, [c for c in cuts if c <= len(text)], {"add"})
        assert result == whole
        content = "".join(e.text for e in events if isinstance(e, ContentDelta))
        assert (content or None if whole.calls else content) == whole.content
        assert all(c.name == "add" for c in whole.calls)

    check()
