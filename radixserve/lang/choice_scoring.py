"""How `select` scores its choices: which tokens to score, and the decision.

A choice is scored as the model would read it: the text prefix + choice is tokenized as a
whole, and the scored tokens are those after its longest common token prefix with the
prefix's own tokens (a token that merges across the boundary is scored too). All choices
are submitted together with `prompt_logprobs_start` at their first scored token, so the
prefix's blocks come from the cache (or are computed once for all of them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ScoreRequest:
    """Score `token_ids[start:]`, each given the tokens before it."""

    token_ids: list[int]
    start: int


@dataclass(frozen=True)
class SelectResult:
    """The scores of one select: per choice, its scored tokens' log-probabilities, their
    sum (`total`) and mean (`normalized`); `choice` is the decision under `method`."""

    choice: str
    index: int
    method: str
    choices: list[str]
    token_logprobs: list[list[float]]
    token_ids: list[list[int]]

    @property
    def total_logprobs(self) -> list[float]:
        return [sum(lps) for lps in self.token_logprobs]

    @property
    def normalized_logprobs(self) -> list[float]:
        return [sum(lps) / len(lps) for lps in self.token_logprobs]

    def as_dict(self) -> dict[str, Any]:
        return {
            "choice": self.choice,
            "index": self.index,
            "method": self.method,
            "choices": list(self.choices),
            "total_logprobs": self.total_logprobs,
            "normalized_logprobs": self.normalized_logprobs,
            "token_logprobs": [list(lps) for lps in self.token_logprobs],
            "token_ids": [list(ids) for ids in self.token_ids],
        }


def score_requests(encode: Callable[[str], list[int]], prefix: str, choices: list[str]) -> list[ScoreRequest]:
    """One ScoreRequest per choice (see the module docstring for the boundary rule)."""
    if not prefix:
        raise ValueError("select needs some text before it: a choice is scored given the text so far")
    prefix_ids = encode(prefix)
    requests = []
    for choice in choices:
        full = encode(prefix + choice)
        start = max(1, _common_prefix_len(prefix_ids, full))
        if start >= len(full):
            raise ValueError(f"choice {choice!r} adds no token after the prefix")
        requests.append(ScoreRequest(full, start))
    return requests


def decide(choices: list[str], requests: list[ScoreRequest], logprobs: list[list[float]], method: str) -> SelectResult:
    """The choice with the highest total (or per-token mean) log-probability; ties go to the
    earlier choice."""
    if method == "token_length_normalized":
        keys = [sum(lps) / len(lps) for lps in logprobs]
    else:
        keys = [sum(lps) for lps in logprobs]
    index = max(range(len(choices)), key=lambda i: (keys[i], -i))
    return SelectResult(
        choice=choices[index],
        index=index,
        method=method,
        choices=list(choices),
        token_logprobs=[list(lps) for lps in logprobs],
        token_ids=[r.token_ids[r.start:] for r in requests],
    )


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
