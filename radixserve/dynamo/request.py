"""Dynamo's preprocessed request (token ids in; the frontend has templated and tokenized the
prompt) mapped onto the engine's: sampling options, stop conditions, the tenant (nvext's
cache_salt), the session and agent hints. What the engine cannot honour is refused with a
ValueError naming the field, never dropped (plain Python over the request's dict)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from radixserve.core.agent_hints import AgentHints
from radixserve.sampling_params import SamplingParams

# vLLM's cache salts come from Dynamo tagged so (dynamo/vllm/handlers.py): the KV router reads
# a namespace from a first block's extra_keys only with this prefix.
CACHE_SALT_PREFIX = "dynamo-cache-salt:"
SAMPLING = {"temperature", "top_p", "top_k", "min_p", "seed", "frequency_penalty", "presence_penalty",
            "repetition_penalty"}
STOPS = {"max_tokens": "max_tokens", "min_tokens": "min_tokens", "ignore_eos": "ignore_eos"}
STOP_IDS = ("stop_token_ids", "stop_token_ids_hidden", "stop_token_ids_visible")
HINTS = {"priority": "priority", "latency_sensitivity": "latency_sensitivity_s", "osl": "osl", "ttl_s": "ttl_s",
         "speculative_prefill": "speculative_prefill", "release": "release"}


@dataclass
class EngineRequest:
    token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None
    session_id: str | None
    hints: AgentHints | None


def _nvext(request: dict) -> dict:
    extra = request.get("extra_args") or {}
    nvext = request.get("nvext") or (extra.get("nvext") if isinstance(extra, dict) else None) or {}
    if not isinstance(nvext, dict):
        raise ValueError("nvext must be an object")
    return nvext


def _set(values: dict, name: str, value: Any) -> None:
    if value is not None:
        values[name] = value


def sampling_params(request: dict) -> SamplingParams:
    values: dict[str, Any] = {"skip_special_tokens": False}  # the frontend detokenizes
    sampling = request.get("sampling_options") or {}
    for key, value in sampling.items():
        if value is None:
            continue
        if key in SAMPLING:
            values[key] = value
        elif key == "include_stop_str_in_output":
            values[key] = bool(value)
        elif key == "n" and value == 1 or key == "use_beam_search" and value is False:
            continue
        elif key == "guided_decoding":
            values.update(_guided(value))
        else:
            raise ValueError(f"sampling_options.{key}={value!r} is not supported by radixserve's Dynamo worker")
    stops = request.get("stop_conditions") or {}
    for key, value in stops.items():
        if value is None:
            continue
        if key in STOP_IDS:
            values["stop_token_ids"] = sorted(set(values.get("stop_token_ids", [])) | set(value))
        elif key in STOPS:
            _set(values, STOPS[key], value)
        elif key == "stop":
            values["stop"] = value  # stop strings: the frontend also stops on them, the engine ends sooner
        else:
            raise ValueError(f"stop_conditions.{key}={value!r} is not supported by radixserve's Dynamo worker")
    eos = request.get("eos_token_ids") or []
    if eos and not values.get("ignore_eos"):
        values["stop_token_ids"] = sorted(set(values.get("stop_token_ids", [])) | set(eos))
    output = request.get("output_options") or {}
    _set(values, "logprobs", output.get("logprobs"))
    if output.get("prompt_logprobs") is not None:
        raise ValueError("output_options.prompt_logprobs is not supported by radixserve's Dynamo worker")
    return SamplingParams(**values)


def _guided(guided: dict) -> dict:
    if not isinstance(guided, dict):
        raise ValueError("sampling_options.guided_decoding must be an object")
    given = {k: v for k, v in guided.items() if v is not None and k not in ("backend", "whitespace_pattern")}
    if len(given) > 1:
        raise ValueError(f"sampling_options.guided_decoding: give one constraint, got {sorted(given)}")
    for key, value in given.items():
        if key == "json":
            return {"json_schema": value}
        if key in ("regex", "choice"):
            return {"regex": value} if key == "regex" else {"choices": value}
        if key == "structural_tag":
            return {"structural_tag": value}
        raise ValueError(f"sampling_options.guided_decoding.{key} is not supported by radixserve's Dynamo worker")
    return {}


def agent_hints(nvext: dict) -> AgentHints | None:
    hints = nvext.get("agent_hints")
    if hints is None:
        return None
    if not isinstance(hints, dict):
        raise ValueError("nvext.agent_hints must be an object")
    unknown = sorted(set(hints) - set(HINTS))
    if unknown:
        raise ValueError(f"nvext.agent_hints: unknown {', '.join(unknown)}")
    return AgentHints(**{HINTS[k]: v for k, v in hints.items() if v is not None})


def session_of(request: dict) -> str | None:
    """The agent session: Dynamo's agent context, which its frontend fills from the
    x-session-id / x-dynamo-session-id headers."""
    context = request.get("agent_context")
    value = context.get("session_id") if isinstance(context, dict) else None
    return value.strip() or None if isinstance(value, str) else None


def engine_request(request: dict) -> EngineRequest:
    token_ids = request.get("token_ids")
    if not isinstance(token_ids, list) or not token_ids:
        raise ValueError("token_ids must be a non-empty list")
    if request.get("multi_modal_data") or request.get("mm_processor_kwargs"):
        raise ValueError("multimodal inputs are not supported by radixserve's Dynamo worker")
    if request.get("lora_name"):
        raise ValueError("LoRA adapters are not supported by radixserve's Dynamo worker")
    nvext = _nvext(request)
    salt = nvext.get("cache_salt")
    return EngineRequest(list(token_ids), sampling_params(request), f"{CACHE_SALT_PREFIX}{salt}" if salt else None,
                         session_of(request), agent_hints(nvext))
