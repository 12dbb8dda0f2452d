"""Template arguments a chat request passes to the chat template: `chat_template_kwargs`
(vLLM's field: e.g. {"enable_thinking": false}) and `reasoning_effort` (gpt-oss's templates
read it). Checked here: a key that would override how the server renders the prompt, or a
thinking switch that is not a boolean, is a 400 rather than an argument the template
silently misreads."""

from __future__ import annotations

from typing import Any, Literal

from radixserve.server.errors import bad_request

ReasoningEffort = Literal["none", "minimal", "low", "medium", "high"]

# apply_chat_template's own parameters and what the server passes itself: not the caller's.
RESERVED = frozenset({
    "messages", "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "return_dict", "return_tensors", "return_assistant_tokens_mask",
    "padding", "truncation", "max_length", "tokenizer_kwargs",
})
BOOLEAN_SWITCHES = ("enable_thinking", "thinking")


def template_kwargs(
    chat_template_kwargs: dict[str, Any] | None, reasoning_effort: str | None, param: str = "chat_template_kwargs",
) -> dict[str, Any]:
    """The checked arguments for the template (reasoning_effort among them when given)."""
    kwargs = dict(chat_template_kwargs or {})
    for key in kwargs:
        if key in RESERVED:
            raise bad_request(f"'{param}.{key}' is set by the server and cannot be passed to the chat template",
                              param=f"{param}.{key}")
        if not key.isidentifier():
            raise bad_request(f"'{param}' keys must be identifiers, got {key!r}", param=param)
    for key in BOOLEAN_SWITCHES:
        if key in kwargs and not isinstance(kwargs[key], bool):
            raise bad_request(f"'{param}.{key}' must be a boolean, got {kwargs[key]!r}", param=f"{param}.{key}")
    if reasoning_effort is not None:
        if "reasoning_effort" in kwargs and kwargs["reasoning_effort"] != reasoning_effort:
            raise bad_request("'reasoning_effort' and 'chat_template_kwargs.reasoning_effort' disagree",
                              param="reasoning_effort")
        kwargs["reasoning_effort"] = reasoning_effort
    return kwargs
