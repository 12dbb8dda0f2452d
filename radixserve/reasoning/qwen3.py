"""qwen3: Qwen 3's reasoning. Only a `<think>` the model writes at the start of its answer
opens the block (vLLM's qwen3 semantics), unless the rendered prompt itself ends inside
an open `<think>` (the thinking-only Qwen 3 templates): then, as deepseek_r1, everything
up to `</think>` is reasoning. `enable_thinking: false` renders a closed, empty block into
the prompt: the answer is all content."""

from __future__ import annotations

from typing import Any

from radixserve.reasoning.think import THINK_START, ThinkSplitter, prompt_opens_think, think_prefix


class Qwen3:
    name = "qwen3"
    follows_enable_thinking = True  # enable_thinking/thinking false: no reasoning
    keeps_special_tokens = False

    def splitter(self, opened: bool) -> ThinkSplitter:
        return ThinkSplitter(opened=opened)

    def opens_in_prompt(self, prompt_text: str) -> bool:
        return prompt_opens_think(prompt_text)

    def grammar_prefix(self, opened: bool, budget: int | None) -> dict[str, Any]:
        if opened:
            return think_prefix("", budget, optional=False)
        return think_prefix(THINK_START, budget, optional=budget is None)
