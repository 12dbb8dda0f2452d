"""gpt_oss: the harmony format of OpenAI's gpt-oss models. An answer is a run of messages,
each a header up to `<|message|>` and a body up to `<|end|>`, `<|return|>` or `<|call|>`:

    <|channel|>analysis<|message|>REASONING<|end|><|start|>assistant<|channel|>final<|message|>ANSWER<|return|>

The analysis channel is reasoning; the final channel's body is content; any other message
(commentary: tool calls, preambles) passes through as written, headers and all, for the
tool-call parser. The markers are special tokens: the answer's text must keep them."""

from __future__ import annotations

from typing import Any

from radixserve.reasoning.base import Piece, Span
from radixserve.reasoning.think import _partial_suffix

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
ENDS = ("<|end|>", "<|return|>", "<|call|>")


class GptOss:
    name = "gpt_oss"
    follows_enable_thinking = False  # gpt-oss always reasons
    keeps_special_tokens = True

    def splitter(self, opened: bool) -> HarmonySplitter:
        return HarmonySplitter()

    def opens_in_prompt(self, prompt_text: str) -> bool:
        return False

    def grammar_prefix(self, opened: bool, budget: int | None) -> dict[str, Any]:
        """The analysis message, then the final message's header (markers as tokens)."""
        content: dict[str, Any] = {"type": "any_text"}
        if budget is not None:
            content["max_tokens"] = budget
        analysis = {"type": "tag", "begin": _token(MESSAGE), "content": content, "end": _token("<|end|>")}
        return {"type": "sequence", "elements": [
            _token(CHANNEL), _text("analysis"), analysis,
            _token(START), _text("assistant"), _token(CHANNEL), _text("final"), _token(MESSAGE),
        ]}


class HarmonySplitter:
    def __init__(self) -> None:
        self.spans: list[Span] = []
        self._buf = ""
        self._seen = 0
        self._state = "header"
        self._channel = ""

    def feed(self, text: str) -> list[Piece]:
        self._buf += text
        return self._run(False)

    def finish(self) -> list[Piece]:
        pieces = self._run(True)
        if self._state == "header" and self._buf:  # a header never completed: as written
            pieces.append(Piece(False, self._take(len(self._buf))))
        return [p for p in pieces if p.text]

    def _run(self, final: bool) -> list[Piece]:
        pieces: list[Piece] = []
        while self._buf:
            step = self._header_step(final) if self._state == "header" else self._body_step(final)
            if step is None:
                break
            pieces += step
        return [p for p in pieces if p.text]

    def _take(self, size: int) -> str:
        taken, self._buf = self._buf[:size], self._buf[size:]
        self._seen += size
        return taken

    def _header_step(self, final: bool) -> list[Piece] | None:
        """A header stays in the buffer until its `<|message|>` arrives."""
        at = self._buf.find(MESSAGE)
        if at < 0:
            if not self._buf.lstrip().startswith("<"):
                self._state, self._channel = "body", "plain"  # no harmony at all: content
                return []
            return None
        start = self._seen
        header = self._take(at + len(MESSAGE))
        self._channel = _channel(header)
        self._state = "body"
        if self._channel == "analysis":
            self.spans.append(Span(start, None))
            return []
        return [] if self._channel == "final" else [Piece(False, header)]

    def _body_step(self, final: bool) -> list[Piece] | None:
        hits = [(self._buf.find(e), e) for e in ENDS if e in self._buf]
        raw = self._channel not in ("analysis", "final")
        if not hits:
            keep = 0 if final else max(_partial_suffix(self._buf, e) for e in ENDS)
            if keep == len(self._buf):
                return None
            return [Piece(self._channel == "analysis", self._take(len(self._buf) - keep))]
        at, end = min(hits)
        body = self._take(at)
        marker = self._take(len(end))
        if self._channel == "analysis":
            self.spans[-1] = Span(self.spans[-1].start, self._seen)
        pieces = [Piece(self._channel == "analysis", body)] + ([Piece(False, marker)] if raw else [])
        self._state = "header"
        return pieces


def _token(marker: str) -> dict[str, Any]:
    return {"type": "token", "token": marker}


def _text(value: str) -> dict[str, Any]:
    return {"type": "const_string", "value": value}


def _channel(header: str) -> str:
    at = header.find(CHANNEL)
    if at < 0:
        return ""
    rest = header[at + len(CHANNEL):]
    for stop in (" ", "<|"):
        if stop in rest:
            rest = rest[: rest.index(stop)]
    return rest.strip()
