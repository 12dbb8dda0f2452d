"""Parsing of /v1/completions and /v1/chat/completions bodies into a GenerationJob.

Every mistake in the body is an APIError (400, or 404 for an unknown model) naming the
field; nothing reaches the engine until the whole body checked out. Fields the OpenAI
API has but this server does not implement are refused when they would change the
answer (tools, logit_bias, suffix, json response formats) and ignored when they would
not (store, metadata, user, service_tier...).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from radixserve.sampling_params import MAX_LOGPROBS, SamplingParams
from radixserve.server.errors import APIError, bad_request
from radixserve.server.fields import Fields
from radixserve.server.request_group import ChatPrompt, GenerationInput

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_CHOICES = 64
MAX_STOP_STRINGS = 16

Prompt = str | list[int] | ChatPrompt


@dataclass(frozen=True)
class ServedModel:
    """What the server answers to in the `model` field, and its request limits."""

    names: tuple[str, ...]  # the first is the name responses carry
    max_n: int
    max_prompts: int

    def check(self, fields: Fields) -> str:
        model = fields.string("model", required=True)
        if model not in self.names:
            raise APIError(
                404,
                f"the model '{model}' does not exist; this server serves '{self.names[0]}'",
                param="model",
                code="model_not_found",
            )
        return self.names[0]


@dataclass(frozen=True)
class GenerationJob:
    """A parsed OpenAI request: every prompt sampled n times. Member m (the engine request
    and the response's choice index) is sample m % n of prompt m // n."""

    model: str
    prompts: list[Prompt]
    params: list[SamplingParams]  # one per sample index; sample i has seed + i when seeded
    n: int
    stream: bool
    include_usage: bool
    echo: bool = False
    logprobs: int | None = None  # alternatives per token (0: the chosen token only); None: off
    cache_salt: str | None = None

    def inputs(self) -> list[GenerationInput]:
        return [
            GenerationInput(prompt, self.params[i], self.cache_salt) for prompt in self.prompts for i in range(self.n)
        ]


def parse_completion_request(body: Any, served: ServedModel) -> GenerationJob:
    """Body of POST /v1/completions."""
    fields = Fields(body)
    model = served.check(fields)
    prompts = _completion_prompts(fields.raw("prompt", required=True), served.max_prompts)
    if fields.string("suffix"):
        raise bad_request("'suffix' is not supported", param="suffix")
    if fields.raw("logit_bias"):
        raise bad_request("'logit_bias' is not supported", param="logit_bias")
    _check_ignored(fields)
    logprobs = fields.integer("logprobs", minimum=0, maximum=MAX_LOGPROBS)
    echo = fields.boolean("echo")
    n = _n(fields, served.max_n)
    best_of = fields.integer("best_of", minimum=1)
    if best_of is not None and best_of != n:
        raise bad_request("'best_of' other than n is not supported", param="best_of")
    max_tokens = fields.integer("max_tokens", minimum=1)
    params = _sampling_params(fields, max_tokens, logprobs)
    if echo and logprobs is not None:
        params = replace(params, prompt_logprobs=logprobs)
    stream, include_usage = _stream(fields)
    return GenerationJob(
        model, prompts, _seeded(params, n), n, stream, include_usage, echo, logprobs, _cache_salt(fields)
    )


def parse_chat_request(body: Any, served: ServedModel) -> GenerationJob:
    """Body of POST /v1/chat/completions."""
    fields = Fields(body)
    model = served.check(fields)
    prompt = ChatPrompt(_messages(fields.raw("messages", required=True)))
    _refuse_unsupported_chat_fields(fields)
    _check_ignored(fields)
    logprobs = _chat_logprobs(fields)
    n = _n(fields, served.max_n)
    max_tokens = fields.integer("max_completion_tokens", minimum=1)
    if max_tokens is None:
        max_tokens = fields.integer("max_tokens", minimum=1)
    params = _sampling_params(fields, max_tokens, logprobs, **_response_format(fields))
    stream, include_usage = _stream(fields)
    return GenerationJob(
        model, [prompt], _seeded(params, n), n, stream, include_usage, False, logprobs, _cache_salt(fields)
    )


# ---- prompts and messages --------------------------------------------------------------


def _completion_prompts(value: Any, max_prompts: int) -> list[Prompt]:
    if isinstance(value, str):
        prompts: list[Prompt] = [value]
    elif isinstance(value, list) and value and all(_is_token(t) for t in value):
        prompts = [list(value)]
    elif isinstance(value, list) and value and all(isinstance(p, str) for p in value):
        prompts = list(value)
    elif isinstance(value, list) and value and all(_is_token_list(p) for p in value):
        prompts = [list(p) for p in value]
    elif isinstance(value, list) and not value:
        raise bad_request("'prompt' is empty", param="prompt")
    else:
        raise bad_request(
            "'prompt' must be a string, a list of strings, a list of token ids, or a list of token-id lists",
            param="prompt",
        )
    if len(prompts) > max_prompts:
        raise bad_request(f"at most {max_prompts} prompts per request, got {len(prompts)}", param="prompt")
    if any(len(p) == 0 for p in prompts):
        raise bad_request("'prompt' is empty", param="prompt")
    return prompts


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_token_list(value: Any) -> bool:
    return isinstance(value, list) and all(_is_token(t) for t in value)


def _messages(value: Any) -> tuple[dict[str, str], ...]:
    if not isinstance(value, list):
        raise bad_request("'messages' must be an array of messages", param="messages")
    if not value:
        raise bad_request("'messages' must not be empty", param="messages")
    return tuple(_message(m, i) for i, m in enumerate(value))


def _message(value: Any, index: int) -> dict[str, str]:
    where = f"messages[{index}]"
    if not isinstance(value, dict):
        raise bad_request(f"'{where}' must be an object with 'role' and 'content'", param=where)
    role = value.get("role")
    if not isinstance(role, str):
        raise bad_request(f"'{where}.role' is required and must be a string", param=f"{where}.role")
    if role not in CHAT_ROLES:
        raise bad_request(
            f"'{where}.role' is '{role}'; it must be one of {', '.join(CHAT_ROLES)}", param=f"{where}.role"
        )
    content = _content_text(value.get("content"), role, where)
    return {"role": "system" if role == "developer" else role, "content": content}


def _content_text(content: Any, role: str, where: str) -> str:
    if isinstance(content, str):
        return content
    if content is None and role == "assistant":
        return ""
    if isinstance(content, list):
        return "".join(_text_part(part, f"{where}.content[{i}]") for i, part in enumerate(content))
    raise bad_request(
        f"'{where}.content' must be a string or a list of text parts", param=f"{where}.content"
    )


def _text_part(part: Any, where: str) -> str:
    if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
        kind = part.get("type") if isinstance(part, dict) else None
        detail = f"content part type '{kind}' is not supported" if isinstance(kind, str) and kind != "text" else (
            "a content part must be {\"type\": \"text\", \"text\": <string>}"
        )
        raise bad_request(f"'{where}': {detail}; only text parts are", param=where)
    return part["text"]


# ---- sampling -------------------------------------------------------------------------------


def _sampling_params(fields: Fields, max_tokens: int | None, logprobs: int | None, **constraint) -> SamplingParams:
    values = dict(
        max_tokens=max_tokens,
        temperature=fields.number("temperature", 1.0, minimum=0.0, maximum=2.0),
        top_p=fields.number("top_p", 1.0, minimum=0.0, maximum=1.0),
        frequency_penalty=fields.number("frequency_penalty", 0.0, minimum=-2.0, maximum=2.0),
        presence_penalty=fields.number("presence_penalty", 0.0, minimum=-2.0, maximum=2.0),
        seed=fields.integer("seed"),
        stop=fields.strings("stop", MAX_STOP_STRINGS),
        logprobs=logprobs,
        # Extensions beyond the OpenAI API (as other open servers accept them):
        top_k=fields.integer("top_k", 0, minimum=-1),
        min_p=fields.number("min_p", 0.0, minimum=0.0, maximum=1.0),
        repetition_penalty=fields.number("repetition_penalty", 1.0),
        min_tokens=fields.integer("min_tokens", 0, minimum=0),
        ignore_eos=fields.boolean("ignore_eos"),
        stop_token_ids=fields.integers("stop_token_ids"),
        skip_special_tokens=fields.boolean("skip_special_tokens", True),
        include_stop_str_in_output=fields.boolean("include_stop_str_in_output"),
        regex=fields.string("regex"),
        choices=fields.strings("choices", MAX_CHOICES) or None,
    )
    values.update(constraint)
    try:
        return SamplingParams(**values)
    except ValueError as exc:
        message = str(exc)
        name = message.split(" ", 1)[0]
        raise bad_request(message, param=name if name in values else None) from None


def _seeded(params: SamplingParams, n: int) -> list[SamplingParams]:
    if params.seed is None:
        return [params] * n
    return [replace(params, seed=params.seed + i) for i in range(n)]


def _check_ignored(fields: Fields) -> None:
    """Fields accepted and ignored, still checked for their type."""
    fields.string("user")
    fields.object("metadata")
    fields.boolean("store")


def _n(fields: Fields, max_n: int) -> int:
    return fields.integer("n", 1, minimum=1, maximum=max_n)


def _stream(fields: Fields) -> tuple[bool, bool]:
    stream = fields.boolean("stream")
    options = fields.object("stream_options")
    if options is not None and not stream:
        raise bad_request("'stream_options' is only allowed when 'stream' is true", param="stream_options")
    include_usage = options.boolean("include_usage") if options is not None else False
    return stream, include_usage


def _cache_salt(fields: Fields) -> str | None:
    return fields.string("cache_salt")


def _chat_logprobs(fields: Fields) -> int | None:
    wanted = fields.boolean("logprobs")
    top = fields.integer("top_logprobs", minimum=0, maximum=MAX_LOGPROBS)
    if top is not None and not wanted:
        raise bad_request("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    return (top or 0) if wanted else None


def _response_format(fields: Fields) -> dict[str, Any]:
    """OpenAI's response_format as a constraint: {"type": "text" | "json_object" | "json_schema",
    "json_schema": {"name", "schema", "strict"}}."""
    response_format = fields.object("response_format")
    if response_format is None:
        return {}
    kind = response_format.string("type", required=True)
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = response_format.object("json_schema")
        if spec is None:
            raise bad_request("response_format 'json_schema' needs a 'json_schema' object", param="response_format")
        schema = spec.object("schema")
        return {"json_schema": schema.body if schema is not None else {}}
    raise bad_request(f"unknown response_format type '{kind}'", param="response_format")


def _refuse_unsupported_chat_fields(fields: Fields) -> None:
    tools = fields.raw("tools")
    if tools is not None and (not isinstance(tools, list) or tools):
        raise bad_request("'tools' (function calling) is not supported by this server", param="tools")
    if fields.raw("tool_choice") not in (None, "none", "auto"):
        raise bad_request("'tool_choice' other than 'none' or 'auto' is not supported", param="tool_choice")
    if fields.raw("logit_bias"):
        raise bad_request("'logit_bias' is not supported", param="logit_bias")
