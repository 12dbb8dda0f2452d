"""deepseek_r1: DeepSeek R1's reasoning, as vLLM's parser of that name reads it. Its chat
template opens `<think>` in the prompt, so every answer starts inside the block: all text
up to `</think>` is reasoning, and an answer that never closes it is all reasoning."""

from __future__ import annotations

from typing import Any

from radixserve.reasoning.think import ThinkSplitter, think_prefix


class DeepSeekR1:
    name = "deepseek_r1"
    follows_enable_thinking = True  # enable_thinking/thinking false: no reasoning
    keeps_special_tokens = False

    def splitter(self, opened: bool) -> ThinkSplitter:
        return ThinkSplitter(opened=True)

    def opens_in_prompt(self, prompt_text: str) -> bool:
        return True

    def grammar_prefix(self, opened: bool, budget: int | None) -> dict[str, Any]:
        return think_prefix("", budget, optional=False)
