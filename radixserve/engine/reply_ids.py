"""ReplySplicer: a rendered conversation -> token ids, with the model's own ids for its earlier replies.

Tokenizing a conversation again gives an earlier reply ids other than the ones the model
generated (its own token split, under a grammar or not), and the prefix cache misses from
there on. The splicer finds each assistant turn in the rendered text and asks a ReplyLookup
for the replies generated right after exactly the ids that precede the turn (the prompt that
reply answered); one whose text the turn holds is used where its ids decode back to it:

    ...<|im_start|>assistant\\n  REPLY TEXT  <|im_end|>\\n<|im_start|>user\\n...
    |<-- encoded as before -->|<- stored ->|<----- encoded as before ----->|

A turn is the text between the template's generation prompt (where the model began) and the
next end-of-turn token (where it stopped). The pieces around it are encoded on their own:
the one before ends where the earlier prompt ended, so it tokenizes as that prompt did; the
one after begins with an added token, at which a tokenizer splits anyway. A turn that holds
more than the reply (a close the renderer writes after a call that max_tokens cut) gets the
reply's ids and the rest encoded after them. Without a stored reply that fits, the text is
encoded whole, exactly as without a splicer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Protocol

_PROBE_USER = [{"role": "user", "content": "Hi"}]
_PROBE_REPLY = "radixserve reply probe"
MAX_MISSES = 8  # turns in a row a stored reply might begin but none follows their prompt: stop looking


class ReplyLookup(Protocol):
    """One cache namespace's stored replies, found by the prompt ids they followed."""

    def may_begin(self, text: str) -> bool:
        """False when no stored reply can be a prefix of `text` (a cheap check first)."""

    def replies_after(self, prompt_ids: Sequence[int]) -> list[tuple[str, Sequence[int]]]:
        """(text, generated ids) of each reply generated right after exactly `prompt_ids`."""


@dataclass(frozen=True)
class TurnMarks:
    """Where the template puts an assistant turn: after `opening` (its generation prompt),
    up to `closing` (the added token that ends the turn)."""

    opening: str
    closing: str


class ReplySplicer:
    """Encodes rendered conversations for one tokenizer and chat template (None: the
    tokenizer's own); thread-safe (it only reads)."""

    def __init__(self, tokenizer: Any, template: str | None = None):
        self.tokenizer = tokenizer
        self.template = template

    def encode(self, text: str, replies: ReplyLookup | None = None) -> list[int]:
        """The ids of `text` (no special tokens added), stored replies spliced in."""
        marks = self.marks if replies is not None else None
        if marks is None:
            return self._encode(text)
        ids: list[int] = []
        cursor = 0
        misses = 0
        for start, end in reply_spans(text, marks):
            turn = text[start:end]
            if misses >= MAX_MISSES or not replies.may_begin(turn):
                continue
            head = ids + self._encode(text[cursor:start])  # what this text's prefix encodes to, as ever
            found = self._match(turn, replies.replies_after(head))
            if found is None:
                misses += 1  # each miss encodes the text since the last splice again: bounded
                continue
            ids, cursor, misses = head + found, end, 0
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
            return turn_marks(self.tokenizer, self.template)
        except Exception:  # a template that refuses the probe conversation: no splicing
            return None

    def _match(self, turn: str, candidates: list[tuple[str, Sequence[int]]]) -> list[int] | None:
        """The ids of `turn`: the longest stored reply it begins with (ids that decode to that
        reply's text), then the rest of the turn encoded."""
        for reply, stored in sorted(candidates, key=lambda c: -len(c[0])):
            if turn.startswith(reply):
                ids = self._verified(reply, stored)
                if ids is not None:
                    return ids + self._encode(turn[len(reply):])
        return None

    def _verified(self, text: str, stored: Sequence[int]) -> list[int] | None:
        """`stored` where it decodes to `text`; a stop token the model ended with (in the ids,
        not the text) is dropped."""
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


def turn_marks(tokenizer: Any, template: str | None = None) -> TurnMarks | None:
    """Read the marks off the template (None: the tokenizer's own): render a probe conversation
    with and without the generation prompt and with a reply, and find the reply between them.
    A thinking template whose reply renders after a reasoning block the generation prompt does
    not hold (Qwen 3's, Qwen 3.5's) is read with thinking off: its turns without reasoning."""
    if tokenizer is None or not (template or getattr(tokenizer, "chat_template", None)):
        return None
    for switch in ({}, {"enable_thinking": False}):
        marks = _marks(tokenizer, template, switch)
        if marks is not None:
            return marks
    return None


def _marks(tokenizer: Any, template: str | None, switch: dict[str, Any]) -> TurnMarks | None:
    bare = _render(tokenizer, template, _PROBE_USER, False, switch)
    prompt = _render(tokenizer, template, _PROBE_USER, True, switch)
    answered = _render(tokenizer, template, _PROBE_USER + [{"role": "assistant", "content": _PROBE_REPLY}], False,
                       switch)
    if not prompt.startswith(bare) or len(prompt) == len(bare) or not answered.startswith(prompt + _PROBE_REPLY):
        return None
    closing = _leading_added_token(tokenizer, answered[len(prompt) + len(_PROBE_REPLY):])
    return TurnMarks(prompt[len(bare):], closing) if closing else None


def _render(tokenizer: Any, template: str | None, messages: list[dict[str, str]], generation_prompt: bool,
            switch: dict[str, Any]) -> str:
    own = {"chat_template": template} if template is not None else {}
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt, **own,
                                         **switch)


def _leading_added_token(tokenizer: Any, text: str) -> str | None:
    added = [t for t in tokenizer.get_added_vocab() if t and text.startswith(t)]
    return max(added, key=len) if added else None
