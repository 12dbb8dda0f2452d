"""The output side of a request: its text as tokens arrive (incremental detokenizing), the
stop checks (EOS, stop ids, stop strings, stop_regex, grammar end, length), the text a
running request may show (held back where a stop string or pattern could still begin), and
each step's output: its delta (what the step added) and cumulative views fixed at the step,
O(what the step added), never a copy of the whole answer."""

from __future__ import annotations

import time
from typing import Any

import regex

from radixserve.core.request import Request
from radixserve.execution.detokenizer import IncrementalDetokenizer
from radixserve.outputs import OutputDelta, RequestOutput, TokenLogprob, ListView


class _Stream:
    """What one request's outputs have carried so far, and what its stop strings hold back."""

    __slots__ = ("tokens", "chars", "started", "prompt_logprobs", "max_stop_len")

    def __init__(self, request: Request):
        self.tokens = 0  # generated tokens the outputs carried
        self.chars = 0  # characters of text they showed
        self.started = False
        # A copy of the request's prompt logprobs that outputs share (each builds its own list
        # from it when read); None until the first output, and again whenever the runner sets one.
        self.prompt_logprobs: list[TokenLogprob | None] | None = None
        self.max_stop_len = request.params.max_stop_len


class OutputProcessor:
    """Text and stop decisions for the engine's requests, and each step's output; one
    detokenizer per request between `register` and `forget`."""

    def __init__(self, tokenizer: Any, eos_token_ids: set[int] | frozenset[int] | list[int]):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._streams: dict[str, _Stream] = {}

    def register(self, request: Request) -> None:
        if self.tokenizer is not None:
            self._detokenizers[request.request_id] = IncrementalDetokenizer(
                self.tokenizer, request.prompt_token_ids, request.params.skip_special_tokens
            )

    def forget(self, request_id: str) -> None:
        self._detokenizers.pop(request_id, None)
        self._streams.pop(request_id, None)

    def _stream(self, request: Request) -> _Stream:
        stream = self._streams.get(request.request_id)
        if stream is None:
            stream = self._streams[request.request_id] = _Stream(request)
        return stream

    def add_token(self, request: Request, token: int) -> tuple[str | None, str | int | None]:
        """Extend the text by a token already appended to the request; returns (finish
        reason, stop reason), (None, None) while the request goes on. Raises RuntimeError
        for a token its grammar refuses."""
        detok = self._detokenizers.get(request.request_id)
        if detok is None or self._ends_on_eos(request, token):  # the stop token's text is not the answer's
            return self.add_text(request, token, "")
        return self.add_text(request, token, detok.add(token))

    def _ends_on_eos(self, request: Request, token: int) -> bool:
        """An end-of-sequence token that stops the request: its text (kept where special tokens
        are, as with tools whose markers are special) is left out unless include_stop_str_in_output."""
        params = request.params
        return (token in self.eos_token_ids and not params.ignore_eos and not params.include_stop_str_in_output
                and request.num_output_tokens >= params.min_tokens)

    def add_text(self, request: Request, token: int, piece: str) -> tuple[str | None, str | int | None]:
        """add_token for a token whose text piece is known (decoded)."""
        text_before = len(request.text)
        request.text.append(piece)
        if request.grammar is not None and not request.grammar.accept_token(token):
            raise RuntimeError(f"sampled token {token} violates the constraint of {request.request_id}")
        return self._stop_check(request, token, text_before)

    def set_prompt_logprob(self, request: Request, index: int, logprob: TokenLogprob) -> None:
        request.prompt_logprobs[index] = logprob
        stream = self._streams.get(request.request_id)
        if stream is not None:
            stream.prompt_logprobs = None  # the next output copies them again

    def output(self, request: Request) -> RequestOutput:
        """What a caller sees of the request now, and its delta (what it adds to the request's
        previous output); a running request's text stops short of any stop string or
        pattern that could still complete. O(what the step added): the cumulative fields are
        views of the request's lists at their lengths now, built only when read."""
        stream = self._stream(request)
        token_ids, text, finished = request.token_ids, request.text, request.finished
        start, end, sent = len(request.prompt_token_ids), len(token_ids), stream.tokens
        visible = len(text) if finished else visible_text_length(request, stream.max_stop_len)
        logprobs = None
        if request.params.logprobs is not None:
            num_logprobs = len(request.logprobs)
            logprobs = ListView(request.logprobs, 0, num_logprobs)
            new_logprobs = request.logprobs[sent: num_logprobs]
        else:
            new_logprobs = None
        delta = OutputDelta(token_ids[start + sent: end], new_logprobs, text.slice(stream.chars, visible),
                            not stream.started)
        stream.tokens, stream.started = end - start, True
        if visible > stream.chars:
            stream.chars = visible
        prompt_logprobs = None
        if request.prompt_logprobs is not None:
            if stream.prompt_logprobs is None:  # once a request (again after any recompute)
                stream.prompt_logprobs = list(request.prompt_logprobs)
            prompt_logprobs = ListView(stream.prompt_logprobs, 0, len(stream.prompt_logprobs))
        metrics: dict[str, float] = {}
        if request.first_token_time is not None:
            metrics["ttft_s"] = request.first_token_time - request.arrival_time
        if finished:
            metrics["e2e_s"] = time.monotonic() - request.arrival_time
        return RequestOutput(
            request.request_id, request.prompt, request.prompt_token_ids, ListView(token_ids, start, end),
            text.snapshot(visible), finished, request.finish_reason, request.stop_reason, request.cached_tokens,
            request.restored_tokens, logprobs, prompt_logprobs, request.num_preemptions, metrics, delta,
        )

    def _stop_check(self, request: Request, token: int, text_before: int) -> tuple[str | None, str | int | None]:
        params = request.params
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token in self.eos_token_ids:
                return "stop", None
            if token in params.stop_token_ids:
                return "stop", token
            if params.stop:
                hit = find_stop_string(request, text_before, self._stream(request).max_stop_len)
                if hit is not None:
                    return "stop", hit
            if params.stop_regex:
                hit = find_stop_regex(request)
                if hit is not None:
                    return "stop", hit
        if request.grammar is not None and request.grammar.is_terminated():
            return "stop", None
        if request.num_tokens >= request.max_total_tokens:
            return "length", None
        return None, None


def find_stop_string(request: Request, text_before: int, max_stop_len: int | None = None) -> str | None:
    """The earliest stop string that ends in the text this token added; cuts the text there.
    Reads only that text and the max_stop_len - 1 characters before it."""
    params = request.params
    if max_stop_len is None:
        max_stop_len = params.max_stop_len
    offset = max(0, text_before - max_stop_len + 1)
    window = request.text.slice(offset)
    best = None
    for stop in params.stop:
        i = window.find(stop)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, stop)
    if best is None:
        return None
    cut = offset + best[0]
    request.text.truncate(cut + len(best[1]) if params.include_stop_str_in_output else cut)
    return best[1]


def find_stop_regex(request: Request) -> str | None:
    """The earliest stop_regex match in the generated text (the first pattern's at a tie);
    cuts the text there. The whole text is searched: a match may begin before this token."""
    params = request.params
    text = request.output_text
    matches = [m for m in (regex.search(p, text) for p in params.stop_regex) if m is not None]
    if not matches:
        return None
    best = min(matches, key=lambda m: m.start())
    request.text.truncate(best.end() if params.include_stop_str_in_output else best.start())
    return best.group()


def visible_text_length(request: Request, max_stop_len: int | None = None) -> int:
    """How much of the request's text a caller may see now: all of it once finished; while
    running, not the last max_stop_len - 1 characters (a stop string may still complete
    there), nor anything from where a stop_regex could still match (the whole text is read)."""
    length = len(request.text)
    if request.finished:
        return length
    params = request.params
    if params.stop:
        held = (params.max_stop_len if max_stop_len is None else max_stop_len) - 1
        if held > 0:
            length = max(0, length - held)
    if params.stop_regex:  # read over what the stop strings leave, as a caller would see it
        text = request.output_text
        length = stop_regex_holdback(text[:length] if length < len(text) else text, params.stop_regex)
    return length


def stop_regex_holdback(text: str, patterns: list[str]) -> int:
    """Where the text a running request may show ends: before the earliest place a
    stop_regex could still match once more text arrives."""
    cut = len(text)
    for pattern in patterns:
        partial = regex.search(pattern, text, partial=True)
        if partial is not None:
            cut = min(cut, partial.start())
    return cut
