"""Constrained decoding on the real model: outputs always match their regex or schema."""

from __future__ import annotations

import json
import re
import time

import jsonschema
import pytest

from radixserve import Engine, SamplingParams
from radixserve.execution.constrained import GrammarFactory, GrammarLimits

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
        if schema == {"type": "object"} and sampling.get("temperature") and out.finish_reason == "length":
            assert out.text.startswith("{"), out.text  # any object: sampled, it may nest past max_tokens
            continue
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


def _enum(values: int, prefix: str = "v") -> dict:
    return {"type": "object", "properties": {"pick": {"enum": [f"{prefix}{i}" for i in range(values)]}},
            "required": ["pick"]}


def _nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"k": schema}, "required": ["k"]}
    return schema


@pytest.mark.serial  # each refusal within 2 s
@pytest.mark.parametrize(
    "params, message",
    [
        (dict(json_schema=_enum(50_000)), "json schema has .* characters; the limit is 65536"),
        (dict(json_schema=_enum(3000)), "3000 enum/const values; the limit is 2048"),
        (dict(json_schema=_nested(40)), "nests deeper than 64 levels"),
        (dict(regex="a" * 5000), "regex has 5000 characters; the limit is 4096"),
        (dict(choices=[f"c{i}" for i in range(3000)]), "choices has 3000 entries; the limit is 2048"),
    ],
)
def test_too_large_constraints_are_refused_before_compiling(real_engine, prompt, params, message):
    start = time.monotonic()
    with pytest.raises(ValueError, match=message):
        real_engine.prepare(prompt, SamplingParams(**params))
    assert time.monotonic() - start < 2.0
    real_engine.check_integrity()


@pytest.mark.serial
def test_a_slow_grammar_is_refused_at_the_compile_time_limit(real_engine):
    factory = GrammarFactory(real_engine.tokenizer, real_engine.loaded.spec.vocab_size, real_engine.eos_token_ids,
                             GrammarLimits(compile_timeout_s=0.05))
    assert factory.matcher(SamplingParams(regex="(yes|no)")) is not None  # builds the compiler
    start = time.monotonic()
    with pytest.raises(ValueError, match="did not compile within 0.05 s"):
        factory.matcher(SamplingParams(regex="." * 400))  # about 2 s to compile
    assert time.monotonic() - start < 1.0
    factory.limits = GrammarLimits(compile_timeout_s=120)
    assert factory.matcher(SamplingParams(regex="(yes|no|maybe)")) is not None  # still works, after the orphan


@pytest.mark.serial
def test_the_compiled_grammar_cache_is_bounded(real_engine):
    limit = 1 << 20
    factory = GrammarFactory(real_engine.tokenizer, real_engine.loaded.spec.vocab_size, real_engine.eos_token_ids,
                             GrammarLimits(cache_limit_bytes=limit))
    sizes = []
    for i in range(40):  # distinct schemas of roughly 100 KB compiled grammar each
        factory.matcher(SamplingParams(json_schema=_enum(300, prefix=f"s{i}-")))
        sizes.append(factory.cache_size_bytes())
    assert max(sizes) > limit // 4  # it does cache
    assert max(sizes) <= limit * 1.25


def test_a_prompt_that_cannot_fit_is_refused_without_tokenizing(real_engine, monkeypatch):
    preparer = real_engine.preparer
    assert preparer.max_prompt_chars == 81 * real_engine.max_model_len  # SmolLM2: longest token, 81 chars

    def no_tokenizing(*args, **kwargs):
        raise AssertionError("tokenized a prompt that cannot fit")

    monkeypatch.setattr(real_engine.tokenizer, "encode", no_tokenizing)
    start = time.monotonic()
    with pytest.raises(ValueError, match="characters, more than the 663552 that can fit"):
        real_engine.prepare("x" * 25_000_000)
    assert time.monotonic() - start < 1.0
