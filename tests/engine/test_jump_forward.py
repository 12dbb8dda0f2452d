"""Jump-forward on the real default model: the text a grammar forces is drafted as the
tokenizer writes it and verified under the grammar's masks in one step. Greedy output is the
same token for token as stepping through it (tool calls, a JSON schema), in far fewer steps."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from radixserve import Engine, SamplingParams
from radixserve.core.prompt_lookup import MAX_FORCED_TOKENS
from radixserve.execution.constrained import apply_draft_masks, apply_grammar_masks, grammar_prefix
from tool_fixtures import SCHEMAS, TOOLS

pytestmark = pytest.mark.real_model

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                           "city": {"enum": ["Paris", "London", "Tokyo"]}},
          "required": ["name", "age", "city"], "additionalProperties": False}
ASKS = [[{"role": "user", "content": q}] for q in (
    "What is the weather in Paris? Use celsius.", "Add 12 and 30.",
    "What's the weather like in Tokyo in fahrenheit?", "Please add 7 and 8 for me.")]
GREEDY = SamplingParams(max_tokens=200, temperature=0.0)


@pytest.fixture(scope="module")
def stepping(real_model_dir):
    """The same model with jump-forward off: every forced token takes its own step."""
    return Engine(str(real_model_dir), jump_forward=False)


def _matcher(engine: Engine, schema: dict):
    return engine.grammars.matcher(SamplingParams(json_schema=schema))


def test_forced_draft_is_the_forced_text_as_the_tokenizer_writes_it(real_engine):
    matcher = _matcher(real_engine, PERSON)
    draft = real_engine.grammars.forced_draft(matcher, MAX_FORCED_TOKENS)
    assert real_engine.tokenizer.decode(draft) == '{"name": "'
    assert draft == real_engine.tokenizer.encode('{"name": "', add_special_tokens=False)
    assert matcher.find_jump_forward_string() == '{"name": "'  # the matcher is where it was
    assert real_engine.grammars.forced_draft(matcher, 1) == draft[:1]
    for token in draft + real_engine.tokenizer.encode("Al", add_special_tokens=False):
        assert matcher.accept_token(token)
    assert real_engine.grammars.forced_draft(matcher, 8) == []  # free text: nothing forced
    # after '{"name": "Al", "age": 3, "city": "' the grammar takes "London", then no "Madrid"
    for token in real_engine.tokenizer.encode('", "age": 3, "city": "', add_special_tokens=False):
        assert matcher.accept_token(token)
    london, madrid = (real_engine.tokenizer.encode(t, add_special_tokens=False) for t in ("London", "Madrid"))
    assert grammar_prefix(matcher, london + madrid) == london
    assert grammar_prefix(matcher, madrid + london) == []
    assert grammar_prefix(matcher, london) == london  # each call left the matcher where it was


def test_each_verification_row_is_masked_by_the_grammar_after_the_draft_before_it(real_engine):
    matcher = _matcher(real_engine, PERSON)
    draft = real_engine.grammars.forced_draft(matcher, MAX_FORCED_TOKENS)
    vocab = real_engine.loaded.spec.vocab_size
    logits = torch.zeros(2 + len(draft) + 1, vocab)
    apply_draft_masks(logits, [(2, matcher, draft)])
    assert bool((logits[:2] == 0).all())  # rows of other requests untouched
    for j in range(len(draft) + 1):
        allowed = set((logits[2 + j] == 0).nonzero().flatten().tolist())
        fresh = _matcher(real_engine, PERSON)  # its own matcher, stepped through draft[:j]
        assert all(fresh.accept_token(t) for t in draft[:j])
        expected = torch.zeros(1, vocab)
        apply_grammar_masks(expected, [(0, fresh)])
        assert allowed == set((expected[0] == 0).nonzero().flatten().tolist())
        if j < len(draft):
            assert draft[j] in allowed and len(allowed) < 100  # forced text: its few spellings
        else:
            assert len(allowed) > 1000  # the name's free text
    assert matcher.find_jump_forward_string() == '{"name": "'  # rolled back


def test_greedy_tool_calls_and_json_are_identical_in_at_most_0_6x_the_steps(real_engine, stepping):
    outputs, steps = {}, {}
    for label, engine in (("jump", real_engine), ("step", stepping)):
        before = engine.scheduler.stats.steps
        calls = [engine.chat(a, GREEDY, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)[0]
                 for a in ASKS]
        steps[label] = engine.scheduler.stats.steps - before
        people = engine.generate(["Describe a person as JSON: ", "A user record: "],
                                 SamplingParams(max_tokens=80, temperature=0.0, json_schema=PERSON))
        outputs[label] = [o.token_ids for o in calls + people]
        for out in calls:
            (call,) = out.tool_calls
            jsonschema.validate(call.parsed, SCHEMAS[call.name])
        for out in people:
            jsonschema.validate(json.loads(out.text), PERSON)
    assert outputs["jump"] == outputs["step"]
    tokens = sum(len(t) for t in outputs["step"][:len(ASKS)])
    assert steps["step"] >= tokens  # one step a token (and each prompt's)
    assert steps["jump"] <= 0.6 * steps["step"], steps


def test_sampled_constrained_output_still_matches_under_jump_forward(real_engine):
    before = real_engine.drafter.stats.forced_drafts
    outs = real_engine.generate(["Describe a person as JSON: "] * 3,
                                SamplingParams(max_tokens=80, temperature=1.0, json_schema=PERSON))
    for out in outs:
        jsonschema.validate(json.loads(out.text), PERSON)
        assert out.finish_reason == "stop"
    assert real_engine.drafter.stats.forced_drafts >= before + 3 * 3  # '{"name": "', the age key, the city


def test_logprobs_requests_step_through_their_forced_text(real_engine):
    before = real_engine.drafter.stats.forced_drafts
    (out,) = real_engine.generate(["A user record: "], SamplingParams(max_tokens=80, temperature=0.0,
                                                                       json_schema=PERSON, logprobs=1))
    jsonschema.validate(json.loads(out.text), PERSON)
    assert len(out.logprobs) == len(out.token_ids)
    assert real_engine.drafter.stats.forced_drafts == before
