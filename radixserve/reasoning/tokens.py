"""reasoning_tokens: how many generated tokens the reasoning blocks took, counted on the
token ids (a block's markers included), by decoding prefixes of the ids."""

from __future__ import annotations

from collections.abc import Callable

from radixserve.reasoning.base import Span

Decode = Callable[[list[int]], str]


def reasoning_tokens(spans: list[Span], token_ids: list[int], decode: Decode) -> int:
    """Tokens from the one holding each block's first character to the one holding its last
    (to the end of the output for a block never closed)."""
    total = 0
    for span in spans:
        first = _tokens_reaching(span.start + 1, token_ids, decode) - 1
        last = len(token_ids) if span.end is None else _tokens_reaching(span.end, token_ids, decode)
        total += max(0, last - max(first, 0))
    return total


def _tokens_reaching(chars: int, token_ids: list[int], decode: Decode) -> int:
    """The fewest leading tokens whose text has at least `chars` characters (binary search:
    the text of a longer prefix is never shorter)."""
    lo, hi = 0, len(token_ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(decode(token_ids[:mid])) >= chars:
            hi = mid
        else:
            lo = mid + 1
    return lo
