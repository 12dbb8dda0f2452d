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
