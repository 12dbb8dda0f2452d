"""RequestOutput: what a caller sees of a request after a step (cumulative), and OutputDelta:
what that step added (never more than the step's tokens).

The engine builds each step's output in O(what the step added): its delta is sliced from the
request's append-only lists, and its cumulative fields (token ids, text, logprobs, prompt
logprobs) are views fixed at that step's lengths, built into lists and strings only when read
(once per output). `GrowingText` is the request's text: extended piece by piece, never copied
whole while the request runs."""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TokenLogprob:
    """The chosen token's log-probability and the top alternatives (most likely first)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass(frozen=True)
class OutputDelta:
    """What one output adds to the request's previous one: the new tokens, their logprobs
    (None when not asked for) and the new text (a running request's text only grows: a
    possible stop string is held back)."""

    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    text: str
    first: bool  # the request's first output


_CHUNK = 256  # characters a GrowingText's tail grows to before it is sealed as a chunk


class GrowingText:
    """A text that grows by pieces: O(piece) to extend, O(1) to snapshot, O(the span) to read
    a span near its end, the whole string joined only when asked (`value`). It is sealed
    chunks (append-only; a `truncate` makes new lists) and a short tail string, so a snapshot
    stays the text it was taken of."""

    __slots__ = ("_chunks", "_ends", "_sealed", "_tail", "_joined", "_joined_chunks")

    def __init__(self, text: str = ""):
        self.set(text)

    def __len__(self) -> int:
        return self._sealed + len(self._tail)

    def append(self, piece: str) -> None:
        tail = self._tail + piece  # at most _CHUNK characters copied
        if len(tail) >= _CHUNK:
            self._sealed += len(tail)
            self._chunks.append(tail)
            self._ends.append(self._sealed)
            tail = ""
        self._tail = tail

    def value(self) -> str:
        """The whole text (the chunks joined once; later calls join only those sealed since)."""
        if self._joined_chunks < len(self._chunks):
            self._joined += "".join(self._chunks[self._joined_chunks:])
            self._joined_chunks = len(self._chunks)
        return self._joined + self._tail

    def slice(self, start: int, stop: int | None = None) -> str:
        """text[start:stop] for 0 <= start, reading only the chunks the span touches."""
        sealed = self._sealed
        if start >= sealed:  # in the tail: most reads (a stop string's window, a step's new text)
            return self._tail[start - sealed: None if stop is None else stop - sealed]
        return _span(self._chunks, self._ends, len(self._chunks), self._tail, start,
                     len(self) if stop is None else stop)

    def truncate(self, length: int) -> None:
        """Keep the first `length` characters (in new lists: snapshots keep what they saw)."""
        if length < len(self):
            self.set(self.slice(0, length))

    def set(self, text: str) -> None:
        self._chunks: list[str] = []
        self._ends: list[int] = []  # each chunk's end offset
        self._sealed = 0  # characters in the chunks
        self._tail = text
        self._joined, self._joined_chunks = "", 0  # the first _joined_chunks chunks, joined

    def snapshot(self, length: int) -> "TextView":
        """The first `length` characters as they are now, read later (if ever)."""
        return TextView(self._chunks, self._ends, len(self._chunks), self._tail, length)


def _span(chunks: list[str], ends: list[int], num_chunks: int, tail: str, start: int, stop: int) -> str:
    """(chunks[:num_chunks] + tail)[start:stop] (ends: the chunks' end offsets, at least
    num_chunks of them), joining only the chunks the span touches."""
    sealed = ends[num_chunks - 1] if num_chunks else 0
    stop = min(stop, sealed + len(tail))
    if stop <= start:
        return ""
    if start >= sealed:
        return tail[start - sealed: stop - sealed]
    first = bisect_right(ends, start, 0, num_chunks)  # the chunk holding character `start`
    begin = ends[first - 1] if first else 0
    if stop <= sealed:
        last = bisect_right(ends, stop - 1, first, num_chunks)
        text = chunks[first] if first == last else "".join(chunks[first: last + 1])
    else:
        text = "".join(chunks[first: num_chunks]) + tail[: stop - sealed]
    return text[start - begin: stop - begin]


class LazyField:
    """A cumulative field of one output, fixed at its step, built when first read."""

    __slots__ = ()

    def __len__(self) -> int:
        raise NotImplementedError

    def build(self) -> Any:
        raise NotImplementedError


class ListView(LazyField):
    """source[start:stop] of an append-only list, as a RequestOutput field (built when read)."""

    __slots__ = ("source", "start", "stop")

    def __init__(self, source: list, start: int, stop: int):
        self.source, self.start, self.stop = source, start, stop

    def __len__(self) -> int:
        return self.stop - self.start

    def build(self) -> list:
        return self.source[self.start: self.stop]


class TextView(LazyField):
    """The first `length` characters of chunks[:num_chunks] + tail."""

    __slots__ = ("chunks", "ends", "num_chunks", "tail", "length")

    def __init__(self, chunks: list[str], ends: list[int], num_chunks: int, tail: str, length: int):
        self.chunks, self.ends, self.num_chunks, self.tail = chunks, ends, num_chunks, tail
        self.length = min(length, (ends[num_chunks - 1] if num_chunks else 0) + len(tail))

    def __len__(self) -> int:
        return self.length

    def build(self) -> str:
        return _span(self.chunks, self.ends, self.num_chunks, self.tail, 0, self.length)


_FIELDS = ("request_id", "prompt", "prompt_token_ids", "token_ids", "text", "finished", "finish_reason",
           "stop_reason", "cached_tokens", "restored_tokens", "logprobs", "prompt_logprobs", "num_preemptions",
           "metrics", "delta")


class RequestOutput:
    """A request after a step: text and token ids so far (cumulative), finish, counters.

    Fields as a dataclass would have them (the constructor takes the same arguments); the
    engine's outputs hold `token_ids`, `text`, `logprobs` and `prompt_logprobs` as views fixed
    at their step, built into a list or a string when first read. `delta` is what the output
    adds to the request's previous one (set on every output Engine.step returns)."""

    __slots__ = ("request_id", "prompt", "prompt_token_ids", "_token_ids", "_text", "finished", "finish_reason",
                 "stop_reason", "cached_tokens", "restored_tokens", "_logprobs", "_prompt_logprobs",
                 "num_preemptions", "metrics", "delta")

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        token_ids: list[int],  # generated so far
        text: str,  # generated text so far; while running, a possible partial stop string is held back
        finished: bool,
        finish_reason: str | None,  # "stop", "length" or "abort" once finished
        stop_reason: str | int | None = None,  # the stop string or stop token id that ended it
        cached_tokens: int = 0,  # prompt tokens served from the prefix cache
        restored_tokens: int = 0,  # of cached_tokens, restored from the second KV tier
        logprobs: list[TokenLogprob] | None = None,
        # One entry per prompt token; None before prompt_logprobs_start and at index 0.
        prompt_logprobs: list[TokenLogprob | None] | None = None,
        num_preemptions: int = 0,
        metrics: dict[str, float] | None = None,  # ttft_s, e2e_s once known
        delta: OutputDelta | None = None,  # what this output adds to the request's previous one
    ):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self._token_ids = token_ids
        self._text = text
        self.finished = finished
        self.finish_reason = finish_reason
        self.stop_reason = stop_reason
        self.cached_tokens = cached_tokens
        self.restored_tokens = restored_tokens
        self._logprobs = logprobs
        self._prompt_logprobs = prompt_logprobs
        self.num_preemptions = num_preemptions
        self.metrics = {} if metrics is None else metrics
        self.delta = delta

    @property
    def token_ids(self) -> list[int]:
        value = self._token_ids
        if isinstance(value, LazyField):
            value = self._token_ids = value.build()
        return value

    @token_ids.setter
    def token_ids(self, value: list[int]) -> None:
        self._token_ids = value

    @property
    def text(self) -> str:
        value = self._text
        if isinstance(value, LazyField):
            value = self._text = value.build()
        return value

    @text.setter
    def text(self, value: str) -> None:
        self._text = value

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        value = self._logprobs
        if isinstance(value, LazyField):
            value = self._logprobs = value.build()
        return value

    @logprobs.setter
    def logprobs(self, value: list[TokenLogprob] | None) -> None:
        self._logprobs = value

    @property
    def prompt_logprobs(self) -> list[TokenLogprob | None] | None:
        value = self._prompt_logprobs
        if isinstance(value, LazyField):
            value = self._prompt_logprobs = value.build()
        return value

    @prompt_logprobs.setter
    def prompt_logprobs(self, value: list[TokenLogprob | None] | None) -> None:
        self._prompt_logprobs = value

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def completion_tokens(self) -> int:
        return len(self._token_ids)  # a view's length: nothing is built

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        return all(getattr(self, name) == getattr(other, name) for name in _FIELDS)

    __hash__ = None  # type: ignore[assignment]  # mutable, compared by value (as a dataclass)

    def __repr__(self) -> str:
        return "RequestOutput(" + ", ".join(f"{name}={getattr(self, name)!r}" for name in _FIELDS) + ")"
