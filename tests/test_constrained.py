"""Constrained decoding on the real model: outputs always match their regex or schema."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from radixserve import Engine, SamplingParams

pytestmark = pytest.mark.real_model

REGEXES = [
    r"\(\d{3}\) \d{3}-\d{4}",
    r"(yes|no), because [a-z ]{5,40}\.",
    r"[A-Z][a-z]{1,12} [A-Z][a-z]{1,12}",
    r"\d{1,6}(\.\d{1,4})?",
]
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 150}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                      "tags": {"type": "array", "items": {"enum": ["warm", "cold", "wet"]},
                                               "maxItems": 3}},
     "required": ["city", "tags"], "additionalProperties": False},
]
SAMPLING = [dict(temperature=0.0), dict(temperature=1.0, seed=7), dict(temperature=0.7, top_p=0.9, seed=11)]


@pytest.fixture(scope="module")
def prompt(real_engine):
    return real_engine.apply_chat_template([{"role": "user", "content": "Tell me about someone you know."}])


@pytest.mark.parametrize("sampling", SAMPLING, ids=["greedy", "t1", "t0.7-top-p"])
def test_regex_outputs_fully_match(real_engine, prompt, sampling):
    params = [SamplingParams(max_tokens=64, regex=r, **sampling) for r in REGEXES]
    outs = real_engine.generate([prompt] * len(REGEXES), params)
    for regex, out in zip(REGEXES, outs):
        assert out.finish_reason == "stop", (regex, out.text)
        assert re.fullmatch(regex, out.text), (regex, out.text)


@pytest.mark.parametrize("sampling", SAMPLING, ids=["greedy", "t1", "t0.7-top-p"])
def test_json_schema_outputs_validate(real_engine, prompt, sampling):
    params = [SamplingParams(max_tokens=96, json_schema=s, **sampling) for s in SCHEMAS]
    params.append(SamplingParams(max_tokens=96, json_object=True, **sampling))
    outs = real_engine.generate([prompt] * len(params), params)
    for schema, out in zip(SCHEMAS + [{"type": "object"}], outs):
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), schema)


def test_choices_pick_one_of_them(real_engine, prompt):
    choices = ["billing", "technical support", "sales"]
    for sampling in SAMPLING:
        out = real_engine.generate([prompt], SamplingParams(max_tokens=10, choices=choices, **sampling))[0]
        assert out.text in choices


def test_constraints_survive_preemption(real_model_dir, prompt):
    engine = Engine(str(real_model_dir), num_kv_blocks=16, enable_prefix_cache=False)
    regexes = REGEXES * 2
    params = [SamplingParams(max_tokens=64, regex=r, temperature=0.0) for r in regexes]
    outs = engine.generate([prompt] * len(regexes), params)
    assert engine.stats()["preemptions"] > 0
    for regex, out in zip(regexes, outs):
        assert re.fullmatch(regex, out.text), (regex, out.text)
    engine.check_integrity()


@pytest.mark.parametrize(
    "params, message",
    [
        (dict(regex="[unclosed"), "invalid regex"),
        (dict(json_schema={"type": "nonsense"}), "invalid json schema"),
        (dict(json_schema="{not json"), "invalid json schema"),
        (dict(regex="a", choices=["b"]), "at most one of"),
        (dict(choices=[]), "non-empty list"),
    ],
)
def test_invalid_constraints_are_value_errors(real_engine, prompt, params, message):
    with pytest.raises(ValueError, match=message):
        real_engine.add_request(prompt, SamplingParams(**params))
    real_engine.check_integrity()
    assert not real_engine.has_unfinished_requests()
