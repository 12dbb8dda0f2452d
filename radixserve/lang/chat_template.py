"""ChatTemplate: the text a model's chat template writes around one message.

A program's state appends role markers as it goes, so that its text is exactly what the
tokenizer's template renders for the same messages. The markers of a message come from
rendering the earlier messages plus one with a placeholder content, and cutting at the
placeholder. An assistant turn that opens after other messages starts with the template's
generation prompt, as in a chat completion.
"""

from __future__ import annotations

from typing import Any

_PLACEHOLDER = "\u27e6radixserve-lang-content\u27e7"


class ChatTemplate:
    """Role markers from a Hugging Face tokenizer's chat template."""

    def __init__(self, tokenizer: Any):
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise ValueError("this model has no chat template; write the prompt as plain text instead of roles")
        self.tokenizer = tokenizer

    def markers(self, messages: list[dict[str, str]], role: str, tools: list[dict] | None = None) -> tuple[str, str]:
        """(text before, text after) the content of a `role` message that follows `messages`;
        `tools`: the conversation's tools, for a template that renders them."""
        prior = self.render(messages, tools=tools)
        wrapped = self._suffix(prior, self.render(messages + [{"role": role, "content": _PLACEHOLDER}], tools=tools))
        before, found, after = wrapped.partition(_PLACEHOLDER)
        if not found:
            raise ValueError(f"the chat template drops the content of a {role} message")
        if role == "assistant" and messages:
            before = self._suffix(prior, self.render(messages, add_generation_prompt=True, tools=tools))
        return before, after

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = False,
               tools: list[dict] | None = None) -> str:
        if not messages:
            return ""
        try:
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                **({"tools": tools} if tools else {}),
            )
        except Exception as exc:  # jinja errors, raise_exception() in the template
            raise ValueError(f"the chat template refused these messages: {exc}") from None

    def _suffix(self, prior: str, full: str) -> str:
        if not full.startswith(prior):
            raise ValueError(
                "the chat template renders earlier messages differently once more follow; "
                "roles cannot be appended turn by turn with this model"
            )
        return full[len(prior):]
