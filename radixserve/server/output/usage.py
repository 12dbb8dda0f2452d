"""Usage: the token counts of an answer, computed once and spelt as each API spells them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from radixserve.outputs import RequestOutput


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    cached_tokens: int  # of prompt_tokens, served from the prefix cache
    completion_tokens: int
    # Of completion_tokens, those inside reasoning blocks (markers included); None: none are read.
    reasoning_tokens: int | None = None

    @classmethod
    def of(cls, output: RequestOutput) -> "Usage":
        return cls(output.prompt_tokens, output.cached_tokens, output.completion_tokens)

    def with_reasoning(self, tokens: int | None) -> "Usage":
        return replace(self, reasoning_tokens=tokens)

    @classmethod
    def of_group(cls, num_prompts: int, n: int, outputs: Sequence[RequestOutput | None]) -> "Usage":
        """Each prompt counts once however many samples it has (sample 0 stands for it,
        cached tokens included); completion tokens add up over every sample."""
        firsts = [o for o in (outputs[p * n] for p in range(num_prompts)) if o is not None]
        return cls(
            sum(o.prompt_tokens for o in firsts), sum(o.cached_tokens for o in firsts),
            sum(o.completion_tokens for o in outputs if o is not None),
        )

    def openai(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
            **({"completion_tokens_details": {"reasoning_tokens": self.reasoning_tokens}}
               if self.reasoning_tokens is not None else {}),
        }

    def responses(self) -> dict[str, Any]:
        return {
            "input_tokens": self.prompt_tokens,
            "input_tokens_details": {"cached_tokens": self.cached_tokens},
            "output_tokens": self.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens or 0},
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }

    def anthropic(self, cache_block: int | None = None) -> dict[str, Any]:
        """As Anthropic counts: cache_read_input_tokens served from the prefix cache,
        cache_creation_input_tokens computed here and written to it, input_tokens the rest
        (the three add up to the prompt). `cache_block`: the cache's block size (None: no cache)."""
        created = self.cache_created(cache_block)
        return {
            "input_tokens": self.prompt_tokens - self.cached_tokens - created,
            "output_tokens": self.completion_tokens,
            "cache_read_input_tokens": self.cached_tokens,
            "cache_creation_input_tokens": created,
        }

    def cache_created(self, cache_block: int | None) -> int:
        """Prompt tokens this request computed and wrote to the cache: the cache takes whole
        blocks of computed tokens, and every token but the last generated one is computed,
        so the block the prompt ends in is written once the answer fills it. (A block some
        other request wrote already, the same tokens, counts here too: the request cannot tell.)"""
        if cache_block is None:
            return 0
        computed = self.prompt_tokens + max(self.completion_tokens - 1, 0)
        written = min(self.prompt_tokens, computed // cache_block * cache_block)
        return max(0, written - self.cached_tokens)
