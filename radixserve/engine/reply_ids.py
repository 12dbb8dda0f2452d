"""ReplySplicer: a rendered conversation -> token ids, with the model's own ids for its earlier replies.

Tokenizing a conversation again gives an earlier reply ids other than the ones the model
generated (its own token split, under a grammar or not), and the prefix cache misses from
there on. The splicer finds each assistant turn in the rendered text, asks a ReplyLookup for
the ids generated for exactly that text, and uses them where they decode back to it:

    ...<|im_start|>assistant\\n  REPLY TEXT  <|im_end|>\\n<|im_start|>user\\n...
    |<-- encoded as before -->|<- stored ->|<----- encoded as before ----->|

A turn is the text between the template's generation prompt (where the model began) and the
next end-of-turn token (where it stopped). The pieces around it are encoded on their own:
the one before ends where the earlier prompt ended, so it tokenizes as that prompt did; the
one after begins with an added token, at which a tokenizer splits anyway. Without a stored
reply that fits, the text is encoded whole, exactly as without a splicer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Protocol

_PROBE_USER = [{"role": "user", "content": "Hi"}]
_PROBE_REPLY = "radixserve reply probe"


class ReplyLookup(Protocol):
    """One cache namespace's stored replies: the ids generated for a reply's exact text."""

    def reply_ids(self, text: str) -> Sequence[int] | None: ...


@dataclass(frozen=True)
class TurnMarks:
    """Where the template puts an assistant turn: after `opening` (its generation prompt),
    up to `closing` (the added token that ends the turn)."""

    opening: str
    closing: str


class ReplySplicer:
    """Encodes rendered conversations for one tokenizer; thread-safe (it only reads)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    def encode(self, text: str, replies: ReplyLookup | None = None) -> list[int]:
        """The ids of `text` (no special tokens added), stored replies spliced in."""
        marks = self.marks if replies is not None else None
        if marks is None:
            return self._encode(text)
        ids: list[int] = []
        cursor = 0
        for start, end in reply_spans(text, marks):
            stored = self._verified(text[start:end], replies)
            if stored is not None:
                ids += self._encode(text[cursor:start]) + stored
                cursor = end
        if not cursor:
            return self._encode(text)
        ids += self._encode(text[cursor:])
        # A tokenizer that marks the start of every text it encodes (a SentencePiece prefix
        # space) would change the pieces: the whole must still decode to the text.
        return ids if self._decode(ids) == text else self._encode(text)

    @cached_property
    def marks(self) -> TurnMarks | None:
        """The template's turn marks, or None where a reply does not render as plain text
        between a generation prompt and an added token (then nothing is spliced)."""
        try:
            return turn_marks(self.tokenizer)
        except Exception:  # a template that refuses the probe conversation: no splicing
            return None

    def _verified(self, text: str, replies: ReplyLookup) -> list[int] | None:
        """The stored ids of `text` where they decode to it; a stop token the model ended
        with (it is in the ids, not the text) is dropped."""
        stored = replies.reply_ids(text)
        if not stored:
            return None
        ids = list(stored)
        for candidate in (ids, ids[:-1]):
            if candidate and self._decode(candidate) == text:
                return candidate
        return None

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False) if text else []

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def reply_spans(text: str, marks: TurnMarks) -> list[tuple[int, int]]:
    """(start, end) of each assistant turn's text: after an opening, before the next closing.
    The final opening (the generation prompt of this request) has no closing after it."""
    spans = []
    at = text.find(marks.opening)
    while at >= 0:
        start = at + len(marks.opening)
        end = text.find(marks.closing, start)
        if end < 0:
            break
        if end > start:
            spans.append((start, end))
        at = text.find(marks.opening, end)
    return spans


def turn_marks(tokenizer: Any) -> TurnMarks | None:
    """Read the marks off the template: render a probe conversation with and without the
    generation prompt and with a reply, and find the reply between them."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        return None
    bare = _render(tokenizer, _PROBE_USER, False)
    prompt = _render(tokenizer, _PROBE_USER, True)
    answered = _render(tokenizer, _PROBE_USER + [{"role": "assistant", "content": _PROBE_REPLY}], False)
    if not prompt.startswith(bare) or len(prompt) == len(bare) or not answered.startswith(prompt + _PROBE_REPLY):
        return None
    closing = _leading_added_token(tokenizer, answered[len(prompt) + len(_PROBE_REPLY):])
    return TurnMarks(prompt[len(bare):], closing) if closing else None


def _render(tokenizer: Any, messages: list[dict[str, str]], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def _leading_added_token(tokenizer: Any, text: str) -> str | None:
    added = [t for t in tokenizer.get_added_vocab() if t and text.startswith(t)]
    return max(added, key=len) if added else None
