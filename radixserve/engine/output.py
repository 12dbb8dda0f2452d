"""The output side of a request: its text as tokens arrive (incremental detokenizing), the
stop checks (EOS, stop ids, stop strings, stop_regex, grammar end, length) and the text a
running request may show (held back where a stop string or pattern could still begin)."""

from __future__ import annotations

import time
from typing import Any

import regex

from radixserve.core.request import Request
from radixserve.execution.detokenizer import IncrementalDetokenizer
from radixserve.outputs import RequestOutput


class OutputProcessor:
    """Text and stop decisions for the engine's requests; one detokenizer per request
    between `register` and `forget`."""

    def __init__(self, tokenizer: Any, eos_token_ids: set[int] | frozenset[int] | list[int]):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}

    def register(self, request: Request) -> None:
        if self.tokenizer is not None:
            self._detokenizers[request.request_id] = IncrementalDetokenizer(
                self.tokenizer, request.prompt_token_ids, request.params.skip_special_tokens
            )

    def forget(self, request_id: str) -> None:
        self._detokenizers.pop(request_id, None)

    def add_token(self, request: Request, token: int) -> tuple[str | None, str | int | None]:
        """Extend the text by a token already appended to the request; returns (finish
        reason, stop reason), (None, None) while the request goes on. Raises RuntimeError
        for a token its grammar refuses."""
        text_before = len(request.output_text)
        detok = self._detokenizers.get(request.request_id)
        if detok is not None:
            request.output_text += detok.add(token)
        if request.grammar is not None and not request.grammar.accept_token(token):
            raise RuntimeError(f"sampled token {token} violates the constraint of {request.request_id}")
        return self._stop_check(request, token, text_before)

    def output(self, request: Request) -> RequestOutput:
        """What a caller sees of the request now; a running request's text stops short of
        any stop string or pattern that could still complete."""
        text = request.output_text
        if not request.finished and request.params.stop:
            text = text[: max(0, len(text) - request.params.max_stop_len + 1)]
        if not request.finished and request.params.stop_regex:
            text = text[: stop_regex_holdback(text, request.params.stop_regex)]
        metrics: dict[str, float] = {}
        if request.first_token_time is not None:
            metrics["ttft_s"] = request.first_token_time - request.arrival_time
        if request.finished:
            metrics["e2e_s"] = time.monotonic() - request.arrival_time
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            token_ids=request.output_token_ids,
            text=text,
            finished=request.finished,
            finish_reason=request.finish_reason,
            stop_reason=request.stop_reason,
            cached_tokens=request.cached_tokens,
            restored_tokens=request.restored_tokens,
            logprobs=list(request.logprobs) if request.params.logprobs is not None else None,
            prompt_logprobs=list(request.prompt_logprobs) if request.prompt_logprobs is not None else None,
            num_preemptions=request.num_preemptions,
            metrics=metrics,
        )

    def _stop_check(self, request: Request, token: int, text_before: int) -> tuple[str | None, str | int | None]:
        params = request.params
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token in self.eos_token_ids:
                return "stop", None
            if token in params.stop_token_ids:
                return "stop", token
            if params.stop:
                hit = find_stop_string(request, text_before)
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


def find_stop_string(request: Request, text_before: int) -> str | None:
    """The earliest stop string that ends in the text this token added; cuts the text there."""
    params = request.params
    text = request.output_text
    offset = max(0, text_before - params.max_stop_len + 1)
    window = text[offset:]
    best = None
    for stop in params.stop:
        i = window.find(stop)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, stop)
    if best is None:
        return None
    cut = offset + best[0]
    request.output_text = text[: cut + len(best[1])] if params.include_stop_str_in_output else text[:cut]
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
    request.output_text = text[: best.end()] if params.include_stop_str_in_output else text[: best.start()]
    return best.group()


def stop_regex_holdback(text: str, patterns: list[str]) -> int:
    """Where the text a running request may show ends: before the earliest place a
    stop_regex could still match once more text arrives."""
    cut = len(text)
    for pattern in patterns:
        partial = regex.search(pattern, text, partial=True)
        if partial is not None:
            cut = min(cut, partial.start())
    return cut
