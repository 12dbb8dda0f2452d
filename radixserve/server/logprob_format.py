"""Log-probabilities in the two OpenAI shapes: legacy completions and chat."""

from __future__ import annotations

from typing import Any

from radixserve.outputs import TokenLogprob
from radixserve.server.token_text import TokenTexts


class LegacyLogprobs:
    """Completions' {"tokens", "token_logprobs", "top_logprobs", "text_offset"}, built in
    pieces as tokens arrive; `text_offset` counts characters from the start of the
    returned text (the prompt's when it is echoed)."""

    def __init__(self, texts: TokenTexts):
        self.texts = texts
        self.offset = 0

    def piece(self, token_ids: list[int], entries: list[TokenLogprob | None]) -> dict[str, Any]:
        """The next tokens and their entries (None where there is none: a prompt's first token)."""
        out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token_id, entry in zip(token_ids, entries):
            text = self.texts.text(token_id)
            out["tokens"].append(text)
            out["text_offset"].append(self.offset)
            self.offset += len(text)
            out["token_logprobs"].append(finite(entry.logprob) if entry is not None else None)
            out["top_logprobs"].append(self._top(entry))
        return out

    def _top(self, entry: TokenLogprob | None) -> dict[str, float] | None:
        if entry is None:
            return None
        top = {self.texts.text(token_id): finite(logprob) for token_id, logprob in entry.top}
        top.setdefault(self.texts.text(entry.token_id), finite(entry.logprob))
        return top


def merge_legacy(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    return {key: first[key] + second[key] for key in first}


def chat_logprobs(texts: TokenTexts, entries: list[TokenLogprob]) -> dict[str, Any]:
    """Chat's {"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}, ...]}."""
    return {"content": [_chat_entry(texts, e) for e in entries]}


def _chat_entry(texts: TokenTexts, entry: TokenLogprob) -> dict[str, Any]:
    item = _chat_token(texts, entry.token_id, entry.logprob)
    item["top_logprobs"] = [_chat_token(texts, token_id, logprob) for token_id, logprob in entry.top]
    return item


def _chat_token(texts: TokenTexts, token_id: int, logprob: float) -> dict[str, Any]:
    return {"token": texts.text(token_id), "logprob": finite(logprob), "bytes": list(texts.bytes(token_id))}


def finite(logprob: float) -> float:
    """JSON has no -Infinity: an impossible token's logprob is reported as -9999.0."""
    return logprob if logprob > -9999.0 else -9999.0
