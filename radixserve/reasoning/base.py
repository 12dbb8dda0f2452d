"""What every reasoning parser shares: the pieces a splitter cuts generated text into, the
splitter's interface, and a parser's description (its markers, its grammar prefix)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class Piece:
    """A run of generated text: reasoning, or content (what the answer says)."""

    reasoning: bool
    text: str


@dataclass(frozen=True)
class Span:
    """Where one reasoning block lies in the generated text, markers included: [start, end)."""

    start: int
    end: int | None  # None: still open (or never closed: cut by max_tokens)


class Splitter(Protocol):
    """Feed generated text left to right; each call returns the pieces that became certain
    (a possible marker is held back until the next text settles it). Streamed and whole
    text split alike: the pieces of any feeding assemble to the same reasoning and content."""

    spans: list[Span]

    def feed(self, text: str) -> list[Piece]: ...

    def finish(self) -> list[Piece]: ...


class ReasoningParser(Protocol):
    """One reasoning format (a --reasoning-parser value)."""

    name: str
    keeps_special_tokens: bool  # its markers are special tokens: the text must keep them
    follows_enable_thinking: bool  # a request's enable_thinking (or thinking) false turns it off

    def splitter(self, opened: bool) -> Splitter:
        """A splitter for one answer; `opened`: the prompt opened the reasoning block."""
        ...

    def opens_in_prompt(self, prompt_text: str) -> bool:
        """Whether a rendered prompt ends inside an open reasoning block."""
        ...

    def grammar_prefix(self, opened: bool, budget: int | None) -> dict[str, Any]:
        """The xgrammar structural-tag format of the reasoning block that comes before a
        constrained answer (`budget`: at most this many tokens of reasoning text, then the
        end marker is forced)."""
        ...
