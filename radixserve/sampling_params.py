"""SamplingParams: how one request picks its tokens and when it stops."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import regex

MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    """Per-request sampling options, validated on construction (ValueError on bad values).

    temperature 0 means greedy. top_k 0 or -1 disables top-k. `logprobs=k` returns the
    chosen token's log-probability and the k most likely alternatives at every step
    (k=0: the chosen token only). `max_tokens=None` generates up to the context length;
    `max_tokens=0` is a prefill-only request: it computes the prompt (prompt logprobs,
    cache warm-up), samples nothing and finishes with "length".
    `prompt_logprobs=k` does the same for the prompt tokens from index
    `prompt_logprobs_start` on (index 0 has none); tokens before that index may still come
    from the prefix cache, the ones after it are computed.

    At most one constraint: `regex`, `json_schema` (a dict or a JSON string), `json_object`
    (any JSON value), `choices` (one of the given strings) or `structural_tag` (an xgrammar
    structural tag, a dict or JSON string: how the server constrains tool calls). The
    output then always matches it (unless max_tokens cuts it short).

    `speculative`: True drafts this request's next tokens from its own prompt and output and
    verifies them in one step (prompt lookup), False never, None as the engine's
    `speculative` option says. Outputs are the same either way (greedy: token for token;
    sampled: in distribution). Constrained requests, and those asking for logprobs or using
    penalties or a seed with temperature > 0, never speculate.

    `stop_regex` (a pattern or a list of them) stops like a stop string: at the earliest
    match in the generated text, which is cut before it (or after it with
    `include_stop_str_in_output`); the matched text is the stop reason.
    """

    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_regex: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    prompt_logprobs_start: int = 0
    skip_special_tokens: bool = True
    regex: str | None = None
    json_schema: dict | str | None = None
    json_object: bool = False
    choices: list[str] | None = None
    structural_tag: dict | str | None = None
    speculative: bool | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        if isinstance(self.stop_regex, str):
            self.stop_regex = [self.stop_regex]
        if self.stop_regex is None:
            self.stop_regex = []
        if not isinstance(self.stop_regex, (list, tuple)):
            raise ValueError(f"stop_regex must be a string or a list of strings, got {self.stop_regex!r}")
        self.stop_regex = list(self.stop_regex)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "SamplingParams":
        """Build from a JSON-like dict; unknown keys are a ValueError, not silently dropped."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(unknown)}")
        return cls(**values)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )

    @property
    def constrained(self) -> bool:
        return (
            self.regex is not None or self.json_schema is not None or self.json_object or self.choices is not None
            or self.structural_tag is not None
        )

    @property
    def prefill_only(self) -> bool:
        """max_tokens=0: compute the prompt, sample nothing."""
        return self.max_tokens == 0

    @property
    def max_stop_len(self) -> int:
        return max((len(s) for s in self.stop), default=0)

    def _validate(self) -> None:
        if self.max_tokens is not None:
            _require_int("max_tokens", self.max_tokens, minimum=0)
        _require_int("min_tokens", self.min_tokens, minimum=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        _require_number("temperature", self.temperature, low=0.0, high=100.0)
        _require_int("top_k", self.top_k, minimum=0)
        _require_number("top_p", self.top_p, low=0.0, high=1.0, low_open=True)
        _require_number("min_p", self.min_p, low=0.0, high=1.0)
        _require_number("repetition_penalty", self.repetition_penalty, low=0.0, high=100.0, low_open=True)
        _require_number("frequency_penalty", self.frequency_penalty, low=-2.0, high=2.0)
        _require_number("presence_penalty", self.presence_penalty, low=-2.0, high=2.0)
        if self.seed is not None:
            _require_int("seed", self.seed, minimum=-(2**63))
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must be a list of non-empty strings, got {s!r}")
        for pattern in self.stop_regex:
            _require_stop_regex(pattern)
        for t in self.stop_token_ids:
            _require_int("stop_token_ids", t, minimum=0)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _require_int(name, value, minimum=0)
                if value > MAX_LOGPROBS:
                    raise ValueError(f"{name} must be at most {MAX_LOGPROBS}, got {value}")
        _require_int("prompt_logprobs_start", self.prompt_logprobs_start, minimum=0)
        self._validate_constraint()
        if self.speculative is not None and not isinstance(self.speculative, bool):
            raise ValueError(f"speculative must be a boolean or None, got {self.speculative!r}")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "json_object"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean, got {getattr(self, name)!r}")


    def _validate_constraint(self) -> None:
        given = [n for n in ("regex", "json_schema", "choices", "structural_tag") if getattr(self, n) is not None]
        given += ["json_object"] if self.json_object is True else []
        if len(given) > 1:
            raise ValueError(f"at most one of regex, json_schema, json_object, choices; got {', '.join(given)}")
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise ValueError(f"regex must be a non-empty string, got {self.regex!r}")
        if self.json_schema is not None and not isinstance(self.json_schema, (dict, str)):
            raise ValueError(f"json_schema must be a dict or a JSON string, got {type(self.json_schema).__name__}")
        if self.structural_tag is not None and not isinstance(self.structural_tag, (dict, str)):
            raise ValueError(f"structural_tag must be a dict or a JSON string, got {type(self.structural_tag).__name__}")
        if self.choices is not None:
            if not isinstance(self.choices, list) or not self.choices:
                raise ValueError("choices must be a non-empty list of strings")
            if not all(isinstance(c, str) and c for c in self.choices):
                raise ValueError("choices must be non-empty strings")


def _require_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _require_stop_regex(pattern: Any) -> None:
    if not isinstance(pattern, str) or not pattern:
        raise ValueError(f"stop_regex must be a non-empty string or a list of them, got {pattern!r}")
    try:
        compiled = regex.compile(pattern)
    except regex.error as exc:
        raise ValueError(f"stop_regex {pattern!r} is not a valid regular expression: {exc}") from None
    if compiled.fullmatch(""):
        raise ValueError(f"stop_regex {pattern!r} matches the empty string, so it would stop at once")


def _require_number(
    name: str, value: Any, low: float, high: float, low_open: bool = False
) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise ValueError(f"{name} must be a number, got {value!r}")
    too_low = value <= low if low_open else value < low
    if too_low or value > high:
        bracket = "(" if low_open else "["
        raise ValueError(f"{name} must be in {bracket}{low}, {high}], got {value}")
