"""Tools without the server, on the real default model: `Engine.chat`, `Engine.generate` with
tools and the DSL's `rl.tools` / `gen(tool_choice=...)`. The conversation is built by the one
prompt builder the server uses (engine/prompt_builder.py): under each tool-call family's chat
template (SmolLM2's own knows no tools: the fallback writes them in the system turn), a forced
call parses into arguments that validate against the tool's schema."""

from __future__ import annotations

import copy
import json

import jsonschema
import pytest

import radixserve.lang as rl
from radixserve import SamplingParams
from radixserve.request_error import InvalidRequest
from radixserve.server.tool_calling import ToolCalling
from radixserve.tools.definitions import checked_tools
from radixserve.tools.history import history_of
from tool_fixtures import ADD_SCHEMA, FORMAT_FAMILIES, SCHEMAS, TEMPLATES, TOOLS

pytestmark = pytest.mark.real_model

FAMILIES = [None, *FORMAT_FAMILIES]
ASK = [{"role": "system", "content": "You are terse."},
       {"role": "user", "content": "What is the weather in Paris? Use celsius."}]
GREEDY = SamplingParams(max_tokens=200, temperature=0.0)
ADD = {"type": "function", "function": {"name": "add"}}


def template(family: str | None) -> str | None:
    return None if family is None else (TEMPLATES / f"{family}.jinja").read_text(encoding="utf-8")


@pytest.mark.parametrize("family", FAMILIES, ids=[f or "own" for f in FAMILIES])
def test_a_forced_call_from_engine_chat_parses_and_validates(real_engine, family):
    (out,) = real_engine.chat(ASK, GREEDY, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                              chat_template=template(family))
    (call,) = out.tool_calls
    assert call.name in SCHEMAS and out.finish_reason == "stop"
    jsonschema.validate(call.parsed, SCHEMAS[call.name])
    assert json.loads(call.arguments) == call.parsed
    assert not (out.content or "").strip()  # a forced call is all the answer
    assert out.text and out.token_ids == out.output.token_ids  # the RequestOutput reads through


def test_a_named_call_from_generate_over_several_conversations(real_engine):
    conversations = [[{"role": "user", "content": f"Add {a} and {b}."}] for a, b in ((12, 30), (7, 8))]
    outs = real_engine.generate(conversations, GREEDY, tools=TOOLS, tool_choice=ADD, parallel_tool_calls=False)
    for out in outs:
        (call,) = out.tool_calls
        assert call.name == "add"
        jsonschema.validate(call.parsed, ADD_SCHEMA)


def test_the_engine_builds_the_prompt_the_server_builds(real_engine):
    """Engine.chat's prompt is the server's chat completions prompt for the same conversation:
    one builder, whichever caller (the server's ToolCalling makes the same ChatPrompt)."""
    spec = checked_tools(TOOLS, "required", False, compile=False)
    for family in ("hermes", None):
        calling = ToolCalling(real_engine.tokenizer, "auto", template(family))
        served = real_engine.build_prompt(calling.prompt(history_of(ASK), spec))
        (out,) = real_engine.chat(ASK, SamplingParams(max_tokens=1, temperature=0.0), tools=TOOLS,
                                  tool_choice="required", parallel_tool_calls=False, chat_template=template(family))
        assert out.prompt_token_ids == served.token_ids
        assert served.constraint["structural_tag"]["type"] == "structural_tag"


def test_generate_with_tools_on_a_prompt_given_as_text(real_engine):
    """A text the caller rendered itself (apply_chat_template with the tools in it): the
    answer is still forced into a call and read back."""
    text = real_engine.tokenizer.decode(real_engine.build_prompt(
        real_engine.prompts.chat_prompt(ASK, checked_tools(TOOLS, compile=False))).token_ids)
    (out,) = real_engine.generate(text, GREEDY, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    (call,) = out.tool_calls
    jsonschema.validate(call.parsed, SCHEMAS[call.name])
    (plain,) = real_engine.generate(text, SamplingParams(max_tokens=2, temperature=0.0))
    assert not hasattr(plain, "tool_calls")  # no tools, no conversation: a plain RequestOutput


def test_tool_choice_none_and_plain_chat_stay_text(real_engine):
    (out,) = real_engine.chat([{"role": "user", "content": "Say hi."}], SamplingParams(max_tokens=8, temperature=0.0))
    assert out.content == out.text and out.tool_calls == []
    (none,) = real_engine.chat(ASK, SamplingParams(max_tokens=8, temperature=0.0), tools=TOOLS, tool_choice="none")
    assert none.content == none.text and none.tool_calls == []


def test_refusals_name_the_field_and_start_nothing(real_engine):
    cases = [
        (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
        (dict(tools=[{"type": "function", "function": {"name": "bad", "parameters": {"type": "no-such"}}}],
              tool_choice="required"), "tools[0].function.parameters"),
        (dict(tool_choice="required"), "tool_choice"),
        (dict(tools=[{"type": "function"}]), "tools"),
    ]
    for kwargs, param in cases:
        with pytest.raises(InvalidRequest) as refused:
            real_engine.chat(ASK, GREEDY, **kwargs)
        assert refused.value.param == param, refused.value
    orphan = ASK + [{"role": "tool", "tool_call_id": "call_9", "content": "18"}]
    with pytest.raises(InvalidRequest) as refused:
        real_engine.chat(orphan, GREEDY, tools=TOOLS)
    assert refused.value.param == "messages[2].tool_call_id"
    assert not real_engine.has_unfinished_requests()


# ---- the DSL ---------------------------------------------------------------------------


@rl.function
def weather_agent(s, question):
    s += rl.tools(TOOLS)
    s += rl.system("You are terse.")
    s += rl.user(question)
    s += rl.assistant(rl.gen("call", max_tokens=80, tool_choice="required", parallel_tool_calls=False))
    s += rl.user("<tool_response>\n18 C\n</tool_response>")
    s += rl.assistant(rl.gen("answer", max_tokens=8))


@rl.function
def adder(s, question):
    s += rl.tools(TOOLS)
    s += rl.user(question)
    s += rl.assistant(rl.gen("call", max_tokens=80, tool_choice=ADD, parallel_tool_calls=False))


class TemplatedRuntime(rl.Runtime):
    """A Runtime whose programs render through another chat template (a copy of the tokenizer)."""

    def __init__(self, engine, chat_template: str):
        super().__init__(engine=engine)
        self._templated = copy.copy(engine.tokenizer)
        self._templated.chat_template = chat_template

    @property
    def tokenizer(self):
        return self._templated


def test_a_forced_call_from_the_dsl_parses_and_validates(real_engine):
    runtime = rl.Runtime(engine=real_engine)
    try:
        state = weather_agent.run(question=ASK[1]["content"], backend=runtime, temperature=0)
        (call,) = state.tool_calls("call")
        jsonschema.validate(call.parsed, SCHEMAS[call.name])
        assert state.get_meta_info("call")["tool_calls"] == [call] and state["answer"]
        # the program's prompt is the one Engine.chat builds: the same fallback rendering of the tools
        spec = checked_tools(TOOLS, compile=False)
        built = real_engine.build_prompt(real_engine.prompts.chat_prompt(ASK, spec))
        assert state.text().startswith(real_engine.tokenizer.decode(built.token_ids) + state["call"])
        named = adder.run(question="Add 12 and 30.", backend=runtime, temperature=0)
        (call,) = named.tool_calls("call")
        assert call.name == "add"
        jsonschema.validate(call.parsed, ADD_SCHEMA)
    finally:
        runtime.shutdown()
    real_engine.check_integrity()


def test_the_dsl_under_a_template_that_knows_tools(real_engine):
    """hermes (Qwen 2.5's template): the template renders the tools itself."""
    runtime = TemplatedRuntime(real_engine, template("hermes"))
    try:
        state = adder.run(question="Add 12 and 30.", backend=runtime, temperature=0)
        assert state.error() is None
        (call,) = state.tool_calls("call")
        assert call.name == "add"
        jsonschema.validate(call.parsed, ADD_SCHEMA)
        assert '"name": "add"' in state.text().split("<|im_start|>user")[0]  # the tools, in the template's system turn
        rendered = runtime.tokenizer.apply_chat_template(state.messages(), tokenize=False, tools=TOOLS)
        assert state.text() == rendered  # the template's own rendering of the messages and tools
    finally:
        runtime.shutdown()


def test_dsl_refusals():
    with pytest.raises(ValueError):
        rl.gen("x", tool_choice="sometimes")
    with pytest.raises(ValueError):
        rl.gen("x", tool_choice="required", regex="a+")
    with pytest.raises(ValueError):
        rl.gen("x", parallel_tool_calls=False)
    with pytest.raises(InvalidRequest):
        rl.tools([{"type": "function", "function": {"name": "has space"}}])
