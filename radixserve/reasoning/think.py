"""ThinkSplitter: `<think>reasoning</think>content`, the block of Qwen 3 and DeepSeek R1.

`opened`: the reasoning block is open from the first generated character (the prompt
opened it, or the parser reads every answer so; a `<think>` the model writes again right at
the start is taken as the marker); else only a `<think>` at the start of the answer (after
whitespace) opens it. Everything up to `</think>` is reasoning; one block per answer, so
later markers are content."""

from __future__ import annotations

from radixserve.reasoning.base import Piece, Span

THINK_START = "<think>"
THINK_END = "</think>"


class ThinkSplitter:
    def __init__(self, opened: bool, start: str = THINK_START, end: str = THINK_END):
        self.start, self.end = start, end
        self.spans: list[Span] = [Span(0, None)] if opened else []
        self._state = "opened" if opened else "before"
        self._buf = ""  # text not yet settled
        self._seen = 0  # characters of generated text before _buf

    def feed(self, text: str) -> list[Piece]:
        self._buf += text
        return self._run(final=False)

    def finish(self) -> list[Piece]:
        return self._run(final=True)

    def _run(self, final: bool) -> list[Piece]:
        pieces: list[Piece] = []
        while self._buf:
            step = getattr(self, "_" + self._state)(final)
            if step is None:
                break
            pieces += step
        return [p for p in pieces if p.text]

    def _take(self, size: int) -> str:
        taken, self._buf = self._buf[:size], self._buf[size:]
        self._seen += size
        return taken

    def _before(self, final: bool) -> list[Piece] | None:
        """At the answer's start: whitespace, then maybe `<think>`."""
        stripped = self._buf.lstrip()
        if stripped.startswith(self.start):
            lead = len(self._buf) - len(stripped)
            self.spans.append(Span(self._seen + lead, None))
            self._take(lead + len(self.start))
            self._state = "reasoning"
            return []
        if (not stripped or self.start.startswith(stripped)) and not final:
            return None  # maybe the marker, still arriving
        self._state = "content"
        return []

    def _opened(self, final: bool) -> list[Piece] | None:
        """Open from the start: a leading `<think>` is the marker again, not reasoning."""
        stripped = self._buf.lstrip()
        if stripped.startswith(self.start):
            self._take(len(self._buf) - len(stripped) + len(self.start))
        elif (not stripped or self.start.startswith(stripped)) and not final:
            return None
        self._state = "reasoning"
        return []

    def _reasoning(self, final: bool) -> list[Piece] | None:
        at = self._buf.find(self.end)
        if at >= 0:
            text = self._take(at)
            self._take(len(self.end))
            self.spans[-1] = Span(self.spans[-1].start, self._seen)
            self._state = "after"
            return [Piece(True, text)]
        keep = 0 if final else _partial_suffix(self._buf, self.end)
        if keep == len(self._buf):
            return None
        return [Piece(True, self._take(len(self._buf) - keep))]

    def _after(self, final: bool) -> list[Piece] | None:
        """Right after `</think>`: the whitespace that separates the answer is not content."""
        stripped = self._buf.lstrip()
        if not stripped and not final:
            return None
        self._take(len(self._buf) - len(stripped))
        self._state = "content"
        return []

    def _content(self, final: bool) -> list[Piece]:
        return [Piece(False, self._take(len(self._buf)))]


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that begins `marker` (held back)."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def think_prefix(begin: str, budget: int | None, optional: bool) -> dict:
    """The structural-tag format of a think block: `begin`, any text (at most `budget`
    tokens), `</think>`; optional: the answer may skip it."""
    content: dict = {"type": "any_text"}
    if budget is not None:
        content["max_tokens"] = budget
    block = {"type": "tag", "begin": begin, "content": content, "end": THINK_END}
    return {"type": "optional", "content": block} if optional else block


def prompt_opens_think(prompt_text: str) -> bool:
    """A prompt whose last `<think>` is not closed ends inside the block."""
    return prompt_text.rfind(THINK_START) > prompt_text.rfind(THINK_END)
