"""The request models without a server: defaults, error wording, the JSON reader's rules."""

from __future__ import annotations

import json

import pytest

from radixserve import SamplingParams
from radixserve.server.errors import APIError
from radixserve.server.openapi import OPERATIONS, openapi_schema
from radixserve.server.protocol import (
    ChatCompletionRequest, CompletionRequest, GenerateRequest, GenerateSamplingParams, ServedModel, parse,
)
from radixserve.server.protocol.body import _number, _refuse_lone_surrogates

SERVED = ServedModel(("m",), max_n=4, max_prompts=8, max_group=6, vocab_size=100)


def error_of(model, body) -> APIError:
    with pytest.raises(APIError) as caught:
        parse(model, body).to_job(SERVED)
    return caught.value


def test_generate_defaults_are_sampling_params_defaults():
    assert GenerateSamplingParams().to_sampling_params() == SamplingParams()
    job = parse(GenerateRequest, {"text": "a"}).to_job(SERVED)
    assert job.params == SamplingParams() and not job.batched and job.prompts == ["a"]


def test_openai_bodies_become_jobs():
    job = parse(CompletionRequest, {"model": "m", "prompt": [[1, 2], [3]], "n": 2, "seed": 5, "stop": "x",
                                    "temperature": 0, "user": "ignored", "service_tier": "ignored"}).to_job(SERVED)
    assert job.prompts == [[1, 2], [3]] and [p.seed for p in job.params] == [5, 6]
    assert job.params[0].stop == ["x"] and job.params[0].temperature == 0.0
    chat = parse(ChatCompletionRequest, {"model": "m", "n": None, "messages": [
        {"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None}]}).to_job(SERVED)
    assert chat.n == 1 and chat.prompts[0].messages == ({"role": "system", "content": "ab"},
                                                        {"role": "assistant", "content": ""})


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("model,extra", [
    (ChatCompletionRequest, {"temprature": 0}),  # a misspelt sampling field would sample at 1.0
    (ChatCompletionRequest, {"audio": {"voice": "alloy", "format": "wav"}}),
    (ChatCompletionRequest, {"guided_grammar": "root ::= \"a\""}),
    (CompletionRequest, {"prompt": "a", "use_beam_search": True}),
])
def test_a_field_the_server_does_not_know_is_refused_not_dropped(model, extra):
    body = {**CHAT, **extra} if model is ChatCompletionRequest else {"model": "m", **extra}
    error = error_of(model, body)
    name = next(k for k in extra if k != "prompt")
    assert error.status == 400 and error.param == name and f"unknown field(s): {name}" in error.message


def test_fields_that_cannot_change_the_answer_are_accepted():
    job = parse(ChatCompletionRequest, {
        **CHAT, "service_tier": "auto", "prompt_cache_key": "k", "safety_identifier": "u1", "store": False,
        "prediction": {"type": "content", "content": "hello"}, "modalities": ["text"], "audio": None,
        "messages": [{"role": "assistant", "content": "x", "refusal": None, "annotations": []},  # echoed back
                     {"role": "user", "content": "y"}],
    }).to_job(SERVED)
    assert job.params[0] == parse(ChatCompletionRequest, CHAT).to_job(SERVED).params[0]
    assert error_of(ChatCompletionRequest, {**CHAT, "modalities": ["text", "audio"]}).param == "modalities[1]"


def test_vllm_guided_fields_are_the_constraints_they_name():
    def params(**extra):
        return parse(ChatCompletionRequest, {**CHAT, **extra}).to_job(SERVED).params[0]

    assert params(guided_json={"type": "object"}).json_schema == {"type": "object"}
    assert params(guided_regex="a+").regex == "a+"
    assert params(guided_choice=["yes", "no"]).choices == ["yes", "no"]
    assert params(stop_regex="[.!?]").stop_regex == ["[.!?]"]
    for clash in ({"guided_regex": "a", "regex": "b"}, {"guided_json": {}, "guided_choice": ["a"]},
                  {"guided_json": {}, "response_format": {"type": "json_object"}}):
        error = error_of(ChatCompletionRequest, {**CHAT, **clash})
        assert error.status == 400 and error.param.startswith("guided_") and "cannot be combined" in error.message


@pytest.mark.parametrize("model,body,param,message", [
    (CompletionRequest, [1], None, "request body must be a JSON object, got array"),
    (CompletionRequest, {"prompt": "a"}, "model", "'model' is required"),
    (CompletionRequest, {"model": "m", "prompt": "a", "max_tokens": True}, "max_tokens",
     "'max_tokens' must be an integer, got boolean true"),
    (CompletionRequest, {"model": "m", "prompt": "a", "max_tokens": "3"}, "max_tokens", "must be an integer"),
    (CompletionRequest, {"model": "m", "prompt": "a", "n": 5}, "n", "'n' must be <= 4"),
    (CompletionRequest, {"model": "m", "prompt": ["a", "b", "c", "d"], "n": 2}, "n", "queues at most 6"),
    (CompletionRequest, {"model": "m", "prompt": "a", "stop_token_ids": [100]}, "stop_token_ids", "vocabulary"),
    (CompletionRequest, {"model": "m", "prompt": "a", "seed": 2**64 - 1, "n": 2}, "seed", "seed + i"),
    (CompletionRequest, {"model": "x", "prompt": "a"}, "model", "does not exist"),
    (ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": 3}]}, "messages[0].content",
     "must be a string or a list of text parts"),
    (GenerateRequest, {"text": "a", "sampling_params": {"top_p": 0}}, "sampling_params.top_p", "must be > 0.0"),
    (GenerateRequest, {"text": "a", "extra": 1, "also": 2}, "also", "unknown field(s): also, extra"),
    (GenerateRequest, {"input_ids": [[1], []]}, "input_ids", "non-empty list of token ids"),
])
def test_errors_name_the_field(model, body, param, message):
    error = error_of(model, body)
    assert error.status in (400, 404) and error.param == param and message in error.message


def test_json_numbers_and_surrogates():
    assert json.loads("[3.0, 2.5, 1e3]", parse_float=_number) == [3, 2.5, 1000]
    assert isinstance(json.loads("3.0", parse_float=_number), int)
    _refuse_lone_surrogates({"a": ["fine \U0001F600", {"b": "ok"}]})
    with pytest.raises(APIError) as caught:
        _refuse_lone_surrogates(json.loads('{"a": [{"b": "x\\udc00"}]}'))
    assert caught.value.param == "a[0].b" and "surrogate" in caught.value.message


def test_openapi_covers_the_routes_given():
    routes = {path: {op.method.upper()} for path, op in OPERATIONS.items()} | {"/new": {"POST", "HEAD"}}
    schema = openapi_schema(routes, auth=True)
    assert set(schema["paths"]) == set(routes)
    assert schema["paths"]["/new"]["post"]["responses"]["400"]
    assert schema["paths"]["/v1/completions"]["post"]["security"] == [{"bearer": []}, {"apiKey": []}]  # or x-api-key
    messages = schema["paths"]["/v1/messages"]["post"]["responses"]
    assert messages["529"]["content"]["application/json"]["schema"]["$ref"].endswith("/AnthropicErrorResponse")
    assert "503" not in messages
    assert "security" not in schema["paths"]["/health"]["get"]
    props = schema["components"]["schemas"]["GenerateSamplingParams"]["properties"]
    assert props["top_p"]["exclusiveMinimum"] == 0.0 and props["top_p"]["maximum"] == 1.0


@pytest.mark.parametrize("extra,param", [
    ({"conversation": "conv_1"}, "conversation"), ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"include": ["message.output_text.logprobs"]}, "include[0]"), ({"top_logprobs": 2}, "top_logprobs"),
    ({"truncation": "auto"}, "truncation"), ({"reasoning": {"summary": "detailed"}}, "reasoning.summary"),
    ({"text": {"verbosity": "low"}}, "text.verbosity"),
])
def test_responses_fields_that_would_change_the_answer_are_refused(extra, param):
    from radixserve.server.protocol.responses import ResponsesRequest

    with pytest.raises(APIError) as caught:
        parse(ResponsesRequest, {"model": "m", "input": "x", **extra}).check_supported()
    assert caught.value.status == 400 and caught.value.param == param


def test_responses_fields_without_effect_here_are_accepted():
    from radixserve.server.protocol.responses import ResponsesRequest

    body = {"model": "m", "input": "x", "include": ["reasoning.encrypted_content"], "truncation": "disabled",
            "top_logprobs": 0, "reasoning": {"effort": None}, "max_tool_calls": 4, "prompt_cache_key": "k",
            "service_tier": "auto", "stream_options": {"include_obfuscation": False}, "text": {"verbosity": "medium"}}
    parse(ResponsesRequest, body).check_supported()
