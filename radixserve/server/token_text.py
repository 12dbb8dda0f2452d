"""TokenTexts: the text and raw bytes of single token ids, for logprobs in responses."""

from __future__ import annotations

from functools import lru_cache
from typing import Any


class TokenTexts:
    """Text and UTF-8 bytes of one token id at a time, cached.

    Reads the engine's own tokenizer, from the event loop: decode and id_to_token only read
    it, and any number of threads may read a fast tokenizer at once (the prepare pool's
    workers already encode with it beside the engine thread; nothing in radixserve sets its
    truncation or padding, the only writes). A copy cost ~12 MiB for the default model.
    Byte-level BPE tokens map back to their exact bytes (so a token holding half of a
    multi-byte character has its true bytes, and its text shows U+FFFD); other tokenizers
    fall back to decoding the single id.
    """

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._byte_of_char = {c: b for b, c in _bytes_to_unicode().items()}
        self.text = lru_cache(maxsize=65536)(self._text)
        self.bytes = lru_cache(maxsize=65536)(self._bytes)

    def decode(self, token_ids: list[int]) -> str:
        """Text of a whole sequence (for echoing a prompt given as token ids)."""
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=False)

    def _text(self, token_id: int) -> str:
        return self._bytes(token_id).decode("utf-8", errors="replace")

    def _bytes(self, token_id: int) -> bytes:
        if self.tokenizer is None:
            return f"<{token_id}>".encode()
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str) and piece and all(c in self._byte_of_char for c in piece):
            if piece in self._special_tokens():
                return piece.encode("utf-8")
            return bytes(self._byte_of_char[c] for c in piece)
        return self.tokenizer.decode([token_id], skip_special_tokens=False).encode("utf-8")

    def _special_tokens(self) -> set[str]:
        if not hasattr(self, "_specials"):
            self._specials = set(getattr(self.tokenizer, "all_special_tokens", []) or [])
        return self._specials


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level BPE alphabet: every byte as a printable character."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, (chr(c) for c in chars)))
