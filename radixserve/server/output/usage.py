"""Usage: the token counts of an answer, computed once and spelt as each API spells them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from radixserve.outputs import RequestOutput


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    cached_tokens: int  # of prompt_tokens, served from the prefix cache
    completion_tokens: int

    @classmethod
    def of(cls, output: RequestOutput) -> "Usage":
        return cls(output.prompt_tokens, output.cached_tokens, output.completion_tokens)

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
        }

    def responses(self) -> dict[str, Any]:
        return {
            "input_tokens": self.prompt_tokens,
            "input_tokens_details": {"cached_tokens": self.cached_tokens},
            "output_tokens": self.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }

    def anthropic(self) -> dict[str, Any]:
        """As Anthropic counts: input_tokens computed for this request, the cached rest read
        (their sum is the prompt); the cache is written as a side effect, never billed."""
        return {
            "input_tokens": self.prompt_tokens - self.cached_tokens,
            "output_tokens": self.completion_tokens,
            "cache_read_input_tokens": self.cached_tokens,
            "cache_creation_input_tokens": 0,
        }
