"""IncrementalDetokenizer: text deltas as tokens arrive, safe for multi-byte characters."""

from __future__ import annotations

from typing import Any

_CONTEXT_TOKENS = 6  # prompt tokens decoded with the output, so spacing matches in-context decoding


class IncrementalDetokenizer:
    """Decodes a window [prefix_offset, end) and emits what grew past [prefix_offset,
    read_offset); a window ending in an incomplete UTF-8 sequence waits for more tokens."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        if self.prefix_offset > 4 * _CONTEXT_TOKENS:
            drop = self.prefix_offset
            self.ids = self.ids[drop:]
            self.prefix_offset, self.read_offset = 0, self.read_offset - drop
        return full[len(prefix) :]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
