"""Dynamo's preprocessed request mapped onto the engine's (radixserve/dynamo/request.py):
every field that reaches the engine, and what it cannot honour refused by name. The request
dicts are shaped as Dynamo 1.6.1's frontend sends them (all keys present, nulls included)."""

from __future__ import annotations

import pytest

from radixserve.core.agent_hints import AgentHints
from radixserve.dynamo.request import engine_request


def dynamo_request(**overrides) -> dict:
    request = {
        "model": "m", "token_ids": [504, 3575, 282],
        "stop_conditions": {"max_tokens": 8, "stop": None, "stop_token_ids": None, "stop_token_ids_visible": None,
                            "stop_token_ids_hidden": [2], "min_tokens": None, "ignore_eos": None,
                            "max_thinking_tokens": None},
        "sampling_options": {"n": 1, "best_of": None, "presence_penalty": None, "frequency_penalty": None,
                             "repetition_penalty": None, "temperature": 0.0, "top_p": None, "top_k": None,
                             "min_p": None, "use_beam_search": None, "length_penalty": None, "seed": None,
                             "include_stop_str_in_output": None, "guided_decoding": None},
        "output_options": {"logprobs": None, "prompt_logprobs": None, "skip_special_tokens": None,
                           "formatted_prompt": None, "return_tokens_as_token_ids": None},
        "eos_token_ids": [2], "annotations": [], "routing": {"dp_rank": 0}, "router_config_override": None,
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(request.get(key), dict):
            request[key] = {**request[key], **value}
        else:
            request[key] = value
    return request


def test_a_plain_request_reaches_the_engine_as_sent():
    wanted = engine_request(dynamo_request())
    assert wanted.token_ids == [504, 3575, 282]
    p = wanted.params
    assert (p.max_tokens, p.temperature, p.stop_token_ids, p.skip_special_tokens) == (8, 0.0, [2], False)
    assert (wanted.cache_salt, wanted.session_id, wanted.hints) == (None, None, None)


def test_sampling_stops_tenant_session_and_hints_reach_the_engine():
    wanted = engine_request(dynamo_request(
        sampling_options={"temperature": 0.7, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "seed": 7,
                          "frequency_penalty": 0.5, "presence_penalty": 0.25, "repetition_penalty": 1.1},
        stop_conditions={"stop": ["\n\n"], "min_tokens": 2, "stop_token_ids": [9], "ignore_eos": True},
        output_options={"logprobs": 2},
        extra_args={"nvext": {"cache_salt": "tenant-a", "agent_hints": {"priority": 5, "osl": 64, "ttl_s": 30}}},
        agent_context={"session_id": "conv-1"},
    ))
    p = wanted.params
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (0.7, 0.9, 40, 0.05, 7)
    assert (p.frequency_penalty, p.presence_penalty, p.repetition_penalty) == (0.5, 0.25, 1.1)
    assert (p.stop, p.min_tokens, p.ignore_eos, p.logprobs) == (["\n\n"], 2, True, 2)
    assert p.stop_token_ids == [2, 9]  # hidden and given ids; eos is not added when ignore_eos
    assert wanted.cache_salt == "dynamo-cache-salt:tenant-a" and wanted.session_id == "conv-1"
    assert wanted.hints == AgentHints(priority=5, osl=64, ttl_s=30)


def test_guided_decoding_becomes_the_engines_constraint():
    schema = {"type": "object"}
    assert engine_request(dynamo_request(sampling_options={"guided_decoding": {"json": schema}})).params.json_schema \
        == schema
    assert engine_request(dynamo_request(sampling_options={"guided_decoding": {"regex": "a+", "backend": None}})
                          ).params.regex == "a+"
    assert engine_request(dynamo_request(sampling_options={"guided_decoding": {"choice": ["x", "y"]}})
                          ).params.choices == ["x", "y"]


@pytest.mark.parametrize("overrides, field", [
    ({"sampling_options": {"n": 2}}, "sampling_options.n"),
    ({"sampling_options": {"use_beam_search": True}}, "sampling_options.use_beam_search"),
    ({"sampling_options": {"length_penalty": 0.5}}, "sampling_options.length_penalty"),
    ({"sampling_options": {"guided_decoding": {"grammar": "root ::= \"a\""}}}, "guided_decoding.grammar"),
    ({"output_options": {"prompt_logprobs": 1}}, "prompt_logprobs"),
    ({"stop_conditions": {"max_thinking_tokens": 16}}, "stop_conditions.max_thinking_tokens"),
    ({"multi_modal_data": {"image_url": ["x"]}}, "multimodal"),
    ({"lora_name": "adapter"}, "LoRA"),
    ({"token_ids": []}, "token_ids"),
    ({"extra_args": {"nvext": {"agent_hints": {"priority": 5000}}}}, "priority"),
    ({"extra_args": {"nvext": {"agent_hints": {"colour": 1}}}}, "unknown colour"),
])
def test_what_the_engine_cannot_honour_is_refused_by_name(overrides, field):
    with pytest.raises(ValueError, match=field):
        engine_request(dynamo_request(**overrides))
